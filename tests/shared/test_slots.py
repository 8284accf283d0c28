"""RedisSlots against a real redis-server: two instances on their own connections stand for two
gateway processes, and one test kills a real second process with SIGKILL."""

from __future__ import annotations

import asyncio
import contextlib
import random
import signal
from collections import Counter
from collections.abc import AsyncIterator, Sequence

import pytest
import redis.asyncio as aioredis

from routing.core.limiter import PairSnapshot
from routing.core.pairs import Pair
from routing.shared.grants import Grant, Queued
from routing.shared.slots import RedisSlots
from routing.shared.state import Shared, StateUnavailable
from tests.helpers.redis_server import RedisServer, holding_process
from tests.helpers.waits import LONG, eventually


@contextlib.asynccontextmanager
async def gateway_process(url: str, hold_ttl: float = 5.0) -> AsyncIterator[RedisSlots]:
    """One process's RedisSlots on its own connection pool and liveness."""
    shared = Shared(url, hold_ttl=hold_ttl)
    slots = RedisSlots(shared)
    await shared.start()
    await slots.start()
    try:
        yield slots
    finally:
        await slots.aclose()
        await shared.aclose()


@contextlib.asynccontextmanager
async def two(url: str, hold_ttl: float = 5.0) -> AsyncIterator[tuple[RedisSlots, RedisSlots]]:
    async with gateway_process(url, hold_ttl) as a, gateway_process(url, hold_ttl) as b:
        yield a, b


async def configure(
    parallel: int, queue_max: int, *instances: RedisSlots, pair: Pair = Pair("h1", "m")
) -> None:
    for slots in instances:
        await slots.configure(*pair, parallel=parallel, queue_max=queue_max)


async def granted(slots: RedisSlots, pairs: Sequence[Pair] = (Pair("h1", "m"),)) -> Grant:
    """A place the test's setup expects to be a free slot."""
    placed = await slots.place(pairs)
    assert isinstance(placed, Grant), placed
    return placed


async def queued_at(slots: RedisSlots, pairs: Sequence[Pair] = (Pair("h1", "m"),)) -> Queued:
    """A place the test's setup expects to be in a queue."""
    placed = await slots.place(pairs)
    assert isinstance(placed, Queued), placed
    return placed


async def state(slots: RedisSlots, host: str = "h1", model: str = "m") -> PairSnapshot:
    return next(s for s in await slots.snapshot() if (s.host, s.model) == (host, model))


async def test_a_free_slot_is_granted_then_requests_queue_then_the_next_is_refused(redis_url):
    async with two(redis_url) as (a, b):
        await configure(1, 1, a, b)

        first = await a.place([Pair("h1", "m")])
        second = await b.place([Pair("h1", "m")])
        third = await a.place([Pair("h1", "m")])

        assert isinstance(first, Grant) and (first.host, first.model) == ("h1", "m")
        assert isinstance(second, Queued) and second.position == 1
        assert third is None
        assert await state(a) == PairSnapshot("h1", "m", 1, 1, in_flight=1, queued=1)
        assert await b.cancel(second) is None
        await a.release(first)


async def test_a_release_in_one_process_hands_the_slot_to_a_waiter_in_the_other(redis_url):
    async with two(redis_url) as (a, b):
        await configure(1, 4, a, b)
        held = await granted(a)
        queued = await queued_at(b)
        waiting = asyncio.create_task(b.wait(queued))

        await a.release(held)
        grant = await asyncio.wait_for(waiting, LONG)

        assert (grant.host, grant.model, grant.id) == ("h1", "m", queued.id)
        assert await state(a) == PairSnapshot("h1", "m", 1, 4, in_flight=1, queued=0)
        await b.release(grant)
        assert (await state(b)).in_flight == 0


async def test_waiters_are_granted_in_arrival_order_across_processes(redis_url):
    async with two(redis_url) as (a, b):
        await configure(1, 6, a, b)
        held = await granted(a)
        arrivals = []
        for slots in (b, a, b, b, a, a):
            arrivals.append((slots, await queued_at(slots)))
        assert [queued.position for _, queued in arrivals] == [1, 2, 3, 4, 5, 6]

        tasks = {asyncio.create_task(slots.wait(queued)): slots for slots, queued in arrivals}
        await a.release(held)
        order = []
        pending = set(tasks)
        while pending:  # one slot: each grant comes only once the previous one is released
            done, pending = await asyncio.wait(
                pending, timeout=LONG, return_when=asyncio.FIRST_COMPLETED
            )
            assert len(done) == 1
            task = done.pop()
            order.append(task.result().id)
            await tasks[task].release(task.result())

        assert order == [queued.id for _, queued in arrivals]
        assert await state(a) == PairSnapshot("h1", "m", 1, 6, in_flight=0, queued=0)


