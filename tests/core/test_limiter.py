"""The limiter: slots per (host, model), a bounded FIFO line, and waits watching other pairs.

Every test drives one event loop step by step: `place` is synchronous, and a waiter's grant is
visible on its `granted` future at once (a slot offered to a watcher once the test, standing for
the waiting task, has called `settle`), so nothing here depends on timing.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import Callable

import pytest

from routing.core.errors import HostRemoved, QueueTimeout
from routing.core.limiter import Limiter, PairSnapshot, Slot, Waiter
from routing.core.pairs import Pair


async def settle(rounds: int = 5) -> None:
    """Let every ready task and callback on the loop run a few steps."""
    for _ in range(rounds):
        await asyncio.sleep(0)


def take(limiter: Limiter, host: str = "h1", model: str = "m") -> Slot:
    """A slot of the pair, which must be free right now."""
    got = limiter.place([Pair(host, model)])
    assert isinstance(got, Slot), f"expected a free slot on {host}/{model}, got {got!r}"
    return got


def hold(limiter: Limiter, count: int, host: str = "h1", model: str = "m") -> list[Slot]:
    return [take(limiter, host, model) for _ in range(count)]


def line_up(limiter: Limiter, host: str = "h1", model: str = "m") -> Waiter:
    """A place in the pair's line, which must have room right now."""
    got = limiter.place([Pair(host, model)])
    assert isinstance(got, Waiter), f"expected a place in line on {host}/{model}, got {got!r}"
    return got


async def wait_for_slot(waiter: Waiter) -> Slot:
    """Await the grant as `Waiter`'s docstring tells a caller to: on cancellation, leave and
    release the slot that may have been handed over in the same loop turn."""
    try:
        while not waiter.granted.done():
            waiter.settle()  # the slots offered to it: decided here, in the waiting task
            if not waiter.granted.done():
                await asyncio.wait((waiter.granted, waiter.offered), return_when="FIRST_COMPLETED")
        return waiter.granted.result()
    except asyncio.CancelledError:
        slot = waiter.cancel()
        if slot is not None:
            slot.release()
        raise


def granted_slot(waiter: Waiter) -> Slot:
    """The slot `waiter` holds, once its task has decided the slots offered to it."""
    waiter.settle()
    assert waiter.granted.done(), "the waiter was not handed a slot"
    return waiter.granted.result()


# -- slots and the line -------------------------------------------------------------------


async def test_fifth_request_waits_when_four_slots_are_held() -> None:
    limiter = Limiter()
    limiter.configure("h1", "m", parallel=4, queue_max=4)
    slots = hold(limiter, 4)

    fifth = line_up(limiter)

    assert not fifth.granted.done()
    assert limiter.in_flight("h1", "m") == 4
    assert limiter.queued("h1", "m") == 1
    slots[0].release()
    slot = granted_slot(fifth)
    assert (slot.host, slot.model) == ("h1", "m")
    assert limiter.in_flight("h1", "m") == 4
    assert limiter.queued("h1", "m") == 0


async def test_ninth_request_is_refused_when_queue_is_full() -> None:
    limiter = Limiter()
    limiter.configure("h1", "m", parallel=4, queue_max=4)
    hold(limiter, 4)
    waiters = [line_up(limiter) for _ in range(4)]

    assert limiter.place([Pair("h1", "m")]) is None

    assert limiter.in_flight("h1", "m") == 4
    assert limiter.queued("h1", "m") == 4
    assert not any(waiter.granted.done() for waiter in waiters)


async def test_waiters_are_granted_in_arrival_order() -> None:
    limiter = Limiter()
    limiter.configure("h1", "m", parallel=1, queue_max=5)
    (held,) = hold(limiter, 1)
    granted: list[int] = []

    async def wait_then_note(number: int, waiter: Waiter) -> None:
        slot = await wait_for_slot(waiter)
        granted.append(number)
        await asyncio.sleep(0)
        slot.release()

    tasks = [asyncio.create_task(wait_then_note(number, line_up(limiter))) for number in range(5)]
    await settle()
    held.release()
    await asyncio.wait_for(asyncio.gather(*tasks), timeout=10)

    assert granted == [0, 1, 2, 3, 4]
    assert limiter.in_flight("h1", "m") == 0


async def test_release_hands_the_slot_to_the_head_waiter_not_a_newcomer() -> None:
    limiter = Limiter()
    limiter.configure("h1", "m", parallel=1, queue_max=1)
    (held,) = hold(limiter, 1)
    waiter = line_up(limiter)

    held.release()
    # The newcomer arrives before the waiter's task has had a chance to run again.
    newcomer = limiter.place([Pair("h1", "m")])

    assert isinstance(newcomer, Waiter)
    assert granted_slot(waiter).host == "h1"
    assert not newcomer.granted.done()
    assert limiter.in_flight("h1", "m") == 1
    assert limiter.queued("h1", "m") == 1


