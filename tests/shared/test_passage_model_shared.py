"""The model of the request path (tests/proxy/test_passage_model.py) over the shared state: two
gateway processes' `SharedState`s on one real redis-server, each request arriving at one of
them, the same rules and the same checks after every step.

What differs from the in-process run, and why:
- Time is real (Redis answers on its own clock), so the route's deadlines are short and a step
  lets a fraction of a second pass; "settled" means nothing changed over a few polls.
- The held-slot counts are Redis's own (its `held:` hashes, over both processes).
- Refusals are not checked against the counts: a deadline firing while a refusal's round trip
  is out changes the counts the check would read. The refusal rule is checked in-process.
- A process stalled past its hold TTL is not modelled here: a stalled process runs nothing,
  which one event loop cannot play; tests/shared/test_fleet_state.py and test_replicas.py
  check that case on its own.
"""

from __future__ import annotations

import asyncio
import functools
import shutil
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis.asyncio as aioredis
from hypothesis import HealthCheck, Phase, settings

from routing.shared.fleet_state import SharedState
from tests.helpers.memory_fleet import MODEL, MemoryFleet, Route
from tests.helpers.redis_server import RedisServer
from tests.helpers.request_path import RequestPath
from tests.helpers.shared_state import SharedFleet

SETTLED = 3  # polls in a row that saw nothing change
POLL = 0.02  # seconds between them


class SharedRequestPath(RequestPath):
    PATIENCES = (0.0, 0.15, 30.0, None)
    AUTO_DEFAULT = 0.15
    QUEUE_TIMEOUT = 3.0
    FALLBACK_AFTER = 0.4
    PASSES = (0.05, 0.2, 0.5, 1.0)
    CHECKS_REFUSALS = False
    redis_url = ""  # set by the test before it runs the machine

    def make_loop(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.new_event_loop()
        loop.run_until_complete(self._flushed())  # each run starts from an empty Redis
        self.fleets: list[SharedFleet] = []
        self.states = [loop.run_until_complete(self._started(process)) for process in range(2)]
        return loop

    async def _flushed(self) -> None:
        client = aioredis.Redis.from_url(self.redis_url)
        try:
            await client.flushall()
        finally:
            await client.aclose()

    async def _started(self, process: int) -> SharedState:
        """A process's state, whose counts touch its fleet's rankings as the runtime's do."""

        def touch(host: str) -> None:
            if self.fleets:
                self.fleets[process].rankings.touch(host)

        state = SharedState(self.redis_url, hold_ttl=5.0, on_change=touch)
        await state.start()
        return state

    def make_fleet(self, hosts: dict[str, dict[str, Any]], *routes: Route) -> MemoryFleet:
        self.fleets = [SharedFleet(state, hosts, *routes) for state in self.states]
        for name, spec in hosts.items():
            for model, limits in spec["models"].items():
                self._configure(name, model, limits["parallel"], limits["queue_max"])
        return self.fleets[0]

    def fleet_of(self, process: int) -> MemoryFleet:
        return self.fleets[process]

    def act(self, action: Callable[[], None]) -> None:
        """Inside the loop: what the shared state does in the background goes on its tasks."""

        async def inside() -> None:
            action()

        self.loop.run_until_complete(inside())

    def _configure(self, name: str, model: str, parallel: int, queue_max: int) -> None:
        for state in self.states:
            self.act(functools.partial(state.configure, name, model, parallel, queue_max))
            self.loop.run_until_complete(state.slots.configure(name, model, parallel, queue_max))

    def configure(self, name: str, parallel: int, queue_max: int) -> None:
        self._configure(name, MODEL, parallel, queue_max)

    def set_host(self, name: str, **state: bool) -> None:
        for fleet in self.fleets:  # one dict: both processes see the change
            fleet.mark(name, **state)
        for shared in self.states:
            self.act(functools.partial(shared.wake, name))

    def mark_down(self, name: str) -> None:
        for fleet in self.fleets:
            fleet.mark(name, healthy=False)

    def let_pass(self, seconds: float) -> None:
        self.loop.run_until_complete(asyncio.sleep(seconds))

    async def rounds(self) -> None:
        last, same = None, 0
        while same < SETTLED:
            await asyncio.sleep(POLL)
            now = (
                [(r.task.done(), r.holding) for r in self.requests],
                await self._counts(),
            )
            same = same + 1 if now == last else 0
            last = now

    async def _counts(self) -> list[tuple[str, str, int, int]]:
        snapshot = await self.states[0].slots.snapshot()
        return sorted((s.host, s.model, s.in_flight, s.queued) for s in snapshot)

    def held(self, pair: tuple[str, str]) -> int:
        counts = self.loop.run_until_complete(self._counts())
        return next((held for host, model, held, _ in counts if (host, model) == pair), 0)

    def nothing_is_held(self) -> None:
        for host, model, held, queued in self.loop.run_until_complete(self._counts()):
            assert (held, queued) == (0, 0), f"{host}/{model}: {held} held, {queued} queued"

    def close(self) -> None:
        for state in self.states:
            self.loop.run_until_complete(state.aclose())
        self.loop.close()


@pytest.fixture(scope="module")
def module_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail("this test needs redis-server (apt-get install redis-server)")
    server = RedisServer(binary, tmp_path_factory.mktemp("model-redis"))
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


def test_the_request_path_keeps_every_promise_over_shared_state(module_redis: str) -> None:
    SharedRequestPath.redis_url = module_redis
    SharedRequestPath.TestCase.settings = settings(
        max_examples=25,
        stateful_step_count=20,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
        # Real time makes a shrink of a failure take many minutes: the first one is reported.
        phases=[Phase.explicit, Phase.reuse, Phase.generate],
    )
    SharedRequestPath.TestCase().runTest()