async def test_place_takes_the_first_free_pair_in_order_else_queues_on_the_first_with_room(
    redis_url,
):
    async with two(redis_url) as (a, b):
        for slots in (a, b):
            await slots.configure("h1", "m", parallel=1, queue_max=0)
            await slots.configure("h2", "m", parallel=1, queue_max=1)
            await slots.configure("h3", "m", parallel=1, queue_max=1)
        order = [Pair("h1", "m"), Pair("h2", "m"), Pair("h3", "m")]

        grants = [await granted(a, order), await granted(b, order), await granted(a, order)]
        queued = [await queued_at(b, order), await queued_at(a, order)]
        refused = await b.place(order)

        assert [g.host for g in grants] == ["h1", "h2", "h3"]
        assert [(q.host, q.position) for q in queued] == [("h2", 1), ("h3", 1)]
        assert refused is None
        for q, slots in zip(queued, (b, a), strict=True):
            assert await slots.cancel(q) is None
        for g, slots in zip(grants, (a, b, a), strict=True):
            await slots.release(g)
        assert all(s.in_flight == 0 and s.queued == 0 for s in await a.snapshot())


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_parallel_is_never_exceeded_under_concurrent_place_wait_cancel_and_release(
    redis_url, seed
):
    rng = random.Random(seed)
    limits = {Pair("h1", "m"): (3, 4), Pair("h2", "m"): (2, 2)}
    running: Counter[Pair] = Counter()
    most: Counter[Pair] = Counter()
    outcomes: Counter[str] = Counter()
    async with two(redis_url) as (a, b):
        for pair, (parallel, queue_max) in limits.items():
            await configure(parallel, queue_max, a, b, pair=pair)

        async def use(grant: Grant, slots: RedisSlots) -> None:
            pair = Pair(grant.host, grant.model)
            running[pair] += 1
            most[pair] = max(most[pair], running[pair])
            await asyncio.sleep(rng.uniform(0, 0.02))
            running[pair] -= 1  # before the release: the slot may be someone else's right after
            await slots.release(grant)
            await slots.release(grant)  # a second release is a no-op

        async def client() -> None:
            slots = rng.choice((a, b))
            pairs = list(limits)
            rng.shuffle(pairs)
            await asyncio.sleep(rng.uniform(0, 0.2))
            placed = await slots.place(pairs)
            if placed is None:
                outcomes["refused"] += 1
                return
            if isinstance(placed, Grant):
                outcomes["granted"] += 1
                return await use(placed, slots)
            if rng.random() < 0.3:
                others = [pair for pair in limits if pair != (placed.host, placed.model)]
                if (early := await slots.watch(placed, others)) is not None:
                    outcomes["spilled"] += 1
                    return await use(early, slots)
            try:
                grant = await asyncio.wait_for(slots.wait(placed), rng.uniform(0.001, 0.3))
            except TimeoutError:
                late = await slots.cancel(placed)
                outcomes["cancelled"] += 1
                if late is not None:
                    await slots.release(late)
                return
            outcomes["waited"] += 1
            await use(grant, slots)

        await asyncio.wait_for(asyncio.gather(*(client() for _ in range(80))), LONG * 2)

        assert all(most[pair] <= parallel for pair, (parallel, _) in limits.items()), most
        assert sum(outcomes.values()) == 80
        assert outcomes["waited"] > 0 and outcomes["granted"] > 0, outcomes
        assert a.held() == b.held() == 0
        assert all(s.in_flight == 0 and s.queued == 0 for s in await a.snapshot())