async def test_cancelled_waiter_gives_back_its_place() -> None:
    limiter = Limiter()
    limiter.configure("h1", "m", parallel=1, queue_max=1)
    (held,) = hold(limiter, 1)
    leaver = line_up(limiter)

    assert leaver.cancel() is None
    stayer = line_up(limiter)

    assert leaver.granted.cancelled()
    assert limiter.queued("h1", "m") == 1
    held.release()
    assert granted_slot(stayer).host == "h1"
    assert limiter.in_flight("h1", "m") == 1
    assert limiter.queued("h1", "m") == 0


async def test_waiter_whose_task_is_cancelled_gives_back_its_place() -> None:
    limiter = Limiter()
    limiter.configure("h1", "m", parallel=1, queue_max=1)
    (held,) = hold(limiter, 1)
    task = asyncio.create_task(wait_for_slot(line_up(limiter)))
    await settle()

    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    assert limiter.queued("h1", "m") == 0
    stayer = line_up(limiter)
    held.release()
    assert granted_slot(stayer).host == "h1"


async def test_waiter_cancelled_in_the_turn_of_its_hand_over_passes_the_slot_on() -> None:
    limiter = Limiter()
    limiter.configure("h1", "m", parallel=1, queue_max=2)
    (held,) = hold(limiter, 1)
    first = asyncio.create_task(wait_for_slot(line_up(limiter)))
    second = asyncio.create_task(wait_for_slot(line_up(limiter)))
    await settle()

    held.release()  # hands the slot to `first`, whose task has not run since
    first.cancel()  # the client leaves in that very turn
    await settle()

    assert first.cancelled()
    assert second.done() and not second.cancelled()
    assert limiter.in_flight("h1", "m") == 1
    assert limiter.queued("h1", "m") == 0
    second.result().release()
    assert limiter.in_flight("h1", "m") == 0


async def test_waiter_cancelled_in_the_turn_of_its_hand_over_frees_the_slot_when_alone() -> None:
    limiter = Limiter()
    limiter.configure("h1", "m", parallel=1, queue_max=1)
    (held,) = hold(limiter, 1)
    task = asyncio.create_task(wait_for_slot(line_up(limiter)))
    await settle()

    held.release()
    task.cancel()
    await settle()

    assert task.cancelled()
    assert limiter.in_flight("h1", "m") == 0
    assert limiter.free_for("h1", "m") == 1


async def test_cancel_after_the_hand_over_returns_the_slot_to_release() -> None:
    limiter = Limiter()
    limiter.configure("h1", "m", parallel=1, queue_max=1)
    (held,) = hold(limiter, 1)
    waiter = line_up(limiter)
    held.release()

    slot = waiter.cancel()

    assert isinstance(slot, Slot)
    assert limiter.in_flight("h1", "m") == 1
    slot.release()
    assert limiter.in_flight("h1", "m") == 0


async def test_fail_ends_the_wait_with_the_error_and_frees_its_place() -> None:
    limiter = Limiter()
    limiter.configure("h1", "m", parallel=1, queue_max=1)
    (held,) = hold(limiter, 1)
    waiter = line_up(limiter)
    changes = waiter.changes()

    waiter.fail(QueueTimeout("queue timeout"))

    with pytest.raises(QueueTimeout):
        await waiter.granted
    assert changes.is_set()
    assert waiter.position == 0
    assert waiter.cancel() is None
    assert limiter.queued("h1", "m") == 0
    newcomer = line_up(limiter)
    held.release()
    assert granted_slot(newcomer).host == "h1"


async def test_fail_after_the_hand_over_leaves_the_slot_with_the_waiter() -> None:
    limiter = Limiter()
    limiter.configure("h1", "m", parallel=1, queue_max=1)
    (held,) = hold(limiter, 1)
    waiter = line_up(limiter)
    held.release()

    waiter.fail(QueueTimeout("too late"))

    slot = granted_slot(waiter)
    assert limiter.in_flight("h1", "m") == 1
    slot.release()
    assert limiter.in_flight("h1", "m") == 0


async def test_second_release_is_a_no_op() -> None:
    limiter = Limiter()
    limiter.configure("h1", "m", parallel=2, queue_max=0)
    first, second = hold(limiter, 2)

    first.release()
    first.release()

    assert limiter.in_flight("h1", "m") == 1
    second.release()
    assert limiter.in_flight("h1", "m") == 0


async def test_unconfigured_pair_has_one_slot_and_no_queue() -> None:
    limiter = Limiter()

    assert limiter.free_for("h1", "m") == 1
    slot = take(limiter)
    assert limiter.place([Pair("h1", "m")]) is None

    assert limiter.in_flight("h1", "m") == 1
    assert limiter.free_for("h1", "m") == 0
    slot.release()
    assert limiter.in_flight("h1", "m") == 0
    assert limiter.snapshot() == []  # nothing kept for a pair nobody configured or uses


