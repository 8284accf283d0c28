"""Placement over the shared state: the real `Placer` over one gateway process's `SharedState`
on a real redis-server, another process holding what other clients hold there.

The scenarios are tests/core/test_placement.py's where the two backings could part: a watch a
request sets on a host that is down, and a lease that follows a spilled turn. Each test ends
once Redis holds no slot, place or watch of either process.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest

from routing.core.leases import LeaseKey, LeaseOutcome
from routing.core.pairs import Pair
from routing.core.placement import Reason, Waiting
from routing.shared.fleet_state import SharedState
from tests.helpers.memory_fleet import MODEL, SHORT, Route, host, placed, placer, settle
from tests.helpers.shared_state import SharedFleet, counted, gateway, nothing_left, slot_of
from tests.helpers.waits import LONG, eventually


@contextlib.asynccontextmanager
async def placing(
    url: str, hosts: dict[str, dict[str, Any]], route: Route
) -> AsyncIterator[tuple[SharedFleet, SharedState, SharedState]]:
    """A fleet placing through one process's `SharedState` (its counts touch the fleet's
    rankings, as the runtime's do), that state, and another process's on the same Redis. On a
    clean exit, waits until Redis holds nothing of either."""
    fleets: list[SharedFleet] = []

    def touch(name: str) -> None:
        for fleet in fleets:
            fleet.rankings.touch(name)

    async with gateway(url) as other:
        state = SharedState(url, hold_ttl=5.0, on_change=touch)
        await state.start()
        try:
            fleets.append(SharedFleet(state, hosts, route))
            for name, spec in hosts.items():
                for model, limits in spec["models"].items():
                    for shared in (state, other):
                        shared.configure(name, model, limits["parallel"], limits["queue_max"])
                        await shared.slots.configure(
                            name, model, limits["parallel"], limits["queue_max"]
                        )
            yield fleets[0], state, other
            await eventually(lambda: nothing_left(url, state), "every slot and place given back")
            assert state.slots.held() == other.slots.held() == 0
        finally:
            await state.aclose()


async def lease_of(state: SharedState) -> str | None:
    """The conversation's lease as Redis holds it (the read slides it)."""
    return await state.find_lease(LeaseKey("chat", "conversation", MODEL), 60.0)


async def queued(state: SharedState, name: str) -> int:
    """Redis's count of the places in the host's line, over every process."""
    return next(s.queued for s in await state.slots.snapshot() if s.host == name)


async def test_a_request_moved_into_a_line_takes_a_slot_of_its_host_come_back_after_patience(
    redis_url,
):
    # gpu1 restarts: its conversation's turn moves into gpu2's line, and waits there past its
    # patience. gpu1 comes back empty; a free slot there must take the turn (and the lease),
    # not leave it behind gpu2's own conversations while gpu1 idles. Redis cannot ask this
    # process whether gpu1 is usable: the watch reaches Redis when gpu1 comes back.
    route = Route(lease_patience=SHORT)
    hosts = {"gpu1": host(2, 8), "gpu2": host(2, 8)}
    async with placing(redis_url, hosts, route) as (fleet, here, other):
        (await placed(fleet, route)).slot.release()
        fleet.set_host("gpu1", healthy=False)
        held = [await slot_of(other, [Pair("gpu2", MODEL)]) for _ in range(2)]
        waiting = await (moved := placer(fleet, route)).now()
        assert isinstance(waiting, Waiting)
        assert (waiting.host, waiting.reason) == ("gpu2", Reason.MOVED)
        task = asyncio.create_task(moved.wait(waiting))
        loop = asyncio.get_running_loop()
        await asyncio.sleep(moved.started + SHORT + SHORT / 5 - loop.time())  # patience spent
        await settle()
        assert not task.done()

        fleet.set_host("gpu1", healthy=True)
        got = await asyncio.wait_for(task, LONG)

        assert (got.host, got.reason, got.lease) == ("gpu1", Reason.SPILLED, LeaseOutcome.MOVED)
        assert await lease_of(here) == "gpu1"
        assert await queued(other, "gpu2") == 0
        got.slot.release()
        for slot in held:
            slot.release()


@pytest.mark.parametrize(("at_home", "elsewhere", "leased_to"), [(4, 1, "gpu2"), (3, 2, "gpu1")])
async def test_a_turn_spilled_from_a_home_holding_more_conversations_takes_its_lease_along(
    redis_url, at_home: int, elsewhere: int, leased_to: str
) -> None:
    # gpu1 holds `at_home` conversations (this one among them), gpu2 `elsewhere`, two slots
    # each, the others leased and running through another process. A turn that waited at gpu1
    # past its patience runs on gpu2: the lease goes along when that brings the two hosts'
    # conversations closer, and stays home otherwise, as in one process.
    route = Route(lease_patience=SHORT)
    hosts = {"gpu1": host(2, 8), "gpu2": host(2, 8)}
    async with placing(redis_url, hosts, route) as (fleet, here, other):
        (await placed(fleet, route)).slot.release()
        home = Pair("gpu1", MODEL)
        await eventually(lambda: counted(other, 0, home), "the first turn's slot back")
        for name, count in {"gpu1": at_home - 1, "gpu2": elsewhere}.items():
            for number in range(count):
                key = LeaseKey(route.name, f"{name} {number}", MODEL)
                await other.keep_lease(key, name, 300.0, None)
        held = [await slot_of(other, [Pair(name, MODEL)]) for name in hosts for _ in range(2)]
        await here.shared.beat()  # a tick: the other process's leases and slots counted
        assert (here.leases_held("gpu1"), here.leases_held("gpu2")) == (
            at_home,
            elsewhere,
        )
        waiting = await (turn := placer(fleet, route)).now()
        assert isinstance(waiting, Waiting)
        assert (waiting.host, waiting.reason) == ("gpu1", Reason.HOME)
        task = asyncio.create_task(turn.wait(waiting))
        loop = asyncio.get_running_loop()
        await asyncio.sleep(turn.started + SHORT + SHORT / 5 - loop.time())  # patience spent
        await settle()

        held.pop().release()  # a slot of gpu2
        got = await asyncio.wait_for(task, LONG)

        moved = leased_to == "gpu2"
        assert (got.host, got.reason) == ("gpu2", Reason.SPILLED)
        assert got.lease is (LeaseOutcome.MOVED if moved else LeaseOutcome.SPILLED)
        assert await lease_of(here) == leased_to
        got.slot.release()
        for slot in held:
            slot.release()
