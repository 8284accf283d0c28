from __future__ import annotations

import asyncio
import random
from collections import Counter

import pytest

from routing.core.limiter import Limiter, PairSnapshot, QueueFull, Slot, Ticket


async def settle(rounds: int = 5) -> None:
    """Let every ready task on the loop run a few steps."""
    for _ in range(rounds):
        await asyncio.sleep(0)


def start(limiter: Limiter, host: str = "h1", model: str = "m") -> asyncio.Task[Slot]:
    return asyncio.create_task(limiter.acquire(host, model))


async def hold(limiter: Limiter, count: int, host: str = "h1", model: str = "m") -> list[Slot]:
    return [await limiter.acquire(host, model) for _ in range(count)]


async def test_fifth_request_waits_when_four_slots_are_held() -> None:
    limiter = Limiter()
    limiter.configure("h1", "m", parallel=4, queue_max=4)
    slots = await hold(limiter, 4)

    fifth = start(limiter)
    await settle()

    assert not fifth.done()
    assert limiter.in_flight("h1", "m") == 4
    assert limiter.queued("h1", "m") == 1
    slots[0].release()
    await settle()
    assert fifth.done()
    assert limiter.in_flight("h1", "m") == 4
    assert limiter.queued("h1", "m") == 0


async def test_ninth_request_is_refused_when_queue_is_full() -> None:
    limiter = Limiter()
    limiter.configure("h1", "m", parallel=4, queue_max=4)
    await hold(limiter, 4)
    waiters = [start(limiter) for _ in range(4)]
    await settle()

    with pytest.raises(QueueFull) as refused:
        await limiter.acquire("h1", "m")

    assert (refused.value.host, refused.value.model) == ("h1", "m")
    assert limiter.queued("h1", "m") == 4
    assert not any(waiter.done() for waiter in waiters)
    for waiter in waiters:
        waiter.cancel()
    await settle()


async def test_waiters_are_granted_in_arrival_order() -> None:
    limiter = Limiter()
    limiter.configure("h1", "m", parallel=1, queue_max=5)
    (held,) = await hold(limiter, 1)
    granted: list[int] = []

    async def wait_then_note(number: int) -> None:
        slot = await limiter.acquire("h1", "m")
        granted.append(number)
        await asyncio.sleep(0)
        slot.release()

    tasks = []
    for number in range(5):
        tasks.append(asyncio.create_task(wait_then_note(number)))
        await asyncio.sleep(0)
    held.release()
    await asyncio.wait_for(asyncio.gather(*tasks), timeout=5)

    assert granted == [0, 1, 2, 3, 4]


async def test_release_hands_the_slot_to_the_head_waiter_not_a_newcomer() -> None:
    limiter = Limiter()
    limiter.configure("h1", "m", parallel=1, queue_max=1)
    (held,) = await hold(limiter, 1)
    waiter = start(limiter)
    await settle()

    held.release()
    # The newcomer arrives before the waiter has had a chance to run again.
    newcomer = start(limiter)
    await settle()

    assert waiter.done()
    assert not newcomer.done()
    assert limiter.in_flight("h1", "m") == 1
    assert limiter.queued("h1", "m") == 1
    newcomer.cancel()
    await settle()


async def test_cancelled_waiter_gives_back_its_place() -> None:
    limiter = Limiter()
    limiter.configure("h1", "m", parallel=1, queue_max=1)
    (held,) = await hold(limiter, 1)
    leaver = start(limiter)
    await settle()

    leaver.cancel()
    await settle()
    stayer = start(limiter)
    await settle()

    assert leaver.cancelled()
    assert limiter.queued("h1", "m") == 1
    held.release()
    await settle()
    assert stayer.done()
    assert limiter.in_flight("h1", "m") == 1


async def test_waiter_cancelled_at_the_instant_of_hand_over_passes_the_slot_on() -> None:
    limiter = Limiter()
    limiter.configure("h1", "m", parallel=1, queue_max=2)
    (held,) = await hold(limiter, 1)
    first = start(limiter)
    second = start(limiter)
    await settle()

    held.release()  # hands the slot to `first`, which has not run yet
    first.cancel()
    await settle()

    assert first.cancelled()
    assert second.done() and not second.cancelled()
    assert limiter.in_flight("h1", "m") == 1
    assert limiter.queued("h1", "m") == 0
    second.result().release()
    assert limiter.in_flight("h1", "m") == 0