async def test_an_unconfigured_model_going_idle_keeps_the_hosts_other_models_as_they_were() -> None:
    limiter = Limiter()
    limiter.configure("h1", "m", parallel=2, queue_max=1)
    (held,) = hold(limiter, 1)

    take(limiter, "h1", "other").release()  # a model the host was never configured for

    assert limiter.snapshot() == [PairSnapshot("h1", "m", 2, 1, 1, 0)]
    take(limiter)  # its second slot is still there, and no third
    assert isinstance(limiter.place([Pair("h1", "m")]), Waiter)
    held.release()


# -- placing over several pairs -----------------------------------------------------------


async def test_place_falls_through_to_the_next_pair_with_a_free_slot() -> None:
    limiter = Limiter()
    limiter.configure("h1", "m", parallel=1, queue_max=2)
    limiter.configure("h2", "m", parallel=1, queue_max=2)
    take(limiter, "h1")

    got = limiter.place([Pair("h1", "m"), Pair("h2", "m")])

    assert isinstance(got, Slot)
    assert got.host == "h2"
    assert limiter.queued("h1", "m") == 0


async def test_place_takes_a_queue_place_on_the_first_pair_with_room_when_no_slot_is_free() -> None:
    limiter = Limiter()
    limiter.configure("h1", "m", parallel=1, queue_max=0)
    limiter.configure("h2", "m", parallel=1, queue_max=1)
    limiter.configure("h3", "m", parallel=1, queue_max=1)
    for host in ("h1", "h2", "h3"):
        take(limiter, host)

    got = limiter.place([Pair("h1", "m"), Pair("h2", "m"), Pair("h3", "m")])

    assert isinstance(got, Waiter)
    assert got.host == "h2"
    assert got.position == 1
    assert [limiter.queued(host, "m") for host in ("h1", "h2", "h3")] == [0, 1, 0]


async def test_place_refuses_when_every_pair_is_full_and_changes_nothing() -> None:
    limiter = Limiter()
    limiter.configure("h1", "m", parallel=1, queue_max=1)
    take(limiter, "h1")
    line_up(limiter, "h1")
    take(limiter, "h2")  # unconfigured: one slot, no queue
    before = limiter.snapshot()

    assert limiter.place([Pair("h1", "m"), Pair("h2", "m")]) is None

    assert limiter.snapshot() == before
    assert before == [PairSnapshot("h1", "m", 1, 1, 1, 1), PairSnapshot("h2", "m", 1, 0, 1, 0)]


# -- watching other pairs -----------------------------------------------------------------


async def test_watch_hands_a_free_slot_of_a_watched_pair_at_once() -> None:
    limiter = Limiter()
    limiter.configure("h1", "m", parallel=1, queue_max=1)
    limiter.configure("h2", "m", parallel=1, queue_max=1)
    take(limiter, "h1")
    waiter = line_up(limiter, "h1")

    limiter.watch(waiter, [Pair("h1", "m"), Pair("h2", "m")])

    assert granted_slot(waiter).host == "h2"
    assert limiter.queued("h1", "m") == 0
    assert limiter.in_flight("h2", "m") == 1


async def test_watch_hands_the_next_slot_released_on_a_watched_pair() -> None:
    limiter = Limiter()
    limiter.configure("h1", "m", parallel=1, queue_max=1)
    limiter.configure("h2", "m", parallel=1, queue_max=1)
    take(limiter, "h1")
    (busy,) = hold(limiter, 1, "h2")
    waiter = line_up(limiter, "h1")

    limiter.watch(waiter, [Pair("h2", "m")])
    assert not waiter.granted.done()
    busy.release()

    assert granted_slot(waiter).host == "h2"
    assert limiter.queued("h1", "m") == 0
    assert limiter.in_flight("h2", "m") == 1


async def test_a_watched_pair_serves_its_own_line_before_a_watcher() -> None:
    limiter = Limiter()
    limiter.configure("h1", "m", parallel=1, queue_max=1)
    limiter.configure("h2", "m", parallel=1, queue_max=1)
    take(limiter, "h1")
    (busy,) = hold(limiter, 1, "h2")
    watcher = line_up(limiter, "h1")
    own = line_up(limiter, "h2")
    limiter.watch(watcher, [Pair("h2", "m")])

    busy.release()

    assert granted_slot(own).host == "h2"
    assert not watcher.granted.done()
    assert watcher.position == 1
    granted_slot(own).release()  # h2's line is empty now: the watcher is next there
    assert granted_slot(watcher).host == "h2"


async def test_a_watcher_is_handed_nothing_while_accept_refuses_the_pair() -> None:
    limiter = Limiter()
    limiter.configure("h1", "m", parallel=1, queue_max=1)
    limiter.configure("h2", "m", parallel=1, queue_max=1)
    take(limiter, "h1")
    (busy,) = hold(limiter, 1, "h2")
    waiter = line_up(limiter, "h1")
    usable = {"h2": False}

    limiter.watch(waiter, [Pair("h2", "m")], accept=lambda pair: usable[pair[0]])
    busy.release()
    waiter.settle()  # its task decides the slot offered to it

    assert not waiter.granted.done()
    assert limiter.in_flight("h2", "m") == 0
    assert limiter.free_for("h2", "m") == 1


