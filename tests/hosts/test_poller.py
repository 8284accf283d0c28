"""The health poller asks `/health` every round and `/props` and `/v1/models` only when a host
may be a new process, on one kept connection per host, its polls spread over the interval.

Rounds are driven one `poll()` at a time, so nothing here waits on the clock; the refresh
period runs on an injected clock, the jitter on an injected random.
"""

from __future__ import annotations

import asyncio
import functools
import random
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from hosts.describe import ModelState
from hosts.health import HealthTable, HostState
from hosts.poller import Poller, Probe
from tests.fakes.llama_server import FakeLlamaServer

DESCRIBE = ["/props", "/v1/models"]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
async def poller(clock: Clock) -> AsyncIterator[Poller]:
    poller = Poller(HealthTable(), interval=5.0, poll_timeout=2.0, clock=clock)
    yield poller
    await poller.aclose()


async def round_of(poller: Poller, fake: FakeLlamaServer, name: str = "gpu1") -> list[str]:
    """One poll of the host (the table's only one); the paths it was asked, sorted (/props and
    /v1/models go together)."""
    poller.table.track({name: fake.url})
    before = len(fake.seen)
    await poller.poll(Probe(name, fake.url))
    return sorted(seen.route for seen in fake.seen[before:])


async def test_a_host_is_asked_health_every_round_and_props_and_models_only_on_the_first(
    poller: Poller, fake: FakeLlamaServer
) -> None:
    rounds = [await round_of(poller, fake) for _ in range(4)]

    assert rounds == [["/health", *DESCRIBE], ["/health"], ["/health"], ["/health"]]
    health = poller.table.get("gpu1")
    assert health.state is HostState.UP
    assert health.loaded == frozenset({"test-model"})  # what the first round read is kept
    assert health.described is not None and health.described.slots == 4


@pytest.mark.parametrize("away", ["loading", "error"])
async def test_a_host_back_up_after_loading_or_down_is_read_again(
    poller: Poller, fake: FakeLlamaServer, away: str
) -> None:
    await round_of(poller, fake)
    fake.health = away
    while_away = await round_of(poller, fake)
    fake.health = "ok"
    fake.models = ("other-model",)  # a new process may serve another model

    back = await round_of(poller, fake)
    after = await round_of(poller, fake)

    assert while_away == ["/health"]
    assert back == ["/health", *DESCRIBE]
    assert after == ["/health"]
    assert poller.table.get("gpu1").loaded == frozenset({"other-model"})


async def test_a_host_the_proxy_marked_down_is_read_again_when_its_health_is_good(
    poller: Poller, fake: FakeLlamaServer
) -> None:
    await round_of(poller, fake)
    poller.table.mark_down("gpu1", "connection refused")

    assert await round_of(poller, fake) == ["/health", *DESCRIBE]
    assert poller.table.get("gpu1").state is HostState.UP


async def test_a_host_that_stays_up_is_read_again_once_the_refresh_period_has_passed(
    poller: Poller, fake: FakeLlamaServer, clock: Clock
) -> None:
    await round_of(poller, fake)
    clock.now += 59
    before_refresh = await round_of(poller, fake)
    clock.now += 1
    at_refresh = await round_of(poller, fake)
    clock.now += 5
    after_refresh = await round_of(poller, fake)

    assert before_refresh == ["/health"]
    assert at_refresh == ["/health", *DESCRIBE]
    assert after_refresh == ["/health"]


async def test_a_router_is_asked_its_models_every_round_and_its_props_only_on_the_first(
    poller: Poller,
) -> None:
    with FakeLlamaServer(router_models=("small", "large"), models_max=1) as router:
        rounds = [await round_of(poller, router) for _ in range(3)]
        loading = await asyncio.to_thread(
            httpx.post, f"{router.url}/models/load", json={"model": "small"}
        )
        after_load = await round_of(poller, router)

    assert rounds == [["/health", *DESCRIBE], ["/health", "/v1/models"], ["/health", "/v1/models"]]
    assert loading.status_code == 200
    assert after_load == ["/health", "/v1/models"]
    described = poller.table.get("gpu1").described
    assert described is not None and described.router and described.max_models == 1
    assert described.autoload is True
    assert described.models["small"] in (ModelState.LOADING, ModelState.LOADED)


async def test_a_router_started_without_autoload_is_read_as_loading_no_model_on_demand(
    poller: Poller,
) -> None:
    with FakeLlamaServer(router_models=("small",), models_autoload=False) as router:
        await round_of(poller, router)

    described = poller.table.get("gpu1").described
    assert described is not None and described.router and described.autoload is False


