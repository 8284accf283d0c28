"""RedisLeases against a real redis-server, two instances standing for two gateway processes."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from routing.core.leases import LeaseKey
from routing.shared.leases import RedisLeases, lease_id
from routing.shared.state import Shared, StateUnavailable
from tests.helpers.redis_server import RedisServer
from tests.helpers.waits import eventually

KEY = LeaseKey("chat", "fingerprint-1", "m")


@contextlib.asynccontextmanager
async def two(url: str, max_entries: int = 100_000) -> AsyncIterator[tuple[RedisLeases, ...]]:
    shared = [Shared(url), Shared(url)]
    try:
        yield tuple(RedisLeases(s, max_entries=max_entries) for s in shared)
    finally:
        for s in shared:
            await s.aclose()


async def lease(
    table: RedisLeases, key: LeaseKey = KEY, /, *, host: str = "h1", ttl: float = 60.0
) -> None:
    await table.keep(key, host, ttl)


async def test_a_lease_kept_by_one_process_is_found_by_the_other(redis_url):
    async with two(redis_url) as (a, b):
        await lease(a, host="h1")

        assert await b.slide(KEY, 60.0) == "h1"
        assert await b.held_by_host() == {"h1": 1}


async def test_reading_a_lease_slides_its_ttl_in_the_same_round_trip(redis_url):
    client = aioredis.Redis.from_url(redis_url)
    async with two(redis_url) as (a, b):
        await lease(a, ttl=2.0)
        assert 0 < await client.pttl(f"crossbar:lease:{lease_id(KEY)}") <= 2000

        assert await b.slide(KEY, 600.0) == "h1"

        assert await client.pttl(f"crossbar:lease:{lease_id(KEY)}") > 500_000
    await client.aclose()


async def test_a_lease_kept_again_moves_to_the_new_host_and_its_counts_follow(redis_url):
    async with two(redis_url) as (a, b):
        await lease(a, host="h1")
        await lease(b, host="h2")

        assert await a.slide(KEY, 60.0) == "h2"
        assert await a.held_by_host() == {"h2": 1}


async def test_no_fingerprint_stores_nothing(redis_url):
    async with two(redis_url) as (a, _):
        await lease(a, LeaseKey("chat", "", "m"), host="h1")

        assert await a.count() == 0
        assert await a.held_by_host() == {}


async def test_the_cap_keeps_the_leases_used_last_and_the_keys_stay_bounded(redis_url):
    client = aioredis.Redis.from_url(redis_url)
    async with two(redis_url, max_entries=5) as (a, b):
        keys = [LeaseKey("chat", f"conversation-{i}", "m") for i in range(20)]
        for i, key in enumerate(keys):
            await lease(a if i % 2 else b, key, host=f"h{i % 3}", ttl=60.0 + i)

        assert await a.count() == 5
        assert sum((await a.held_by_host()).values()) == 5
        assert [await b.slide(key, 60.0) is not None for key in keys] == [False] * 15 + [True] * 5
        lease_keys = [k for k in await client.keys("crossbar:lease:*")]
        assert len(lease_keys) == 5
    await client.aclose()


async def test_leases_expire_and_leave_no_key_behind(redis_url):
    client = aioredis.Redis.from_url(redis_url)
    async with two(redis_url) as (a, _):
        await lease(a, ttl=0.2)

        async def gone() -> bool:
            return await client.dbsize() == 0

        await eventually(gone, "the lease and its index keys to expire")
        assert await a.count() == 0
    await client.aclose()


async def test_a_lease_that_expires_leaves_the_counts_without_any_write(redis_url):
    async with two(redis_url) as (a, b):
        await lease(a, LeaseKey("chat", "short", "m"), host="h1", ttl=0.3)
        await lease(a, LeaseKey("chat", "long", "m"), host="h2", ttl=60.0)
        assert await b.held_by_host() == {"h1": 1, "h2": 1}

        async def expired() -> bool:
            return await b.held_by_host() == {"h2": 1}

        await eventually(expired, "the short lease to leave the counts")


async def test_counts_read_before_redis_lost_its_data_are_not_taken_for_current(redis_url):
    client = aioredis.Redis.from_url(redis_url)
    async with two(redis_url) as (a, b):
        await lease(a, LeaseKey("chat", "one", "m"), host="h1")
        assert await b.held_by_host() == {"h1": 1}
        await client.flushall()  # as a restart without persistence
        await lease(a, LeaseKey("chat", "two", "m"), host="h2")

        assert await b.held_by_host() == {"h2": 1}
    await client.aclose()


async def test_dropping_a_host_removes_only_its_leases(redis_url):
    async with two(redis_url) as (a, b):
        await lease(a, LeaseKey("chat", "one", "m"), host="h1")
        await lease(a, LeaseKey("chat", "two", "m"), host="h1")
        await lease(b, LeaseKey("chat", "three", "m"), host="h2")

        assert await b.drop_host("h1") == 2

        assert await a.held_by_host() == {"h2": 1}
        assert await a.slide(LeaseKey("chat", "one", "m"), 60.0) is None


async def test_a_stopped_redis_is_a_clear_error(redis_server: RedisServer):
    async with two(redis_server.url) as (a, _):
        await lease(a)
        redis_server.stop()
        with pytest.raises(StateUnavailable, match="Redis at 127.0.0.1"):
            await lease(a)
        redis_server.start()
        assert await a.slide(KEY, 60.0) is None  # restarted empty
        await lease(a, host="h2")
        assert await a.slide(KEY, 60.0) == "h2"


def conversation(number: int) -> LeaseKey:
    return LeaseKey("chat", f"conversation-{number}", "m")


async def numbers(table: RedisLeases, *keys: LeaseKey, host: str = "h1", slots: int = 2) -> list:
    return [await table.number(key, host, slots) for key in keys]


async def test_two_processes_share_slot_numbers_among_conversations_as_evenly_as_they_can(
    redis_url,
):
    async with two(redis_url) as (a, b):
        for n in range(5):
            await lease(a if n % 2 else b, conversation(n))

        assert await numbers(a, conversation(0)) == [0]
        assert await numbers(b, conversation(1), conversation(2)) == [1, 0]
        assert await numbers(a, conversation(3), conversation(4)) == [1, 0]
        # Each keeps its number, whichever process asks.
        assert await numbers(b, conversation(0)) + await numbers(a, conversation(1)) == [0, 1]
        await lease(b, conversation(1), host="h2")  # moved: number 1 keeps one conversation
        await lease(b, conversation(5))
        assert await numbers(a, conversation(5)) == [1]


async def test_a_slot_number_is_kept_per_host_and_model_and_only_on_the_leases_host(redis_url):
    other_model = LeaseKey("chat", "conversation-1", "llama")
    async with two(redis_url) as (a, b):
        await lease(a, conversation(0), host="h1")
        await lease(a, conversation(1), host="h2")
        await lease(a, other_model, host="h1")

        assert await numbers(b, conversation(0), other_model) == [0, 0]
        assert await numbers(b, conversation(1), host="h2") == [0]
        assert await numbers(a, conversation(0), host="h2") == [None]  # not its lease's host
        assert await numbers(a, conversation(9)) == [None]  # no lease at all


async def test_a_number_whose_lease_moved_or_expired_goes_to_the_next_conversation(redis_url):
    async with two(redis_url) as (a, b):
        await lease(a, conversation(0), ttl=0.3)
        await lease(a, conversation(1))
        assert await numbers(a, conversation(0), conversation(1)) == [0, 1]

        await lease(b, conversation(1), host="h2")  # moved: 1 is free on h1
        await lease(b, conversation(2))
        assert await numbers(b, conversation(2)) == [1]

        await asyncio.sleep(0.5)  # conversation 0's lease expired
        assert await numbers(a, conversation(2)) == [1]  # 0 is free, 2 keeps its own
        await lease(b, conversation(3))
        assert await numbers(a, conversation(3)) == [0]


async def test_slot_numbers_expire_with_their_leases_and_leave_no_key(redis_url):
    client = aioredis.Redis.from_url(redis_url)
    async with two(redis_url) as (a, _):
        await lease(a, conversation(0), ttl=0.3)
        assert await numbers(a, conversation(0)) == [0]

        async def gone() -> bool:
            return await client.dbsize() == 0

        await eventually(gone, "the lease, its number and their index keys to expire")
    await client.aclose()


async def test_no_slot_is_numbered_while_another_live_process_runs_a_request_on_the_pair(
    redis_url,
):
    # A request of the other process's that the host placed itself may run in the slot this
    # one would name, and a request naming a busy slot waits for it however idle the others.
    here, there = Shared(redis_url), Shared(redis_url)
    try:
        leases = RedisLeases(here)
        await lease(leases, conversation(0))
        held = f"{there.prefix}held:h1/m"
        await there.redis.hset(held, f"{there.proc}.1", there.proc)
        await there.redis.set(f"{there.prefix}proc:{there.proc}", "1")
        await here.redis.hset(held, f"{here.proc}.1", here.proc)  # this process's own: known

        assert await numbers(leases, conversation(0)) == [None]
        await there.redis.delete(f"{there.prefix}proc:{there.proc}")  # gone: its slot with it
        assert await numbers(leases, conversation(0)) == [0]
        await there.redis.set(f"{there.prefix}proc:{there.proc}", "1")
        await there.redis.hdel(held, f"{there.proc}.1")  # its request ended
        assert await numbers(leases, conversation(0)) == [0]
    finally:
        await here.aclose()
        await there.aclose()