async def test_wake_offers_free_slots_again_once_accept_agrees() -> None:
    limiter = Limiter()
    limiter.configure("h1", "m", parallel=1, queue_max=1)
    limiter.configure("h2", "m", parallel=2, queue_max=0)
    take(limiter, "h1")
    waiter = line_up(limiter, "h1")
    usable = {"h2": False}
    limiter.watch(waiter, [Pair("h2", "m")], accept=lambda pair: usable[pair[0]])
    assert not waiter.granted.done()  # h2 is free, but refused

    limiter.wake("h2")
    waiter.settle()
    assert not waiter.granted.done()
    usable["h2"] = True
    limiter.wake("h2")

    assert granted_slot(waiter).host == "h2"
    assert limiter.in_flight("h2", "m") == 1
    assert limiter.queued("h1", "m") == 0


async def test_waking_a_host_the_limiter_does_not_know_does_nothing() -> None:
    limiter = Limiter()
    limiter.configure("h1", "m", parallel=1, queue_max=0)

    limiter.wake("h9")  # e.g. a host with no models yet: never an error

    assert limiter.snapshot() == [PairSnapshot("h1", "m", 1, 0, 0, 0)]


async def test_watch_prefers_pairs_in_the_order_given() -> None:
    limiter = Limiter()
    for host in ("h1", "h2", "h3"):
        limiter.configure(host, "m", parallel=1, queue_max=1)
    take(limiter, "h1")
    waiter = line_up(limiter, "h1")

    limiter.watch(waiter, [Pair("h3", "m"), Pair("h2", "m")])

    assert granted_slot(waiter).host == "h3"
    assert limiter.free_for("h2", "m") == 1


async def test_watchers_are_served_in_the_order_they_began_to_watch() -> None:
    limiter = Limiter()
    limiter.configure("h1", "m", parallel=1, queue_max=2)
    limiter.configure("h2", "m", parallel=1, queue_max=0)
    take(limiter, "h1")
    (busy,) = hold(limiter, 1, "h2")
    first, second = line_up(limiter, "h1"), line_up(limiter, "h1")
    limiter.watch(second, [Pair("h2", "m")])
    limiter.watch(first, [Pair("h2", "m")])

    busy.release()

    assert granted_slot(second).host == "h2"
    assert not first.granted.done()
    assert first.position == 1


async def test_a_waiter_granted_at_home_stops_watching_other_pairs() -> None:
    limiter = Limiter()
    limiter.configure("h1", "m", parallel=1, queue_max=1)
    limiter.configure("h2", "m", parallel=1, queue_max=0)
    (home,) = hold(limiter, 1, "h1")
    (busy,) = hold(limiter, 1, "h2")
    waiter = line_up(limiter, "h1")
    limiter.watch(waiter, [Pair("h2", "m")])

    home.release()
    busy.release()

    assert granted_slot(waiter).host == "h1"
    assert limiter.in_flight("h1", "m") == 1
    assert limiter.in_flight("h2", "m") == 0


async def test_a_waiter_with_no_line_is_handed_a_slot_only_through_its_watch() -> None:
    limiter = Limiter()
    limiter.configure("h1", "m", parallel=1, queue_max=0)
    (busy,) = hold(limiter, 1, "h1")
    waiter = limiter.waiter()

    limiter.watch(waiter, [Pair("h1", "m")])
    assert (waiter.host, waiter.position) == ("", 0)
    assert not waiter.granted.done()
    busy.release()

    assert granted_slot(waiter).host == "h1"
    granted_slot(waiter).release()
    assert limiter.snapshot() == [PairSnapshot("h1", "m", 1, 0, 0, 0)]


async def test_watch_does_nothing_for_a_waiter_whose_wait_has_ended() -> None:
    limiter = Limiter()
    limiter.configure("h1", "m", parallel=1, queue_max=1)
    limiter.configure("h2", "m", parallel=1, queue_max=0)
    take(limiter, "h1")
    waiter = line_up(limiter, "h1")
    waiter.cancel()

    limiter.watch(waiter, [Pair("h2", "m")])

    assert limiter.in_flight("h2", "m") == 0
    assert limiter.free_for("h2", "m") == 1


async def test_a_cancelled_watcher_leaves_no_trace_on_the_watched_pair() -> None:
    limiter = Limiter()
    limiter.configure("h1", "m", parallel=1, queue_max=1)
    take(limiter, "h1")
    (busy,) = hold(limiter, 1, "h9")  # unconfigured: kept only while in use
    waiter = line_up(limiter, "h1")
    limiter.watch(waiter, [Pair("h9", "m")])

    waiter.cancel()
    busy.release()

    assert limiter.in_flight("h9", "m") == 0
    assert [snap.host for snap in limiter.snapshot()] == ["h1"]


# -- a slot offered to a watcher: its own task decides --------------------------------------