async def test_waiter_cancelled_at_the_instant_of_hand_over_frees_the_slot_when_alone() -> None:
    limiter = Limiter()
    limiter.configure("h1", "m", parallel=1, queue_max=1)
    (held,) = await hold(limiter, 1)
    waiter = start(limiter)
    await settle()

    held.release()
    waiter.cancel()
    await settle()

    assert waiter.cancelled()
    assert limiter.in_flight("h1", "m") == 0
    assert limiter.free_for("h1", "m") == 1


async def test_waiter_timing_out_leaves_no_trace() -> None:
    limiter = Limiter()
    limiter.configure("h1", "m", parallel=1, queue_max=1)
    (held,) = await hold(limiter, 1)

    with pytest.raises(TimeoutError):
        await asyncio.wait_for(limiter.acquire("h1", "m"), timeout=0.01)

    assert limiter.queued("h1", "m") == 0
    held.release()
    assert limiter.in_flight("h1", "m") == 0


async def test_second_release_is_a_no_op() -> None:
    limiter = Limiter()
    limiter.configure("h1", "m", parallel=2, queue_max=0)
    first, second = await hold(limiter, 2)

    first.release()
    first.release()

    assert limiter.in_flight("h1", "m") == 1
    second.release()
    assert limiter.in_flight("h1", "m") == 0


async def test_slot_used_as_context_manager_is_released_on_exit() -> None:
    limiter = Limiter()
    limiter.configure("h1", "m", parallel=1, queue_max=0)

    with pytest.raises(RuntimeError):
        async with await limiter.acquire("h1", "m") as slot:
            assert slot.host == "h1" and slot.model == "m"
            assert limiter.in_flight("h1", "m") == 1
            raise RuntimeError("upstream failed")

    assert limiter.in_flight("h1", "m") == 0


async def test_unconfigured_pair_has_one_slot_and_no_queue() -> None:
    limiter = Limiter()

    assert limiter.free_for("h1", "m") == 1
    assert limiter.has_room("h1", "m")
    slot = await limiter.acquire("h1", "m")
    with pytest.raises(QueueFull):
        await limiter.acquire("h1", "m")

    assert limiter.in_flight("h1", "m") == 1
    assert not limiter.has_room("h1", "m")
    slot.release()
    assert limiter.in_flight("h1", "m") == 0


async def test_slot_taken_at_once_has_waited_zero_and_queued_slot_reports_its_wait() -> None:
    limiter = Limiter()
    limiter.configure("h1", "m", parallel=1, queue_max=1)
    (held,) = await hold(limiter, 1)
    waiter = start(limiter)
    await settle()

    await asyncio.sleep(0.05)
    held.release()
    slot = await asyncio.wait_for(waiter, timeout=5)

    assert held.waited == 0.0
    # Generous margin: only that the queue time is counted, never how fast the loop is.
    assert slot.waited >= 0.03


async def test_lowering_parallel_grants_nothing_until_in_flight_drops_below_it() -> None:
    limiter = Limiter()
    limiter.configure("h1", "m", parallel=4, queue_max=4)
    slots = await hold(limiter, 4)
    waiter = start(limiter)
    await settle()

    limiter.configure("h1", "m", parallel=2, queue_max=4)
    assert limiter.in_flight("h1", "m") == 4
    assert limiter.queued("h1", "m") == 1
    slots[0].release()
    slots[1].release()
    await settle()
    assert not waiter.done()
    assert limiter.in_flight("h1", "m") == 2

    slots[2].release()
    await settle()
    assert waiter.done()
    assert limiter.in_flight("h1", "m") == 2
    assert limiter.queued("h1", "m") == 0


async def test_raising_parallel_grants_waiters_at_once() -> None:
    limiter = Limiter()
    limiter.configure("h1", "m", parallel=1, queue_max=4)
    await hold(limiter, 1)
    waiters = [start(limiter) for _ in range(3)]
    await settle()

    limiter.configure("h1", "m", parallel=3, queue_max=4)
    await settle()

    assert [waiter.done() for waiter in waiters] == [True, True, False]
    assert limiter.in_flight("h1", "m") == 3
    assert limiter.queued("h1", "m") == 1
    waiters[2].cancel()
    await settle()


