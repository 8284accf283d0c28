"""The model decider's lease against a real redis-server, two `Shared` standing for two
gateway processes: one takes it, renews it, never renews or deletes the other's, and the
other takes it over once its holder stops renewing it."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import redis.asyncio as aioredis

from routing.shared.model_decider import DeciderLease
from routing.shared.state import Shared
from tests.helpers.redis_server import RedisServer
from tests.helpers.waits import eventually

KEY = "crossbar:models:decider"


@contextlib.asynccontextmanager
async def two(url: str, ttl: float = 5.0) -> AsyncIterator[tuple[DeciderLease, DeciderLease]]:
    shared = [Shared(url), Shared(url)]
    try:
        yield DeciderLease(shared[0], ttl), DeciderLease(shared[1], ttl)
    finally:
        for s in shared:
            await s.aclose()


async def holder(url: str) -> str | None:
    client = aioredis.Redis.from_url(url, decode_responses=True)
    try:
        value = await client.get(KEY)
        return str(value) if value is not None else None
    finally:
        await client.aclose()


async def test_the_first_process_to_claim_the_lease_decides_and_the_other_does_not(redis_url):
    async with two(redis_url) as (a, b):
        assert await a.claim()
        assert not await b.claim()

        assert a.holds() and not b.holds()
        assert await holder(redis_url) == a.proc


async def test_the_holder_renews_its_lease_and_keeps_it(redis_url):
    client = aioredis.Redis.from_url(redis_url)
    async with two(redis_url, ttl=2.0) as (a, b):
        assert await a.claim()
        await client.pexpire(KEY, 100)  # as if most of its time had passed

        assert await a.claim()
        assert 100 < await client.pttl(KEY) <= 2000
        assert not await b.claim()
    await client.aclose()


async def test_a_process_never_renews_or_deletes_another_process_lease(redis_url):
    async with two(redis_url) as (a, b):
        assert await a.claim()

        await b.release()
        assert not await b.claim()
        assert await holder(redis_url) == a.proc

        await a.release()
        assert await holder(redis_url) is None
        assert not a.holds()
        assert await b.claim()


async def test_the_lease_is_taken_over_once_its_holder_stops_renewing_it(redis_url):
    async with two(redis_url, ttl=0.3) as (a, b):
        assert await a.claim()
        assert not await b.claim()

        assert await eventually(b.claim, "the other process to take the lease over")
        assert not a.holds()  # its time is up: it decides no more, though it was never told
        assert not await a.claim()
        assert await holder(redis_url) == b.proc


async def test_with_redis_away_no_process_decides_and_claiming_does_not_raise(
    redis_server: RedisServer,
):
    async with two(redis_server.url, ttl=0.3) as (a, _):
        assert await a.claim()
        redis_server.stop()

        async def gave_up() -> bool:
            return not await a.claim() and not a.holds()

        assert await eventually(gave_up, "the holder to stop deciding with Redis away")