def two_watchers(accepts: dict[str, bool]) -> tuple[Limiter, Slot, Waiter, Waiter, list[str]]:
    """h1 full with a line of two, both watching h2 (its one slot held: returned); each
    watcher's accept says `accepts[name]` and notes its name in the list returned."""
    limiter = Limiter()
    limiter.configure("h1", "m", parallel=1, queue_max=2)
    limiter.configure("h2", "m", parallel=1, queue_max=1)
    take(limiter, "h1")
    (busy,) = hold(limiter, 1, "h2")
    first, second = line_up(limiter, "h1"), line_up(limiter, "h1")
    asked: list[str] = []

    def accept(name: str) -> Callable[[tuple[str, str]], bool]:
        def asks(pair: tuple[str, str]) -> bool:
            asked.append(name)
            return accepts[name]

        return asks

    limiter.watch(first, [Pair("h2", "m")], accept=accept("first"))
    limiter.watch(second, [Pair("h2", "m")], accept=accept("second"))
    return limiter, busy, first, second, asked


async def test_a_release_asks_no_watcher_and_holds_the_slot_for_the_first_one() -> None:
    limiter, busy, first, second, asked = two_watchers({"first": True, "second": True})

    busy.release()

    assert asked == []  # nothing of the waiting requests ran inside the release
    assert first.offered.done() and not second.offered.done()
    assert limiter.in_flight("h2", "m") == 1  # held for the watcher: no newcomer takes it
    assert isinstance(limiter.place([Pair("h2", "m")]), Waiter)
    assert granted_slot(first).host == "h2"
    assert asked == ["first"]
    assert limiter.in_flight("h2", "m") == 1


async def test_a_slot_a_watcher_declines_is_offered_to_the_next_watcher_at_once() -> None:
    limiter, busy, first, second, asked = two_watchers({"first": False, "second": True})

    busy.release()
    first.settle()

    assert not first.granted.done()
    assert second.offered.done()
    assert granted_slot(second).host == "h2"
    assert asked == ["first", "second"]
    assert limiter.in_flight("h2", "m") == 1
    assert first.position == 1  # declining kept its place at home


async def test_a_slot_every_watcher_declines_is_free_again() -> None:
    limiter, busy, first, second, asked = two_watchers({"first": False, "second": False})

    busy.release()
    first.settle()
    second.settle()

    assert asked == ["first", "second"]
    assert not first.granted.done() and not second.granted.done()
    assert (limiter.in_flight("h2", "m"), limiter.free_for("h2", "m")) == (0, 1)
    take(limiter, "h2")  # a newcomer takes it


async def test_a_declined_slot_goes_first_to_a_request_that_joined_its_line_meanwhile() -> None:
    limiter, busy, first, second, asked = two_watchers({"first": False, "second": True})

    busy.release()
    own = line_up(limiter, "h2")  # the slot is held for the watcher: the newcomer queues
    first.settle()

    assert granted_slot(own).host == "h2"
    second.settle()
    assert not second.granted.done()
    assert asked == ["first"]


async def test_a_wait_that_ends_with_a_slot_offered_passes_it_to_the_next_watcher() -> None:
    limiter, busy, first, second, asked = two_watchers({"first": True, "second": True})

    busy.release()
    first.fail(QueueTimeout("its deadline"))

    assert second.offered.done()
    assert granted_slot(second).host == "h2"
    assert asked == ["second"]
    assert limiter.in_flight("h2", "m") == 1


async def test_a_cancelled_wait_with_a_slot_offered_gives_it_back() -> None:
    limiter, busy, first, second, _ = two_watchers({"first": True, "second": True})
    second.cancel()

    busy.release()
    assert first.cancel() is None

    assert (limiter.in_flight("h2", "m"), limiter.queued("h1", "m")) == (0, 0)
    assert limiter.free_for("h2", "m") == 1


async def test_an_accept_that_raises_leaves_the_offer_with_the_wait_until_it_ends() -> None:
    limiter = Limiter()
    limiter.configure("h1", "m", parallel=1, queue_max=1)
    limiter.configure("h2", "m", parallel=1, queue_max=0)
    take(limiter, "h1")
    (busy,) = hold(limiter, 1, "h2")
    waiter = line_up(limiter, "h1")

    def broken(pair: tuple[str, str]) -> bool:
        raise RuntimeError("pricing failed")

    limiter.watch(waiter, [Pair("h2", "m")], accept=broken)
    busy.release()
    with pytest.raises(RuntimeError):
        waiter.settle()
    assert limiter.in_flight("h2", "m") == 1

    assert waiter.cancel() is None
    assert (limiter.in_flight("h2", "m"), limiter.free_for("h2", "m")) == (0, 1)


# -- the place in line --------------------------------------------------------------------


async def test_a_waiter_shows_its_place_in_line_as_the_line_moves() -> None:
    limiter = Limiter()
    limiter.configure("gpu1", "m", parallel=1, queue_max=3)
    (held,) = hold(limiter, 1, "gpu1")
    waiters = [line_up(limiter, "gpu1") for _ in range(3)]
    assert [w.position for w in waiters] == [1, 2, 3]

    waiters[0].cancel()
    assert [w.position for w in waiters] == [0, 1, 2]
    held.release()
    assert [w.position for w in waiters] == [0, 0, 1]

    granted_slot(waiters[1]).release()
    assert [w.position for w in waiters] == [0, 0, 0]
    granted_slot(waiters[2]).release()
    assert limiter.in_flight("gpu1", "m") == 0


