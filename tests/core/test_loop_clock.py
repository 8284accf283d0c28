"""The runtime's tables read time on the running event loop's clock, so that a loop whose clock
is virtual (the fleet twin's) sees leases expire and slots held as its own time says, and the
same run gives the same decisions every time."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from routing.core.leases import LeaseKey, LeaseTable
from routing.core.running import RunningTable

T = TypeVar("T")


def on_a_loop_at(start: float, scenario: Callable[[list[float]], Awaitable[T]]) -> T:
    """Runs `scenario` on a loop whose clock reads the list's one value (moved by the scenario)."""
    now = [start]
    loop = asyncio.new_event_loop()
    loop.time = lambda: now[0]  # type: ignore[method-assign]
    try:
        return loop.run_until_complete(scenario(now))
    finally:
        loop.close()


def test_how_long_a_request_has_held_its_slot_is_read_on_its_loops_clock() -> None:
    async def scenario(now: list[float]) -> list[float]:
        table = RunningTable()
        entry = table.add("chat", "m", "")
        table.placed(entry, "gpu1", 0, "m")
        now[0] += 7.5
        return table.holding("gpu1", "m")

    assert on_a_loop_at(10_000.0, scenario) == [7.5]


def test_a_lease_expires_when_its_loops_clock_passes_its_ttl() -> None:
    key = LeaseKey("chat", "conversation", "m")

    async def scenario(now: list[float]) -> tuple[str | None, str | None]:
        leases = LeaseTable()
        leases.keep(key, "gpu1", ttl=10.0)
        now[0] += 9.0
        before = leases.find(key)
        now[0] += 2.0
        return before, leases.find(key)

    assert on_a_loop_at(10_000.0, scenario) == ("gpu1", None)