async def test_requests_cancelled_at_any_point_leave_no_slot_or_place_behind(redis_url):
    rng = random.Random(7)
    async with two(redis_url) as (a, b):
        await configure(2, 3, a, b)

        async def request(slots: RedisSlots) -> None:
            """As the proxy uses it: every way out of a wait cancels, every grant is released."""
            placed = await slots.place([Pair("h1", "m")])
            if placed is None:
                return
            if isinstance(placed, Queued):
                queued = placed
                try:
                    placed = await slots.wait(queued)
                except BaseException:
                    late = await slots.cancel(queued)
                    if late is not None:
                        await slots.release(late)
                    raise
            try:
                await asyncio.sleep(rng.uniform(0, 0.05))
            finally:
                await slots.release(placed)

        tasks = [asyncio.create_task(request(rng.choice((a, b)))) for _ in range(60)]
        for task in tasks:  # clients leaving at any moment: in place, wait, use or release
            asyncio.get_running_loop().call_later(rng.uniform(0, 0.15), task.cancel)
        await asyncio.wait(tasks, timeout=LONG)

        assert all(task.done() for task in tasks)
        await eventually(lambda: _idle(a), "every slot and place given back")
        assert a.held() == b.held() == 0


async def test_cancel_gives_the_place_back_and_a_newcomer_takes_it(redis_url):
    async with two(redis_url) as (a, b):
        await configure(1, 1, a, b)
        held = await granted(a)
        queued = await queued_at(b)
        assert await a.place([Pair("h1", "m")]) is None

        waiting = asyncio.create_task(b.wait(queued))
        await asyncio.sleep(0.05)
        waiting.cancel()
        assert await b.cancel(queued) is None

        again = await a.place([Pair("h1", "m")])
        assert isinstance(again, Queued) and again.position == 1
        await a.cancel(again)
        await a.release(held)
        assert await state(a) == PairSnapshot("h1", "m", 1, 1, in_flight=0, queued=0)


async def test_a_grant_landing_as_the_wait_is_cancelled_comes_back_from_cancel(redis_url):
    async with two(redis_url) as (a, b):
        await configure(1, 2, a, b)
        held = await granted(a)
        queued = await queued_at(b)
        waiting = asyncio.create_task(b.wait(queued))
        await asyncio.sleep(0)

        # The release hands the slot to the waiter inside Redis; the waiter's task is
        # cancelled before (or as) it hears, so only cancel() can give the slot back.
        await a.release(held)
        waiting.cancel()
        late = await b.cancel(queued)

        assert isinstance(late, Grant) and late.id == queued.id
        assert (await state(a)).in_flight == 1
        await b.release(late)
        assert await state(a) == PairSnapshot("h1", "m", 1, 2, in_flight=0, queued=0)
        fresh = await a.place([Pair("h1", "m")])
        assert isinstance(fresh, Grant)
        await a.release(fresh)


async def test_a_grant_that_lands_before_anyone_waits_is_returned_by_cancel(redis_url):
    async with two(redis_url) as (a, b):
        await configure(1, 2, a, b)
        held = await granted(a)
        queued = await queued_at(b)
        await a.release(held)

        late = await b.cancel(queued)

        assert isinstance(late, Grant) and late.id == queued.id
        await b.release(late)
        assert (await state(a)).in_flight == 0


async def test_watch_grants_a_free_slot_of_another_pair_at_once(redis_url):
    async with two(redis_url) as (a, b):
        for slots in (a, b):
            await slots.configure("home", "m", parallel=1, queue_max=2)
            await slots.configure("other", "m", parallel=1, queue_max=2)
        home = await granted(a, [Pair("home", "m")])
        queued = await queued_at(b, [Pair("home", "m")])

        spilled = await b.watch(queued, [Pair("other", "m")])

        assert isinstance(spilled, Grant) and spilled.host == "other" and spilled.id == queued.id
        assert await b.wait(queued) == spilled
        assert {(s.host, s.in_flight, s.queued) for s in await a.snapshot()} == {
            ("home", 1, 0),
            ("other", 1, 0),
        }
        await b.release(spilled)
        await a.release(home)


async def test_a_watcher_gets_a_slot_freed_later_but_only_after_that_pairs_own_waiters(
    redis_url,
):
    async with two(redis_url) as (a, b):
        for slots in (a, b):
            await slots.configure("home", "m", parallel=1, queue_max=2)
            await slots.configure("other", "m", parallel=1, queue_max=2)
        home = await granted(a, [Pair("home", "m")])
        other = await granted(a, [Pair("other", "m")])
        watcher = await queued_at(b, [Pair("home", "m")])
        assert await b.watch(watcher, [Pair("other", "m")]) is None
        own = await queued_at(a, [Pair("other", "m")])  # other's own waiter, after the watcher came

        await a.release(other)
        own_grant = await asyncio.wait_for(a.wait(own), LONG)
        assert own_grant.host == "other"
        await a.release(own_grant)
        spilled = await asyncio.wait_for(b.wait(watcher), LONG)

        assert spilled.host == "other"
        assert (await state(a, "home")).queued == 0  # it left home's queue when granted
        await b.release(spilled)
        await a.release(home)
        assert all(s.in_flight == 0 and s.queued == 0 for s in await a.snapshot())