async def test_changes_is_set_when_someone_ahead_leaves_and_when_the_wait_ends() -> None:
    limiter = Limiter()
    limiter.configure("h1", "m", parallel=1, queue_max=3)
    (held,) = hold(limiter, 1)
    ahead, waiter = line_up(limiter), line_up(limiter)
    changes = waiter.changes()
    assert not changes.is_set()

    ahead.cancel()
    assert changes.is_set()
    assert waiter.position == 1

    changes.clear()
    held.release()
    assert changes.is_set()
    assert granted_slot(waiter).host == "h1"


async def test_every_listening_waiter_hears_each_move_of_the_line_ahead_of_it() -> None:
    limiter = Limiter()
    limiter.configure("h1", "m", parallel=1, queue_max=4)
    hold(limiter, 1)
    first, second, third, fourth = (line_up(limiter) for _ in range(4))
    second_moves, fourth_moves = second.changes(), fourth.changes()

    first.cancel()  # ahead of two listeners, and of `third`, which does not listen
    assert second_moves.is_set() and fourth_moves.is_set()
    assert (second.position, third.position, fourth.position) == (1, 2, 3)

    fourth_moves.clear()
    second.cancel()  # a listener leaves: the one behind it still hears the line move
    assert fourth_moves.is_set()
    assert fourth.position == 2


async def test_changes_asked_for_after_the_wait_ended_is_already_set() -> None:
    limiter = Limiter()
    limiter.configure("h1", "m", parallel=1, queue_max=1)
    (held,) = hold(limiter, 1)
    waiter = line_up(limiter)
    held.release()

    changes = waiter.changes()

    # A caller awaiting it must not wait forever for a wait that is already over.
    assert changes.is_set()
    granted_slot(waiter).release()
    assert limiter.in_flight("h1", "m") == 0


# -- configuration ------------------------------------------------------------------------


async def test_lowering_parallel_grants_nothing_until_in_flight_drops_below_it() -> None:
    limiter = Limiter()
    limiter.configure("h1", "m", parallel=4, queue_max=4)
    slots = hold(limiter, 4)
    waiter = line_up(limiter)

    limiter.configure("h1", "m", parallel=2, queue_max=4)
    assert limiter.in_flight("h1", "m") == 4
    assert limiter.queued("h1", "m") == 1
    slots[0].release()
    slots[1].release()
    assert not waiter.granted.done()
    assert limiter.in_flight("h1", "m") == 2

    slots[2].release()
    assert granted_slot(waiter).host == "h1"
    assert limiter.in_flight("h1", "m") == 2
    assert limiter.queued("h1", "m") == 0


async def test_raising_parallel_grants_waiters_at_once() -> None:
    limiter = Limiter()
    limiter.configure("h1", "m", parallel=1, queue_max=4)
    hold(limiter, 1)
    waiters = [line_up(limiter) for _ in range(3)]

    limiter.configure("h1", "m", parallel=3, queue_max=4)

    assert [waiter.granted.done() for waiter in waiters] == [True, True, False]
    assert limiter.in_flight("h1", "m") == 3
    assert limiter.queued("h1", "m") == 1


async def test_lowering_queue_max_keeps_waiters_and_refuses_newcomers() -> None:
    limiter = Limiter()
    limiter.configure("h1", "m", parallel=1, queue_max=3)
    (held,) = hold(limiter, 1)
    waiters = [line_up(limiter) for _ in range(3)]

    limiter.configure("h1", "m", parallel=1, queue_max=1)
    assert limiter.place([Pair("h1", "m")]) is None

    assert limiter.queued("h1", "m") == 3
    assert [w.position for w in waiters] == [1, 2, 3]
    held.release()
    assert granted_slot(waiters[0]).host == "h1"
    assert limiter.queued("h1", "m") == 2


async def test_misconfiguration_is_clamped_not_raised() -> None:
    limiter = Limiter()
    limiter.configure("h1", "m", parallel=0, queue_max=-3)

    assert limiter.snapshot() == [PairSnapshot("h1", "m", 1, 0, 0, 0)]
    slot = take(limiter)
    assert limiter.place([Pair("h1", "m")]) is None
    slot.release()


async def test_a_removed_pair_counts_its_held_slots_and_ends_the_waits_in_its_line() -> None:
    limiter = Limiter()
    limiter.configure("h1", "m", parallel=2, queue_max=2)
    first, second = hold(limiter, 2)
    waiter = line_up(limiter)

    limiter.remove("h1", "m")

    with pytest.raises(HostRemoved):
        waiter.granted.result()  # never a slot of a pair no longer configured
    assert waiter.cancel() is None
    assert (limiter.in_flight("h1", "m"), limiter.queued("h1", "m")) == (2, 0)
    assert limiter.snapshot() == [PairSnapshot("h1", "m", 1, 0, 2, 0)]
    first.release()
    second.release()
    first.release()
    assert limiter.in_flight("h1", "m") == 0
    assert limiter.snapshot() == []


