"""RedisClients against a real redis-server: a client key's limits hold over two processes."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from collections.abc import AsyncIterator

import pytest

from routing.core.clients import ClientSpec
from routing.core.errors import ClientLimited, RouteNotAllowed
from routing.shared.clients import RedisClients
from routing.shared.state import Shared, StateUnavailable
from tests.helpers.redis_server import RedisServer, holding_process
from tests.helpers.waits import LONG, eventually


@contextlib.asynccontextmanager
async def two(url: str, hold_ttl: float = 5.0) -> AsyncIterator[tuple[RedisClients, ...]]:
    shared = [Shared(url, hold_ttl=hold_ttl), Shared(url, hold_ttl=hold_ttl)]
    gates = tuple(RedisClients(s) for s in shared)
    for s in shared:
        await s.start()
    try:
        yield gates
    finally:
        for s in shared:
            await s.aclose()


def in_flight_is(gate: RedisClients, name: str, count: int):
    async def check() -> bool:
        return await gate.in_flight(name) == count

    return check


async def test_concurrency_is_limited_over_both_processes(redis_url):
    spec = ClientSpec("team", max_concurrent=2)
    async with two(redis_url) as (a, b):
        first = await a.admit(spec, "chat")
        await b.admit(spec, "chat")

        with pytest.raises(ClientLimited) as limited:
            await a.admit(spec, "chat")
        await first.arelease()
        await first.arelease()  # a second release is a no-op
        third = await b.admit(spec, "chat")

        assert limited.value.status == 429 and limited.value.retry_after == 1
        assert "at most 2" in limited.value.message
        assert third.client == spec
        assert await a.in_flight("team") == 2


async def test_the_sliding_minute_counts_admissions_from_both_processes(redis_url):
    spec = ClientSpec("team", per_minute=3)
    async with two(redis_url) as (a, b):
        for gate in (a, b, a):
            await (await gate.admit(spec, "chat")).arelease()

        with pytest.raises(ClientLimited) as limited:
            await b.admit(spec, "chat")

        assert limited.value.retry_after is not None
        assert 1 <= limited.value.retry_after <= 60
        assert "3 requests per minute" in limited.value.message
        with pytest.raises(ClientLimited):  # a refused request did not count, nor free one
            await a.admit(ClientSpec("team", per_minute=3), "chat")
        await (await a.admit(ClientSpec("team", per_minute=4), "chat")).arelease()


async def test_a_route_the_key_may_not_use_is_refused_without_counting(redis_url):
    spec = ClientSpec("team", routes=frozenset({"chat"}), max_concurrent=1)
    async with two(redis_url) as (a, _):
        with pytest.raises(RouteNotAllowed):
            await a.admit(spec, "code")
        assert await a.in_flight("team") == 0


async def test_a_pass_released_from_another_thread_stops_counting(redis_url):
    spec = ClientSpec("team", max_concurrent=1)
    async with two(redis_url) as (a, b):
        admitted = await a.admit(spec, "chat")
        thread = threading.Thread(target=admitted.release)
        thread.start()
        await asyncio.to_thread(thread.join, LONG)

        await eventually(in_flight_is(b, "team", 0), "the release to reach Redis")
        await (await b.admit(spec, "chat")).arelease()


async def test_a_killed_process_requests_stop_counting_within_its_expiry(redis_url):
    spec = ClientSpec("team", max_concurrent=1)
    async with two(redis_url) as (a, _):
        async with holding_process(redis_url, "client", "team") as holder:
            with pytest.raises(ClientLimited):
                await a.admit(spec, "chat")
            holder.send_signal(signal.SIGKILL)
            await asyncio.wait_for(holder.wait(), LONG)

        await eventually(in_flight_is(a, "team", 0), "the killed process's request to go")
        await (await a.admit(spec, "chat")).arelease()


async def test_after_a_redis_restart_the_requests_still_running_count_again(
    redis_server: RedisServer,
):
    spec = ClientSpec("team", max_concurrent=1)
    async with two(redis_server.url, hold_ttl=1.0) as (a, b):
        running = await a.admit(spec, "chat")
        redis_server.stop()
        with pytest.raises(StateUnavailable):
            await b.admit(spec, "chat")
        redis_server.start()

        await eventually(in_flight_is(b, "team", 1), "the running request to count again")
        with pytest.raises(ClientLimited):
            await b.admit(spec, "chat")
        await running.arelease()
        await (await b.admit(spec, "chat")).arelease()
        assert await b.in_flight("team") == 0


async def test_a_process_back_from_a_stall_counts_its_running_requests_again_past_the_limit(
    redis_url,
):
    """A quota is not worth a running generation: what the stalled process still runs counts
    again when it is back, and the key is refused until it is under its limit."""
    spec = ClientSpec("team", max_concurrent=1)
    live, stalled = Shared(redis_url), Shared(redis_url, hold_ttl=1.0)
    a, b = RedisClients(live), RedisClients(stalled)
    await live.start()
    await stalled.beat()  # its liveness renewed once: it stalls from here
    try:
        running = await b.admit(spec, "chat")

        async def admitted_here():
            with contextlib.suppress(ClientLimited):
                return await a.admit(spec, "chat")
            return None

        taken = await eventually(admitted_here, "the stalled process's request reclaimed")
        await stalled.beat()  # it resumes

        assert await a.in_flight("team") == 2
        await taken.arelease()
        with pytest.raises(ClientLimited):
            await a.admit(spec, "chat")  # 1 running: still at the limit
        await running.arelease()
        await (await a.admit(spec, "chat")).arelease()
    finally:
        await live.aclose()
        await stalled.aclose()