async def test_raising_parallel_grants_the_waiters_at_once(redis_url):
    async with two(redis_url) as (a, b):
        await configure(1, 4, a, b)
        held = await granted(a)
        queued = [await queued_at(b) for _ in range(2)]

        await a.configure("h1", "m", parallel=3, queue_max=4)

        grants = [await asyncio.wait_for(b.wait(q), LONG) for q in queued]
        assert [g.id for g in grants] == [q.id for q in queued]
        for grant in grants:
            await b.release(grant)
        await a.release(held)


async def test_a_killed_process_slot_goes_to_the_next_waiter_within_its_expiry(redis_url):
    async with gateway_process(redis_url, hold_ttl=1.0) as slots:
        await slots.configure("h1", "m", parallel=1, queue_max=4)
        async with holding_process(redis_url, "slot", "h1", "m") as holder:
            queued = await slots.place([Pair("h1", "m")])
            assert isinstance(queued, Queued)

            holder.send_signal(signal.SIGKILL)
            await asyncio.wait_for(holder.wait(), LONG)
            # Bounded by the holder's expiry (1 s) and the sweep (each second), not by a release.
            grant = await asyncio.wait_for(slots.wait(queued), LONG)

        assert grant.id == queued.id
        await slots.release(grant)
        assert await state(slots) == PairSnapshot("h1", "m", 1, 4, in_flight=0, queued=0)


async def test_a_stopped_redis_gives_a_clear_error_and_after_its_restart_nothing_is_leaked(
    redis_server: RedisServer,
):
    async with two(redis_server.url, hold_ttl=1.0) as (a, b):
        await configure(2, 2, a, b)
        kept = await a.place([Pair("h1", "m")])  # its request runs on through the outage
        dropped = await b.place([Pair("h1", "m")])  # released during the outage
        queued = await queued_at(a)
        waiting = asyncio.create_task(a.wait(queued))
        assert isinstance(kept, Grant) and isinstance(dropped, Grant)

        redis_server.stop()
        with pytest.raises(StateUnavailable) as refused:
            await b.place([Pair("h1", "m")])
        with pytest.raises(StateUnavailable):
            await asyncio.wait_for(waiting, LONG)  # its place cannot be kept
        await b.release(dropped)  # owed, not raised
        assert await a.cancel(queued) is None  # owed too

        assert refused.value.status == 503
        assert f"127.0.0.1:{redis_server.port}" in refused.value.message
        redis_server.start()  # empty: nothing was persisted

        async def placed_again() -> Grant | None:
            try:
                grant = await b.place([Pair("h1", "m")])
            except StateUnavailable:
                return None
            assert isinstance(grant, Grant)
            return grant

        again = await eventually(placed_again, "a place once Redis is back")
        # `kept` still runs, so it counts again after the restart: one slot of two is left.
        await eventually(
            lambda: _in_flight_is(a, 2), "the slot held through the outage counted again"
        )
        late = await a.place([Pair("h1", "m")])
        assert isinstance(late, Queued)  # both slots are taken: a queue place
        assert await a.cancel(late) is None
        await b.release(again)
        await a.release(kept)
        await eventually(lambda: _idle(a), "every slot and place given back")