async def test_a_renamed_host_keeps_its_slots_held_and_its_line_under_the_new_name() -> None:
    limiter = Limiter()
    limiter.configure("h1", "m", parallel=1, queue_max=2)
    (held,) = hold(limiter, 1)
    waiter = line_up(limiter)

    limiter.rename("h1", "box")
    limiter.configure("box", "m", parallel=1, queue_max=2)

    assert limiter.place([Pair("box", "m")]) is not None  # a place in line: the slot is held
    assert (limiter.in_flight("box", "m"), limiter.queued("box", "m")) == (1, 2)
    assert limiter.snapshot()[0].host == "box"
    held.release()
    slot = granted_slot(waiter)
    assert (slot.host, limiter.in_flight("box", "m")) == ("box", 1)


async def test_a_removed_pair_in_use_queues_no_one_like_an_unconfigured_pair() -> None:
    limiter = Limiter()
    limiter.configure("h1", "m", parallel=2, queue_max=2)
    (held,) = hold(limiter, 1)

    limiter.remove("h1", "m")

    assert limiter.place([Pair("h1", "m")]) is None  # its one slot is held, and it has no line
    held.release()
    assert limiter.snapshot() == []


async def test_removing_an_unknown_pair_does_nothing() -> None:
    limiter = Limiter()
    limiter.configure("h1", "m", parallel=2, queue_max=2)

    limiter.remove("h1", "other")
    limiter.remove("h9", "m")

    assert limiter.snapshot() == [PairSnapshot("h1", "m", 2, 2, 0, 0)]


async def test_removed_pair_configured_again_keeps_its_slots() -> None:
    limiter = Limiter()
    limiter.configure("h1", "m", parallel=1, queue_max=1)
    (held,) = hold(limiter, 1)

    limiter.remove("h1", "m")
    limiter.configure("h1", "m", parallel=2, queue_max=1)

    assert limiter.free_for("h1", "m") == 1
    held.release()
    assert limiter.snapshot() == [PairSnapshot("h1", "m", 2, 1, 0, 0)]


async def test_snapshot_lists_configured_and_busy_pairs_sorted() -> None:
    limiter = Limiter()
    limiter.configure("h2", "m", parallel=2, queue_max=1)
    limiter.configure("h1", "z", parallel=4, queue_max=4)
    limiter.configure("h1", "a", parallel=1, queue_max=2)
    hold(limiter, 1, "h1", "a")
    waiter = line_up(limiter, "h1", "a")
    busy_unconfigured = take(limiter, "h3", "x")

    assert limiter.snapshot() == [
        PairSnapshot("h1", "a", parallel=1, queue_max=2, in_flight=1, queued=1),
        PairSnapshot("h1", "z", parallel=4, queue_max=4, in_flight=0, queued=0),
        PairSnapshot("h2", "m", parallel=2, queue_max=1, in_flight=0, queued=0),
        PairSnapshot("h3", "x", parallel=1, queue_max=0, in_flight=1, queued=0),
    ]
    busy_unconfigured.release()
    assert [(snap.host, snap.model) for snap in limiter.snapshot()][-1] == ("h2", "m")
    waiter.cancel()
    assert limiter.snapshot()[0] == PairSnapshot("h1", "a", 1, 2, 1, 0)


async def test_free_slots_sums_the_hosts_configured_models() -> None:
    limiter = Limiter()
    limiter.configure("h1", "a", parallel=4, queue_max=0)
    limiter.configure("h1", "b", parallel=2, queue_max=0)
    limiter.configure("h2", "a", parallel=3, queue_max=0)
    hold(limiter, 2, "h1", "a")
    hold(limiter, 1, "h1", "unlisted")

    assert limiter.free_slots("h1") == 2 + 2
    assert limiter.free_slots("h2") == 3
    assert limiter.free_slots("nobody") == 0


async def test_free_slots_never_counts_below_zero_after_parallel_is_lowered() -> None:
    limiter = Limiter()
    limiter.configure("h1", "a", parallel=4, queue_max=0)
    limiter.configure("h1", "b", parallel=2, queue_max=0)
    hold(limiter, 4, "h1", "a")

    limiter.configure("h1", "a", parallel=1, queue_max=0)

    assert limiter.free_for("h1", "a") == 0
    assert limiter.free_slots("h1") == 2


async def test_free_for_follows_slots_and_the_line_follows_queue_max() -> None:
    limiter = Limiter()
    limiter.configure("h1", "m", parallel=2, queue_max=1)

    assert limiter.free_for("h1", "m") == 2
    hold(limiter, 2)
    assert limiter.free_for("h1", "m") == 0
    waiter = line_up(limiter)
    assert limiter.place([Pair("h1", "m")]) is None
    waiter.cancel()
    assert isinstance(limiter.place([Pair("h1", "m")]), Waiter)