async def test_a_host_whose_turn_comes_later_in_the_interval_is_not_asked_with_the_first(
    fake: FakeLlamaServer, fake2: FakeLlamaServer
) -> None:
    class Turns(random.Random):
        """gpu1's first poll at once, gpu2's half an interval later; gaps the whole interval."""

        def __init__(self) -> None:
            super().__init__(0)
            self.firsts = iter([0.0, 1800.0])

        def uniform(self, a: float, b: float) -> float:
            return next(self.firsts) if a == 0 else b

    class Table(HealthTable):
        """Sets `described` once the poller records what a host said of itself."""

        def __init__(self) -> None:
            super().__init__()
            self.described = asyncio.Event()

        def set(self, *args: Any, **kwargs: Any) -> None:
            super().set(*args, **kwargs)
            if kwargs.get("described") is not None:
                self.described.set()

    table = Table()
    poller = Poller(table, interval=3600.0, poll_timeout=2.0, rng=Turns())
    probes = [Probe("gpu1", fake.url), Probe("gpu2", fake2.url)]
    table.track({probe.name: probe.url for probe in probes})
    running = asyncio.create_task(poller.run(lambda: probes))
    try:
        await asyncio.wait_for(table.described.wait(), 10)
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
        await poller.aclose()

    assert sorted(seen.route for seen in fake.seen) == ["/health", *DESCRIBE]
    assert fake2.seen == []


def test_a_seeded_fleet_of_200_has_its_first_polls_spread_over_the_interval() -> None:
    class Drawn(random.Random):
        def __init__(self) -> None:
            super().__init__(7)
            self.drawn: list[float] = []

        def uniform(self, a: float, b: float) -> float:
            self.drawn.append(value := super().uniform(a, b))
            return value

    async def first_offsets() -> list[float]:
        rng = Drawn()
        poller = Poller(HealthTable(), interval=5.0, poll_timeout=2.0, rng=rng)
        # Addresses nobody polls in time: every first poll is at least a little way off.
        probes = [Probe(f"gpu{i}", f"http://127.0.0.1:9/{i}") for i in range(200)]
        running = asyncio.create_task(poller.run(lambda: probes))
        await asyncio.sleep(0)
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
        await poller.aclose()
        return rng.drawn

    offsets = asyncio.run(first_offsets())

    assert len(offsets) == 200 and all(0 <= offset <= 5.0 for offset in offsets)
    per_second = Counter(int(offset) for offset in offsets)
    # 40 a second on average; no second holds half again as many as that.
    assert sorted(per_second) == [0, 1, 2, 3, 4]
    assert max(per_second.values()) < 60


async def test_each_host_is_polled_on_one_connection_kept_across_rounds(
    poller: Poller,
) -> None:
    async with CountingHosts(2) as hosts:
        poller.table.track({f"gpu{i}": url for i, url in enumerate(hosts.urls)})
        for _ in range(5):
            for i, url in enumerate(hosts.urls):
                await poller.poll(Probe(f"gpu{i}", url))
        assert poller.table.get("gpu0").state is HostState.UP

    # Per host: 5 /health on the one kept connection; 1 /props and 1 /v1/models, one after
    # the other, on the describing session's.
    assert hosts.requests == [7, 7]
    assert hosts.connections == [2, 2]


class CountingHosts:
    """`n` minimal llama-servers that count the connections and requests each accepts."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.connections = [0] * n
        self.requests = [0] * n
        self.urls: list[str] = []
        self._servers: list[asyncio.Server] = []

    async def __aenter__(self) -> CountingHosts:
        for i in range(self.n):
            server = await asyncio.start_server(functools.partial(self._serve, i), "127.0.0.1", 0)
            self._servers.append(server)
            self.urls.append(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
        return self

    async def __aexit__(self, *exc: object) -> None:
        for server in self._servers:
            server.close()

    async def _serve(
        self, i: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self.connections[i] += 1
        try:
            while head := await reader.readuntil(b"\r\n\r\n"):
                self.requests[i] += 1
                path = head.split(b" ", 2)[1]
                body = {
                    b"/health": b'{"status":"ok"}',
                    b"/props": b'{"total_slots":2}',
                    b"/v1/models": b'{"data":[{"id":"m"}]}',
                }[path]
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n%b" % (len(body), body)
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


async def test_a_poll_that_fails_in_the_gateway_marks_its_host_down_and_the_others_go_on(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, fake: FakeLlamaServer
) -> None:
    from hosts.health_client import HealthClient

    async with CountingHosts(1) as broken:
        status = HealthClient.status

        faults = 0

        async def failing(client: HealthClient, url: str, headers: Any) -> int:
            nonlocal faults
            if url.startswith(broken.urls[0]):
                faults += 1
                raise RuntimeError("a fault of the gateway's own")
            return await status(client, url, headers)

        monkeypatch.setattr(HealthClient, "status", failing)
        poller = Poller(HealthTable(), interval=0.5, poll_timeout=2.0)
        probes = [Probe("gpu1", broken.urls[0]), Probe("gpu2", fake.url)]
        poller.table.track({probe.name: probe.url for probe in probes})
        running = asyncio.create_task(poller.run(lambda: probes))
        try:
            for _ in range(200):  # until the fault came twice (polling went on) and gpu2 is up
                if faults >= 2 and poller.table.get("gpu2").state is HostState.UP:
                    break
                await asyncio.sleep(0.05)
            assert faults >= 2
            assert not running.done()
            assert poller.table.get("gpu2").state is HostState.UP
            down = poller.table.get("gpu1")
            assert down.state is HostState.DOWN
            assert down.reason == "/health: the gateway's poll failed (RuntimeError; see its log)"
            logged = [r for r in caplog.records if r.getMessage().startswith("health poll of gpu1")]
            assert len(logged) == 1 and logged[0].exc_info is not None  # once, with its traceback
        finally:
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)
            await poller.aclose()