class CutLink:
    """A TCP relay to Redis that the test can cut (every connection reset, new ones refused at
    once) and mend, while Redis itself keeps running with all it holds: a network cut."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.cut = False
        self.writers: set[asyncio.StreamWriter] = set()
        self.server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"redis://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/0"

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.cut:
            writer.transport.abort()
            return
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.port)
        self.writers |= {writer, up_writer}

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError):
                while data := await src.read(65536):
                    dst.write(data)
            dst.transport.abort()

        await asyncio.gather(pump(reader, up_writer), pump(up_reader, writer))

    def sever(self) -> None:
        self.cut = True
        for writer in self.writers:
            writer.transport.abort()
        self.writers.clear()


async def test_a_release_that_cannot_reach_redis_is_given_back_once_redis_answers(
    redis_server: RedisServer,
):
    link = CutLink(redis_server.port)
    link.server = await asyncio.start_server(link.serve, "127.0.0.1", 0)
    async with link.server:
        async with gateway_process(link.url, 30.0) as a, gateway_process(redis_server.url) as b:
            await configure(1, 0, a, b)
            grant = await granted(a)

            link.sever()
            await a.release(grant)  # owed, not raised: Redis still counts the slot
            assert a.held() == 0
            assert await b.place([Pair("h1", "m")]) is None
            link.cut = False

            async def placed() -> Grant | Queued | None:
                return await b.place([Pair("h1", "m")])

            again = await eventually(placed, "the slot the cut release owed, given back")
            assert isinstance(again, Grant)
            await b.release(again)
        link.sever()


async def _in_flight_is(slots: RedisSlots, count: int) -> bool:
    return (await state(slots)).in_flight == count


async def _idle(slots: RedisSlots) -> bool:
    snapshot = await slots.snapshot()
    return bool(snapshot) and all(s.in_flight == 0 and s.queued == 0 for s in snapshot)


async def test_redis_keys_stay_bounded_over_many_requests(redis_url):
    async with two(redis_url) as (a, b):
        await configure(2, 2, a, b)
        client = aioredis.Redis.from_url(redis_url)

        async def churn(rounds: int) -> None:
            for _ in range(rounds):
                first = await granted(a)
                second = await granted(b)
                queued = await a.place([Pair("h1", "m")])
                assert isinstance(queued, Queued)
                await a.watch(queued, [Pair("h1", "m")])
                await a.cancel(queued)
                await b.release(second)
                await a.release(first)

        async def keys() -> list[str]:
            # The sweep's lock lives for most of a tick whether or not a sweep just ran.
            every = [key.decode() if isinstance(key, bytes) else key for key in await client.keys()]
            return sorted(key for key in every if not key.endswith("sweeping"))

        await churn(5)
        keys_after_5 = await keys()
        await churn(200)

        assert await keys() == keys_after_5
        assert not [key for key in keys_after_5 if "waiter:" in key]
        await client.aclose()


async def test_bad_use_gets_a_clear_error(redis_url):
    async with gateway_process(redis_url) as slots:
        with pytest.raises(ValueError, match="h9/m is not configured"):
            await slots.place([Pair("h9", "m")])
        with pytest.raises(ValueError, match="at least one"):
            await slots.place([])
        with pytest.raises(ValueError, match="without '/'"):
            await slots.configure("a/b", "m", 1, 1)
    with pytest.raises(ValueError, match="must start with redis://"):
        Shared("http://127.0.0.1:6379")
    with pytest.raises(ValueError, match="positive"):
        Shared(redis_url, hold_ttl=0)


async def test_an_unreachable_redis_is_a_clear_error_that_never_shows_the_password():
    shared = Shared("redis://user:s3cret-pw@127.0.0.1:1/0", timeout=1.0)
    slots = RedisSlots(shared)
    await shared.start()  # does not raise: the process keeps trying
    await slots.start(patience=0.5)
    try:
        with pytest.raises(StateUnavailable) as unreachable:
            await slots.configure("h1", "m", 1, 1)
    finally:
        await slots.aclose()
        await shared.aclose()
    assert unreachable.value.message == (
        "shared state unavailable: Redis at 127.0.0.1:1 cannot be reached"
    )
    assert "s3cret" not in str(unreachable.value)


async def test_each_process_sees_the_others_slots_and_places_as_they_change(redis_url):
    async with two(redis_url) as (a, b):
        await configure(1, 2, a, b)
        idle = await b.snapshot(others_only=True)
        held = await granted(a)
        taken = await b.snapshot(others_only=True)
        waiting = await queued_at(a)
        in_line = await b.snapshot(others_only=True)
        assert await a.cancel(waiting) is None
        left = await b.snapshot(others_only=True)
        await a.release(held)
        released = await b.snapshot(others_only=True)

        assert [(s.in_flight, s.queued) for s in idle] == [(0, 0)]
        assert [(s.in_flight, s.queued) for s in taken] == [(1, 0)]
        assert [(s.in_flight, s.queued) for s in in_line] == [(1, 1)]
        assert [(s.in_flight, s.queued) for s in left] == [(1, 0)]
        assert [(s.in_flight, s.queued) for s in released] == [(0, 0)]