async def test_a_long_line_of_leavers_keeps_counting_only_live_waiters() -> None:
    limiter = Limiter()
    limiter.configure("h1", "m", parallel=1, queue_max=3)
    (held,) = hold(limiter, 1)
    stayer = line_up(limiter)
    # Many waiters join and leave: the line is compacted now and then, never miscounted.
    for _ in range(100):
        line_up(limiter).cancel()
    last = line_up(limiter)

    assert limiter.queued("h1", "m") == 2
    assert (stayer.position, last.position) == (1, 2)
    held.release()
    assert granted_slot(stayer).host == "h1"
    assert last.position == 1


# -- stress -------------------------------------------------------------------------------


async def test_stress_random_place_watch_cancel_release_never_exceeds_parallel_nor_leaks() -> None:
    seed = random.SystemRandom().randrange(2**32)
    rng = random.Random(seed)
    limiter = Limiter()
    limits = {
        Pair("h1", "a"): (1, 2),
        Pair("h1", "b"): (3, 3),
        Pair("h2", "a"): (2, 0),
        Pair("h2", "c"): (2, 5),
    }
    for (host, model), (parallel, queue_max) in limits.items():
        limiter.configure(host, model, parallel, queue_max)
    limits[Pair("h3", "unconfigured")] = (1, 0)
    pairs = list(limits)
    holding: Counter[Pair] = Counter()
    outcomes: Counter[str] = Counter()
    violations: list[str] = []
    live: set[asyncio.Task[None]] = set()

    def check() -> None:
        for (host, model), (parallel, queue_max) in limits.items():
            in_flight = limiter.in_flight(host, model)
            queued = limiter.queued(host, model)
            held = holding[Pair(host, model)]
            if in_flight > parallel or held > in_flight or queued > queue_max:
                violations.append(f"{host}/{model}: {in_flight=} {held=} {queued=}")

    def cancel_someone() -> None:
        if live:
            rng.choice(sorted(live, key=id)).cancel()

    async def worker(choice: list[Pair], watched: list[Pair]) -> None:
        got = limiter.place(choice)
        if got is None:
            outcomes["refused"] += 1
            check()
            return
        if isinstance(got, Waiter):
            if watched:
                limiter.watch(got, watched, accept=lambda pair: rng.random() < 0.7)
            if rng.random() < 0.2:
                got.fail(QueueTimeout("stress"))
            try:
                slot = await wait_for_slot(got)
            except asyncio.CancelledError:
                outcomes["cancelled while waiting"] += 1
                check()
                raise
            except QueueTimeout:
                outcomes["failed"] += 1
                check()
                return
        else:
            slot = got
        pair = Pair(slot.host, slot.model)
        outcomes["granted" if pair in choice else "granted through a watch"] += 1
        holding[pair] += 1
        check()
        try:
            for _ in range(rng.randrange(8)):
                await asyncio.sleep(0)
        finally:
            holding[pair] -= 1
            slot.release()
            # Cancelling right after a release often hits a waiter the slot was just handed to.
            if rng.random() < 0.3:
                cancel_someone()
            if rng.random() < 0.1:
                slot.release()
            if rng.random() < 0.1:
                limiter.wake(rng.choice(pairs)[0])
            check()

    for _ in range(5_000):
        choice = rng.sample(pairs, rng.randint(1, 3))
        watched = rng.sample(pairs, rng.randint(0, 2))
        task = asyncio.create_task(worker(choice, watched))
        live.add(task)
        task.add_done_callback(live.discard)
        roll = rng.random()
        if roll < 0.15:
            cancel_someone()
        if roll < 0.6:
            await asyncio.sleep(0)
        check()
    async with asyncio.timeout(60):
        while live:
            # Accept refuses at random: a watcher left with no slot coming is woken here.
            for host in {host for host, _ in pairs}:
                limiter.wake(host)
            await asyncio.wait(live, timeout=0.01)
            if live and all(limiter.in_flight(*pair) == 0 for pair in pairs):
                cancel_someone()  # waiting only on watches no free slot will ever satisfy

    assert violations == [], f"seed {seed}"
    for host, model in pairs:
        assert limiter.in_flight(host, model) == 0, f"seed {seed}"
        assert limiter.queued(host, model) == 0, f"seed {seed}"
    assert [(snap.host, snap.model) for snap in limiter.snapshot()] == sorted(pairs[:-1])
    assert len(outcomes) == 5, (seed, outcomes)
    # Still fully usable: every configured slot is free again.
    for (host, model), (parallel, _) in limits.items():
        slots = hold(limiter, parallel, host, model)
        assert limiter.in_flight(host, model) == parallel
        for slot in slots:
            slot.release()


async def test_a_slot_says_whether_it_was_released_and_a_second_release_frees_nothing_more():
    limiter = Limiter()
    limiter.configure("h1", "m", parallel=2, queue_max=0)
    first, second = hold(limiter, 2)

    first.release()
    first.release()

    assert (first.released, second.released) == (True, False)
    assert limiter.in_flight("h1", "m") == 1
