"""SharedState, SharedPlace and SharedWatcher against a real redis-server: two instances on their
own connections and liveness stand for two gateway processes.

Every test ends by checking that Redis holds nothing any more: no slot in flight, no place in a
line, no waiter's record or watch.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import pytest

from routing.core.errors import QueueTimeout
from routing.core.leases import LeaseKey
from routing.core.limiter import Pair
from routing.core.opening import Opening
from routing.core.state import on_lost
from routing.shared.fleet_state import SharedState
from routing.shared.grants import Grant
from routing.shared.places import SharedPlace, SharedSlot
from routing.shared.state import StateUnavailable
from tests.helpers.redis_server import RedisServer
from tests.helpers.shared_state import (
    H1,
    counted,
    gateway,
    in_flight,
    nothing_left,
    redis_keys,
    slot_of,
)
from tests.helpers.waits import LONG, eventually

H2: Pair = Pair("h2", "m")


@contextlib.asynccontextmanager
async def fleet(
    url: str, limits: dict[Pair, tuple[int, int]], *, hold_ttl: float = 5.0, beating: bool = True
) -> AsyncIterator[tuple[SharedState, SharedState]]:
    """Two processes with `limits` (pair -> parallel, queue_max) configured in Redis; the second
    has `hold_ttl` and `beating` (see `gateway`). On a clean exit, waits until Redis holds no
    slot, place or watch of any process."""
    async with gateway(url) as a, gateway(url, hold_ttl=hold_ttl, beating=beating) as b:
        for state in (a, b):
            for (host, model), (parallel, queue_max) in limits.items():
                state.configure(host, model, parallel, queue_max)
                await state.slots.configure(host, model, parallel, queue_max)
        yield a, b
        await eventually(lambda: nothing_left(url, a), "every slot and place given back")
        assert a.slots.held() == b.slots.held() == 0


async def place_of(state: SharedState, pairs: list[Pair]) -> SharedPlace:
    got = await state.place(pairs)
    assert isinstance(got, SharedPlace), got
    return got


async def granted(waiter: SharedPlace) -> SharedSlot:
    return await asyncio.wait_for(asyncio.shield(waiter.granted), LONG)


def usable_when(flags: dict[str, bool]) -> Callable[[Pair], bool]:
    return lambda pair: flags[pair[0]]


# -- the order placement asks in ---------------------------------------------------------

ROW = [
    Pair(f"r{index:02d}", "m") for index in range(12)
]  # a route longer than the head asked first


async def test_a_free_slot_past_the_head_is_found_when_the_head_is_full(redis_url):
    async with fleet(redis_url, dict.fromkeys(ROW, (1, 1))) as (a, b):
        taken = [await slot_of(b, [pair]) for pair in ROW[:10]]  # the head, and then some

        got = await slot_of(a, ROW)  # as a's ranking orders them: its counts are a tick old

        assert (got.host, got.model) == ROW[10]
        for slot in [*taken, got]:
            slot.release()


async def test_with_every_slot_taken_the_request_queues_at_the_first_line_with_room(redis_url):
    async with fleet(redis_url, {**dict.fromkeys(ROW, (1, 0)), ROW[9]: (1, 1)}) as (a, b):
        taken = [await slot_of(b, [pair]) for pair in ROW]

        place = await place_of(a, ROW)

        assert place.host == ROW[9][0]
        taken[9].release()
        assert (await granted(place)).host == ROW[9][0]
        for slot in taken[:9] + taken[10:]:
            slot.release()
        (await granted(place)).release()


# -- places in line ----------------------------------------------------------------------


# -- a conversation's opening: lease and place in one call ------------------------------

KEY = LeaseKey("chat", "conversation", "m")


def opening(
    pairs: list[Pair], *, usable: Callable[[str], bool] = lambda host: True,
    unusable: frozenset[str] = frozenset(), strict: bool = False, patient: bool = True,
) -> Opening:  # fmt: skip
    return Opening(KEY, 60.0, pairs, usable, unusable, strict, patient)


async def test_a_new_conversation_is_leased_to_the_host_it_is_placed_on_and_found_there_next(
    redis_url,
):
    async with fleet(redis_url, {H1: (1, 0), H2: (1, 0)}) as (a, b):
        first = await a.open(opening([H2, H1]))
        assert (first.home, first.at_home) == (None, False)
        assert isinstance(first.got, SharedSlot) and first.got.host == "h2"
        first.got.release()
        await eventually(lambda: counted(a, 0, H2), "the first turn's slot released")

        again = await b.open(opening([H1, H2]))  # another process, another order

        assert (again.home, again.at_home) == ("h2", True)
        assert isinstance(again.got, SharedSlot) and again.got.host == "h2"
        assert await b.find_lease(KEY, 60.0) == "h2"
        again.got.release()


async def test_two_processes_opening_the_same_new_conversation_agree_on_one_host(redis_url):
    async with fleet(redis_url, {H1: (2, 0), H2: (2, 0)}) as (a, b):
        first, second = await asyncio.gather(a.open(opening([H1])), b.open(opening([H2])))

        hosts = {opened.got.host for opened in (first, second) if opened.got is not None}
        assert len(hosts) == 1
        assert await a.find_lease(KEY, 60.0) == hosts.pop()
        for opened in (first, second):
            assert isinstance(opened.got, SharedSlot)
            opened.got.release()


async def test_a_busy_home_with_room_in_its_line_keeps_the_conversation_waiting_there(redis_url):
    async with fleet(redis_url, {H1: (1, 1), H2: (1, 0)}) as (a, b):
        await b.keep_lease(KEY, "h1", 60.0, None)
        busy = await slot_of(b, [H1])

        opened = await a.open(opening([H2, H1]))

        assert opened.at_home and isinstance(opened.got, SharedPlace)
        assert opened.got.host == "h1"
        busy.release()
        (await granted(opened.got)).release()


async def test_a_home_with_no_slot_and_no_room_in_line_spills_and_keeps_the_lease(redis_url):
    async with fleet(redis_url, {H1: (1, 0), H2: (1, 0)}) as (a, b):
        await b.keep_lease(KEY, "h1", 60.0, None)
        busy = await slot_of(b, [H1])

        opened = await a.open(opening([H2, H1]))

        assert opened.at_home and isinstance(opened.got, SharedSlot)
        assert opened.got.host == "h2"
        assert await a.find_lease(KEY, 60.0) == "h1"
        for slot in (busy, opened.got):
            slot.release()


async def test_a_home_this_process_may_not_use_moves_the_conversation_and_its_lease(redis_url):
    async with fleet(redis_url, {H1: (1, 0), H2: (1, 0)}) as (a, b):
        await b.keep_lease(KEY, "h1", 60.0, None)

        opened = await a.open(opening([H2], unusable=frozenset({"h1"})))

        assert (opened.home, opened.at_home) == ("h1", False)
        assert isinstance(opened.got, SharedSlot) and opened.got.host == "h2"
        assert await in_flight(a, H1) == 0
        assert await a.find_lease(KEY, 60.0) == "h2"
        opened.got.release()


async def test_a_strict_route_whose_home_may_not_be_used_takes_nothing_and_keeps_the_lease(
    redis_url,
):
    async with fleet(redis_url, {H1: (1, 0), H2: (1, 0)}) as (a, b):
        await b.keep_lease(KEY, "h1", 60.0, None)

        opened = await a.open(opening([H2], unusable=frozenset({"h1"}), strict=True))

        assert (opened.home, opened.pinned, opened.got) == ("h1", True, None)
        assert await in_flight(a, H1) == await in_flight(a, H2) == 0
        assert await a.find_lease(KEY, 60.0) == "h1"


async def test_a_home_redis_offers_but_this_process_refuses_is_given_back_and_moved(redis_url):
    async with fleet(redis_url, {H1: (1, 0), H2: (1, 0)}) as (a, b):
        await b.keep_lease(KEY, "h1", 60.0, None)

        # h1 left the route here: it is in no unusable list, yet `usable` refuses it.
        opened = await a.open(opening([H2], usable=lambda host: host != "h1"))

        assert (opened.home, opened.at_home) == ("h1", False)
        assert isinstance(opened.got, SharedSlot) and opened.got.host == "h2"
        await eventually(lambda: counted(a, 0, H1), "the slot taken at h1 given back")
        assert await a.find_lease(KEY, 60.0) == "h2"
        opened.got.release()


async def test_a_new_conversation_on_a_big_route_whose_head_is_full_goes_past_the_head(redis_url):
    async with fleet(redis_url, dict.fromkeys(ROW, (1, 0))) as (a, b):
        taken = [await slot_of(b, [pair]) for pair in ROW[:10]]

        opened = await a.open(opening(ROW))

        assert isinstance(opened.got, SharedSlot) and opened.got.host == ROW[10][0]
        assert await a.find_lease(KEY, 60.0) == ROW[10][0]
        for slot in [*taken, opened.got]:
            slot.release()


# -- other processes' counts, read at each tick -----------------------------------------


async def test_a_tick_tells_the_rankings_of_the_hosts_other_processes_changed_and_no_others(
    redis_url,
):
    told: list[str] = []
    async with gateway(redis_url) as b, fleet(redis_url, {H1: (2, 0), H2: (2, 0)}) as (a, _):
        watched = SharedState(redis_url, hold_ttl=5.0, on_change=told.append)
        await watched.shared.beat()
        for (host, model), (parallel, queue_max) in {H1: (2, 0), H2: (2, 0)}.items():
            watched.configure(host, model, parallel, queue_max)
        await watched.shared.beat()
        told.clear()

        slot = await slot_of(a, [H1])
        await b.keep_lease(KEY, "h2", 60.0, None)
        await watched.shared.beat()
        changed = sorted(set(told))
        counts = (watched.in_flight(*H1), watched.leases_held("h2"))
        told.clear()
        await watched.shared.beat()  # nothing changed since

        assert changed == ["h1", "h2"]
        assert counts == (1, 1)
        assert told == []
        slot.release()
        await watched.aclose()


async def test_a_slot_another_process_gave_back_and_this_one_took_counts_once_before_a_tick(
    redis_url,
):
    # b reads a's two slots at a tick; a gives one back, b takes it: b's count of a's is a
    # tick old, and read "3/2 running" in refusals and /metrics.
    async with fleet(redis_url, {H1: (2, 0)}, beating=False) as (a, b):
        held = [await slot_of(a, [H1]), await slot_of(a, [H1])]
        await b.shared.beat()
        held.pop().release()
        await eventually(lambda: counted(a, 1), "a's slot given back")
        held.append(await slot_of(b, [H1]))

        assert b.in_flight(*H1) == 2
        assert [(s.in_flight, s.parallel) for s in b.snapshot()] == [(2, 2)]
        for slot in held:
            slot.release()


@pytest.mark.parametrize("refused_by", ["place", "open_new", "open_at_home"])
async def test_a_refusal_counts_what_redis_refused_it_on_before_a_tick_reads_the_counts(
    redis_url, refused_by
):
    # The refusal's message quotes these counts (routing.ops.live.standings): they must be
    # the ones that refused it, not a view another process's requests have not reached yet.
    async with fleet(redis_url, {H1: (1, 0), H2: (1, 0)}, beating=False) as (a, b):
        leased = await a.open(opening([H2, H1]))  # the conversation's home: h2
        taken = [leased.got, await a.place([H1])]
        assert all(isinstance(slot, SharedSlot) for slot in taken)

        refused: object
        if refused_by == "place":
            refused = await b.place([H1, H2])
        else:
            key = KEY if refused_by == "open_at_home" else LeaseKey("chat", "other", "m")
            asked = Opening(key, 60.0, [H1, H2], lambda host: True, frozenset(), False, True)
            refused = (await b.open(asked)).got
        counts = [(b.in_flight(*pair), b.queued(*pair)) for pair in (H1, H2)]

        for slot in taken:
            slot.release()  # type: ignore[union-attr]  # SharedSlot, asserted above

    assert refused is None
    assert counts == [(1, 0), (1, 0)]


async def test_requests_running_past_a_lowered_parallel_are_all_counted(redis_url):
    async with fleet(redis_url, {H1: (2, 0)}, beating=False) as (a, b):
        held = [await slot_of(a, [H1]), await slot_of(b, [H1])]
        for state in (a, b):
            state.configure(*H1, 1, 0)
        await a.slots.configure(*H1, 1, 0)
        await b.shared.beat()

        assert b.in_flight(*H1) == 2  # both run on until they end
        for slot in held:
            slot.release()


async def test_a_lease_written_while_a_tick_reads_the_counts_is_counted_once(redis_url):
    """A new conversation's lease lands in Redis while the tick's read is on its way: the read
    may count it, and the process counts it too until a read surely has it. Counted twice, a
    host with a slot per conversation looked crowded and its slots went unnamed (CI)."""
    async with fleet(redis_url, {H1: (2, 0)}) as (a, _):
        read = a.leases.held_by_host

        async def read_as_a_lease_lands() -> dict[str, int]:
            await a.keep_lease(KEY, "h1", 60.0, None)
            return await read()

        a.leases.held_by_host = read_as_a_lease_lands  # type: ignore[method-assign]
        await a.shared.beat()
        a.leases.held_by_host = read  # type: ignore[method-assign]
        counted = [a.leases_held("h1")]
        await a.shared.beat()
        counted.append(a.leases_held("h1"))
        await a.keep_lease(LeaseKey("chat", "another", "m"), "h1", 60.0, None)
        counted.append(a.leases_held("h1"))
        await a.shared.beat()
        counted.append(a.leases_held("h1"))

        assert counted == [1, 1, 2, 2]


async def test_a_lease_that_expired_before_a_tick_read_the_counts_is_counted_no_more(redis_url):
    async with fleet(redis_url, {H1: (2, 0)}) as (a, _):
        await a.keep_lease(KEY, "h1", 0.05, None)
        counted = [a.leases_held("h1")]
        await asyncio.sleep(0.2)  # gone from Redis, with the leases' version, before any read
        await a.shared.beat()
        counted.append(a.leases_held("h1"))

        assert counted == [1, 0]


async def test_places_are_granted_on_release_in_arrival_order_across_processes(redis_url):
    async with fleet(redis_url, {H1: (1, 3)}) as (a, b):
        held = await slot_of(a, [H1])
        line = [await place_of(b, [H1]), await place_of(a, [H1]), await place_of(b, [H1])]
        assert [place.position for place in line] == [1, 2, 3]

        for place in line:
            held.release()
            held = await granted(place)
            assert (held.host, held.model) == H1
            assert await in_flight(a) == 1  # one slot, handed from one holder to the next
        held.release()


async def test_a_cancelled_place_gives_its_place_back(redis_url):
    async with fleet(redis_url, {H1: (1, 1)}) as (a, b):
        held = await slot_of(a, [H1])
        place = await place_of(b, [H1])
        assert await a.place([H1]) is None  # the line's one place is taken

        assert place.cancel() is None
        assert place.granted.cancelled()

        async def newcomer_queues() -> SharedPlace | None:
            got = await a.place([H1])
            assert not isinstance(got, SharedSlot)
            return got

        again = await eventually(newcomer_queues, "the place given back to a newcomer")
        assert again.position == 1
        again.cancel()
        held.release()


async def test_a_grant_landing_as_a_place_is_cancelled_is_released(redis_url):
    async with fleet(redis_url, {H1: (1, 2)}) as (a, b):
        grant = await a.slots.place([H1])
        assert isinstance(grant, Grant)
        place = await place_of(b, [H1])

        await a.slots.release(grant)  # Redis hands the slot to the place within this script
        # In the same turn: `b` may have heard of the grant, but its wait cannot have handed
        # the slot over yet, so the slot counted as the place's is the wait's to give back.
        assert place.cancel() is None

        assert place.granted.cancelled()
        fresh = await eventually(lambda: _free_slot(a), "the landed slot released")
        fresh.release()


async def test_fail_ends_a_wait_in_line_and_gives_its_place_back(redis_url):
    async with fleet(redis_url, {H1: (1, 2)}) as (a, b):
        held = await slot_of(a, [H1])
        place = await place_of(b, [H1])

        place.fail(QueueTimeout("queue timeout"))

        with pytest.raises(QueueTimeout):
            await place.granted
        assert place.cancel() is None
        held.release()


# -- watchers --------------------------------------------------------------------------


async def test_a_watcher_woken_when_its_host_becomes_usable_takes_the_free_slot(redis_url):
    async with fleet(redis_url, {H1: (1, 0)}) as (a, b):
        up = False
        asked = asyncio.Event()

        def usable(pair: Pair) -> bool:
            asked.set()
            return up

        watcher = a.watcher()
        a.watch(watcher, [H1], usable)
        await asyncio.wait_for(asked.wait(), LONG)  # its attempt found h1 unusable
        assert watcher.watches("h1") and not watcher.granted.done()

        up = True
        a.wake("h1")

        slot = await granted(watcher)
        assert (slot.host, slot.model) == H1
        assert await in_flight(b) == 1
        assert not watcher.watches("h1")
        slot.release()


async def test_a_watcher_whose_hosts_are_full_waits_in_the_first_line_with_room(redis_url):
    async with fleet(redis_url, {H1: (1, 1)}) as (a, b):
        held = await slot_of(b, [H1])
        watcher = a.watcher()
        a.watch(watcher, [H1], usable_when({"h1": True}))

        await eventually(lambda: _queued(b, H1), "the watcher's place in h1's line")
        held.release()

        slot = await granted(watcher)
        assert slot.host == "h1"
        slot.release()


async def test_a_watcher_in_a_line_takes_a_slot_freed_on_pairs_it_watches_later(redis_url):
    async with fleet(redis_url, {H1: (1, 1), H2: (1, 0)}) as (a, b):
        on_h1 = await slot_of(b, [H1])
        on_h2 = await slot_of(b, [H2])
        up = {"h1": True, "h2": True}
        watcher = a.watcher()
        a.watch(watcher, [H1], usable_when(up))
        await eventually(lambda: _queued(b, H1), "the watcher's place in h1's line")

        a.watch(watcher, [H2], usable_when(up))  # a fallback: h2 is watched from now on
        await eventually(lambda: redis_keys(redis_url, "watch:h2/m"), "the watch on h2 in Redis")
        on_h2.release()

        slot = await granted(watcher)
        assert slot.host == "h2"
        slot.release()
        on_h1.release()


@pytest.mark.parametrize("turns", [0, 1, 3, 10])
@pytest.mark.parametrize("queue_max", [0, 1])
async def test_a_watcher_cancelled_during_its_attempt_leaves_nothing_behind(
    redis_url, turns, queue_max
):
    async with fleet(redis_url, {H1: (1, queue_max)}) as (a, b):
        held = await slot_of(b, [H1]) if queue_max else None  # full: the attempt finds a line
        watcher = a.watcher()
        a.watch(watcher, [H1], usable_when({"h1": True}))
        for _ in range(turns):  # the attempt's round trip under way, or its answer arriving
            await asyncio.sleep(0)

        late = watcher.cancel()

        if late is not None:  # handed over before the cancel: the caller's to release
            late.release()
        if held is not None:
            held.release()
        fresh = await eventually(lambda: _free_slot(b), "every slot given back")
        fresh.release()


async def test_fail_ends_a_watcher_that_waits_in_no_line(redis_url):
    async with fleet(redis_url, {H1: (1, 0)}) as (a, b):
        watcher = a.watcher()
        a.watch(watcher, [H1], usable_when({"h1": False}))

        watcher.fail(QueueTimeout("queue timeout"))

        with pytest.raises(QueueTimeout):
            await watcher.granted
        assert watcher.cancel() is None
        assert not watcher.watches("h1")


# -- a process away from Redis past its hold TTL -----------------------------------------


async def test_a_process_stalled_past_its_hold_ttl_loses_its_slot_and_never_counts_it_again(
    redis_url,
):
    async with fleet(redis_url, {H1: (1, 0)}, hold_ttl=1.0, beating=False) as (other, stalled):
        slot = await slot_of(stalled, [H1])
        lost = asyncio.Event()
        on_lost(slot, lost.set)
        most = 0
        watching = True

        async def watch_counts() -> None:
            nonlocal most
            while watching:
                most = max(most, await in_flight(other))
                await asyncio.sleep(0.005)

        watcher = asyncio.create_task(watch_counts())
        # `stalled` renews its liveness no more: once it has expired, `other` finds the pair
        # full, takes the slot back and holds it.
        taken = await eventually(lambda: _free_slot(other), "the stalled process's slot taken")
        assert not lost.is_set()

        await stalled.shared.beat()  # it resumes

        assert await in_flight(other) == 1
        await asyncio.wait_for(lost.wait(), LONG)
        assert stalled.slots.held() == 0
        slot.release()  # its request ends: what `other` holds stays held
        assert await in_flight(other) == 1
        watching = False
        await watcher
        assert most == 1
        taken.release()


async def test_after_redis_restarts_empty_a_slot_taken_meanwhile_is_lost_not_counted_twice(
    redis_server: RedisServer,
):
    async with fleet(redis_server.url, {H1: (1, 0)}, beating=False) as (other, restored):
        slot = await slot_of(restored, [H1])
        lost = asyncio.Event()
        on_lost(slot, lost.set)

        redis_server.stop()
        redis_server.start()  # empty: `other` puts its configuration back and takes the slot
        taken = await eventually(lambda: _free_slot_despite_outage(other), "a slot, Redis back")

        await restored.shared.beat()  # it finds Redis restarted: its slot no longer fits

        assert await in_flight(other) == 1
        await asyncio.wait_for(lost.wait(), LONG)
        slot.release()
        taken.release()


async def test_a_slot_released_before_the_loss_is_learned_is_never_reported_lost(redis_url):
    async with fleet(redis_url, {H1: (1, 0)}, hold_ttl=1.0, beating=False) as (other, stalled):
        slot = await slot_of(stalled, [H1])
        told: list[str] = []
        on_lost(slot, lambda: told.append("lost"))
        taken = await eventually(lambda: _free_slot(other), "the stalled process's slot taken")

        slot.release()
        await stalled.shared.beat()

        assert await in_flight(other) == 1
        taken.release()
        await eventually(lambda: counted(other, 0), "the slot free")
        assert told == []


async def test_a_process_back_from_a_stall_loses_a_slot_taken_back_even_with_one_free_as_it_returns(
    redis_url,
):
    """Redis took the slot back and gave it to another request: whether a slot happens to be
    free as the stalled process returns says nothing of what the host runs, so only a slot
    lost with Redis's data (a restart) may be counted again, never one taken back."""
    async with fleet(redis_url, {H1: (1, 0)}, hold_ttl=1.0, beating=False) as (other, stalled):
        slot = await slot_of(stalled, [H1])
        lost = asyncio.Event()
        on_lost(slot, lost.set)
        taken = await eventually(lambda: _free_slot(other), "the stalled process's slot taken")
        taken.release()  # the request that took it back ends: the pair has a free slot
        await eventually(lambda: counted(other, 0), "the slot free")

        await stalled.shared.beat()  # it resumes: Redis learns what it holds

        assert await in_flight(other) == 0
        await asyncio.wait_for(lost.wait(), LONG)
        assert stalled.slots.held() == 0
        slot.release()  # its request ends: nothing was counted for it, nothing is given back
        assert await in_flight(other) == 0


# -- helpers -------------------------------------------------------------------------------


async def _free_slot(state: SharedState, pair: Pair = H1) -> SharedSlot | None:
    got = await state.place([pair])
    if isinstance(got, SharedPlace):
        late = got.cancel()
        assert late is None
        return None
    return got


async def _free_slot_despite_outage(state: SharedState) -> SharedSlot | None:
    try:
        return await _free_slot(state)
    except StateUnavailable:
        return None


async def _queued(state: SharedState, pair: Pair) -> bool:
    return any(s.queued for s in await state.slots.snapshot() if (s.host, s.model) == pair)


async def test_a_shared_slot_says_whether_it_was_released(redis_url):
    async with fleet(redis_url, {ROW[0]: (2, 0)}) as (a, _):
        first, second = await slot_of(a, [ROW[0]]), await slot_of(a, [ROW[0]])

        first.release()

        assert (first.released, second.released) == (True, False)
        second.release()