async def test_lowering_queue_max_keeps_waiters_and_refuses_newcomers() -> None:
    limiter = Limiter()
    limiter.configure("h1", "m", parallel=1, queue_max=3)
    (held,) = await hold(limiter, 1)
    waiters = [start(limiter) for _ in range(3)]
    await settle()

    limiter.configure("h1", "m", parallel=1, queue_max=1)
    with pytest.raises(QueueFull):
        await limiter.acquire("h1", "m")

    assert limiter.queued("h1", "m") == 3
    held.release()
    await settle()
    assert waiters[0].done()
    for waiter in waiters[1:]:
        waiter.cancel()
    await settle()


async def test_misconfiguration_is_clamped_not_raised() -> None:
    limiter = Limiter()
    limiter.configure("h1", "m", parallel=0, queue_max=-3)

    assert limiter.snapshot() == [PairSnapshot("h1", "m", 1, 0, 0, 0)]
    slot = await limiter.acquire("h1", "m")
    with pytest.raises(QueueFull):
        await limiter.acquire("h1", "m")
    slot.release()


async def test_removed_pair_releases_held_slots_and_keeps_its_waiters() -> None:
    limiter = Limiter()
    limiter.configure("h1", "m", parallel=2, queue_max=2)
    first, second = await hold(limiter, 2)
    waiter = start(limiter)
    await settle()

    limiter.remove("h1", "m")
    assert limiter.queued("h1", "m") == 1
    first.release()
    await settle()
    # Unconfigured now: one slot, and `second` still holds more than that.
    assert not waiter.done()
    second.release()
    await settle()
    assert waiter.done()

    waiter.result().release()
    first.release()
    assert limiter.in_flight("h1", "m") == 0
    assert limiter.snapshot() == []


async def test_removing_an_unknown_pair_does_nothing() -> None:
    limiter = Limiter()
    limiter.configure("h1", "m", parallel=2, queue_max=2)

    limiter.remove("h1", "other")
    limiter.remove("h9", "m")

    assert limiter.snapshot() == [PairSnapshot("h1", "m", 2, 2, 0, 0)]


async def test_removed_pair_configured_again_keeps_its_slots_and_queue() -> None:
    limiter = Limiter()
    limiter.configure("h1", "m", parallel=1, queue_max=1)
    (held,) = await hold(limiter, 1)
    waiter = start(limiter)
    await settle()

    limiter.remove("h1", "m")
    limiter.configure("h1", "m", parallel=2, queue_max=1)
    await settle()

    assert waiter.done()
    assert limiter.in_flight("h1", "m") == 2
    held.release()
    waiter.result().release()
    assert limiter.snapshot() == [PairSnapshot("h1", "m", 2, 1, 0, 0)]


async def test_snapshot_lists_configured_and_busy_pairs_sorted() -> None:
    limiter = Limiter()
    limiter.configure("h2", "m", parallel=2, queue_max=1)
    limiter.configure("h1", "z", parallel=4, queue_max=4)
    limiter.configure("h1", "a", parallel=1, queue_max=2)
    await hold(limiter, 1, "h1", "a")
    waiter = start(limiter, "h1", "a")
    busy_unconfigured = await limiter.acquire("h3", "x")
    await settle()

    assert limiter.snapshot() == [
        PairSnapshot("h1", "a", parallel=1, queue_max=2, in_flight=1, queued=1),
        PairSnapshot("h1", "z", parallel=4, queue_max=4, in_flight=0, queued=0),
        PairSnapshot("h2", "m", parallel=2, queue_max=1, in_flight=0, queued=0),
        PairSnapshot("h3", "x", parallel=1, queue_max=0, in_flight=1, queued=0),
    ]
    busy_unconfigured.release()
    assert [(snap.host, snap.model) for snap in limiter.snapshot()][-1] == ("h2", "m")
    waiter.cancel()
    await settle()


async def test_free_slots_sums_the_hosts_configured_models() -> None:
    limiter = Limiter()
    limiter.configure("h1", "a", parallel=4, queue_max=0)
    limiter.configure("h1", "b", parallel=2, queue_max=0)
    limiter.configure("h2", "a", parallel=3, queue_max=0)
    await hold(limiter, 2, "h1", "a")
    await hold(limiter, 1, "h1", "unlisted")

    assert limiter.free_slots("h1") == 2 + 2
    assert limiter.free_slots("h2") == 3
    assert limiter.free_slots("nobody") == 0


