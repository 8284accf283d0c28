"""The shared state as the tests under tests/shared drive it: one gateway process's
`SharedState` on a real redis-server, what Redis holds, and a `MemoryFleet` over it."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import redis.asyncio as aioredis

from routing.core.limiter import Pair
from routing.shared.fleet_state import SharedState
from routing.shared.places import SharedSlot
from routing.shared.state import DEFAULT_PREFIX
from tests.helpers.memory_fleet import MemoryFleet, Route

H1: Pair = Pair("h1", "m")


@contextlib.asynccontextmanager
async def gateway(
    url: str, *, hold_ttl: float = 5.0, beating: bool = True
) -> AsyncIterator[SharedState]:
    """One gateway process's SharedState. Not `beating`: its liveness is renewed once, then only
    when the test calls `state.shared.beat()`, as in a process that stalls between ticks."""
    state = SharedState(url, hold_ttl=hold_ttl)
    if beating:
        await state.start()
    else:
        await state.shared.beat()
        await state.slots.start()
    try:
        yield state
    finally:
        await state.aclose()


async def nothing_left(url: str, state: SharedState) -> bool:
    snapshot = await state.slots.snapshot()
    if any(pair.in_flight or pair.queued for pair in snapshot):
        return False
    return not await redis_keys(url, "waiter:*") and not await redis_keys(url, "watch:*")


async def redis_keys(url: str, pattern: str) -> list[Any]:
    """Redis's keys under the gateway's prefix that match `pattern`."""
    client = aioredis.Redis.from_url(url)
    try:
        return await client.keys(f"{DEFAULT_PREFIX}{pattern}")
    finally:
        await client.aclose()


async def in_flight(state: SharedState, pair: Pair = H1) -> int:
    """Redis's count of the pair's slots held, over every process."""
    return next(s.in_flight for s in await state.slots.snapshot() if (s.host, s.model) == pair)


async def counted(state: SharedState, slots: int, pair: Pair = H1) -> bool:
    """Whether Redis counts `slots` of the pair's slots held, over every process."""
    return await in_flight(state, pair) == slots


async def slot_of(state: SharedState, pairs: list[Pair]) -> SharedSlot:
    got = await state.place(pairs)
    assert isinstance(got, SharedSlot), got
    return got


class SharedFleet(MemoryFleet):
    """A `MemoryFleet` whose slots, lines and leases are one process's `SharedState`."""

    def __init__(
        self, state: SharedState, hosts: dict[str, dict[str, Any]], *routes: Route
    ) -> None:
        super().__init__(hosts, *routes)
        self.state = state  # type: ignore[assignment]  # the shared backing stands in
