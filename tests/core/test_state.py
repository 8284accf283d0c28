"""`LocalState`: one process's limiter and lease table in the shape placement uses (`FleetState`).

Each operation must reach the limiter or the lease table with what it was given: placement
and the dashboard see the fleet only through these.
"""

from __future__ import annotations

from routing.core.leases import LeaseKey, LeaseTable
from routing.core.limiter import Limiter, PairSnapshot, Slot, Waiter
from routing.core.pairs import Pair
from routing.core.state import LocalState


def local() -> LocalState:
    return LocalState(Limiter(), LeaseTable())


async def test_places_lines_and_counts_are_the_limiters() -> None:
    state = local()
    state.configure("h1", "m", parallel=2, queue_max=1)
    state.configure("h1", "x", parallel=1, queue_max=0)

    first, second = await state.place([Pair("h1", "m")]), await state.place([Pair("h1", "m")])
    waiter = await state.place([Pair("h1", "m")])

    assert isinstance(first, Slot) and isinstance(second, Slot) and isinstance(waiter, Waiter)
    assert await state.place([Pair("h1", "m")]) is None  # both slots held, the line full
    assert (state.in_flight("h1", "m"), state.queued("h1", "m")) == (2, 1)
    assert (state.free_for("h1", "m"), state.free_slots("h1")) == (0, 1)  # h1/x is free
    assert state.snapshot() == [
        PairSnapshot("h1", "m", 2, 1, 2, 1),
        PairSnapshot("h1", "x", 1, 0, 0, 0),
    ]
    first.release()
    assert waiter.granted.result().host == "h1"


async def test_a_removed_pair_is_unconfigured_once_its_slots_are_back() -> None:
    state = local()
    state.configure("h1", "m", parallel=2, queue_max=1)
    slot = await state.place([Pair("h1", "m")])
    assert isinstance(slot, Slot)

    state.remove("h1", "m")
    slot.release()

    assert state.snapshot() == []
    assert state.free_for("h1", "m") == 1  # an unconfigured pair's one slot


async def test_a_watcher_is_handed_a_slot_when_its_host_wakes_and_accepts() -> None:
    state = local()
    state.configure("h1", "m", parallel=1, queue_max=0)
    usable = {"h1": False}
    waiter = state.watcher()

    state.watch(waiter, [Pair("h1", "m")], lambda pair: usable[pair[0]])
    assert not waiter.granted.done()  # free, but not usable yet
    usable["h1"] = True
    state.wake("h1")
    waiter.settle()  # the slot is offered; the waiting task takes it

    assert waiter.granted.result().host == "h1"
    assert state.in_flight("h1", "m") == 1


async def test_leases_are_kept_found_counted_and_dropped_in_the_lease_table() -> None:
    state = local()
    chat, code = LeaseKey("chat", "conversation", "m"), LeaseKey("chat", "other", "x")
    assert await state.find_lease(chat, 60.0) is None

    await state.keep_lease(chat, "h1", 60.0, None)
    await state.keep_lease(code, "h1", 60.0, None)

    assert await state.find_lease(chat, 60.0) == "h1"
    assert (state.leases_held("h1"), state.leases_held("h1", "m")) == (2, 1)
    assert state.leases_by_host() == {"h1": 2}
    state.drop_host("h1")
    assert await state.find_lease(chat, 60.0) is None
    assert state.leases_by_host() == {}