async def test_free_slots_never_counts_below_zero_after_parallel_is_lowered() -> None:
    limiter = Limiter()
    limiter.configure("h1", "a", parallel=4, queue_max=0)
    limiter.configure("h1", "b", parallel=2, queue_max=0)
    await hold(limiter, 4, "h1", "a")

    limiter.configure("h1", "a", parallel=1, queue_max=0)

    assert limiter.free_for("h1", "a") == 0
    assert limiter.free_slots("h1") == 2


async def test_free_for_and_has_room_follow_slots_then_queue() -> None:
    limiter = Limiter()
    limiter.configure("h1", "m", parallel=2, queue_max=1)

    assert limiter.free_for("h1", "m") == 2
    await hold(limiter, 2)
    assert limiter.free_for("h1", "m") == 0
    assert limiter.has_room("h1", "m")
    waiter = start(limiter)
    await settle()
    assert not limiter.has_room("h1", "m")
    waiter.cancel()
    await settle()
    assert limiter.has_room("h1", "m")


async def test_stress_random_acquire_cancel_release_never_exceeds_parallel_nor_leaks() -> None:
    seed = random.SystemRandom().randrange(2**32)
    rng = random.Random(seed)
    limiter = Limiter()
    limits = {("h1", "a"): (1, 2), ("h1", "b"): (3, 3), ("h2", "a"): (2, 0), ("h2", "c"): (2, 5)}
    for (host, model), (parallel, queue_max) in limits.items():
        limiter.configure(host, model, parallel, queue_max)
    limits[("h3", "unconfigured")] = (1, 0)
    pairs = list(limits)
    holding: Counter[tuple[str, str]] = Counter()
    outcomes: Counter[str] = Counter()
    violations: list[str] = []
    live: set[asyncio.Task[None]] = set()

    def check() -> None:
        for (host, model), (parallel, queue_max) in limits.items():
            in_flight = limiter.in_flight(host, model)
            queued = limiter.queued(host, model)
            held = holding[(host, model)]
            if in_flight > parallel or held > in_flight or queued > queue_max:
                violations.append(f"{host}/{model}: {in_flight=} {held=} {queued=}")

    def cancel_someone() -> None:
        if live:
            rng.choice(sorted(live, key=id)).cancel()

    async def worker(host: str, model: str) -> None:
        try:
            slot = await limiter.acquire(host, model)
        except QueueFull:
            outcomes["refused"] += 1
            check()
            return
        except asyncio.CancelledError:
            outcomes["cancelled while waiting"] += 1
            check()
            raise
        outcomes["granted"] += 1
        holding[(host, model)] += 1
        check()
        try:
            for _ in range(rng.randrange(4)):
                await asyncio.sleep(0)
        finally:
            holding[(host, model)] -= 1
            slot.release()
            # Cancelling right after a release often hits a waiter the slot was just handed to.
            if rng.random() < 0.3:
                cancel_someone()
            if rng.random() < 0.1:
                slot.release()
            check()

    for _ in range(5_000):
        task = asyncio.create_task(worker(*rng.choice(pairs)))
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
            await asyncio.gather(*live, return_exceptions=True)

    assert violations == [], f"seed {seed}"
    for host, model in pairs:
        assert limiter.in_flight(host, model) == 0, f"seed {seed}"
        assert limiter.queued(host, model) == 0, f"seed {seed}"
    assert [(snap.host, snap.model) for snap in limiter.snapshot()] == sorted(pairs[:-1])
    assert all(count > 0 for count in outcomes.values()) and len(outcomes) == 3, (seed, outcomes)
    # Still fully usable: every configured slot is free again.
    for (host, model), (parallel, _) in limits.items():
        slots = await hold(limiter, parallel, host, model)
        assert limiter.in_flight(host, model) == parallel
        for slot in slots:
            slot.release()


async def test_a_ticket_shows_the_place_in_line_as_the_queue_moves() -> None:
    limiter = Limiter()
    limiter.configure("gpu1", "m", 1, 3)
    held = await limiter.acquire("gpu1", "m")
    tickets = [Ticket() for _ in range(3)]
    waiters = [asyncio.create_task(limiter.acquire("gpu1", "m", t)) for t in tickets]
    await asyncio.sleep(0)
    assert [t.position for t in tickets] == [1, 2, 3]

    waiters[0].cancel()
    await asyncio.sleep(0)
    assert [t.position for t in tickets] == [0, 1, 2]
    held.release()
    second = await waiters[1]

    assert [t.position for t in tickets] == [0, 0, 1]
    second.release()
    (await waiters[2]).release()
    assert limiter.in_flight("gpu1", "m") == 0
