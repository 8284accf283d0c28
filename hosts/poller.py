"""The health poller: keeps the health table current for little CPU per host.

Each enabled host has a task of its own on the serving event loop. It asks `/health` every
round, and reads `/props` and `/v1/models` (`hosts.describe`) only when the host may be a new
process or the last read is old:

- the host was not up at the last poll (the gateway's first poll of it, or down or loading
  since, which includes the proxy marking it down on a failed connection): a llama-server that
  restarts answers 503 while it loads its model, or refuses while it is gone, so a restart
  shows as a change of state. Its `/props` carries nothing that tells one process from the
  next (`build_info` stays the same across a restart of the same build);
- the last read is older than `refresh` (60 s): what a restart quicker than one round could
  change (another model, `-np`) is right within a minute;
- a router (`--models-dir`) loads and unloads models without restarting, and placement reads
  their states, so its `/v1/models` is asked every round (its `/props` is not).

Why so: the poller of one `/health`, `/props` and `/v1/models` per host per round, on a new
connection each (the proxy's client runs without keep-alive), cost about 3 ms of CPU per host
per round. Now a round is one `/health` on a connection kept per host by a client that reads
the status and nothing else (hosts/health_client.py: it retries once on a fresh connection
when a kept one turns out closed, as llama-server closes a connection idle for 5 s). `/props`
and `/v1/models` go through an aiohttp session of the poller's own (one connection per host,
`limit_per_host=1`). bench/README.md has the figures (`bench/bench_poller.py`,
`bench/bench_scale.py`).

Jitter: a host's first poll comes at a random point of the first interval, and each gap
between its polls is a random 90-100% of the interval, so polls of a fleet do not arrive
together (after a restart of the gateway, or of many hosts) and, at the default 5 s, a host
is asked again before llama-server's 5 s keep-alive timeout closes the connection. Wakeups
fall on a grid of 0.25 s, so the few polls due in one such tick share a pass of the event
loop: one pass per poll cost about twice the CPU.

Runs on one event loop; `Poller` is not thread-safe. Imports nothing from `routing`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from hosts.describe import describe, with_models
from hosts.failures import failure
from hosts.health import HealthTable, HostState
from hosts.health_client import HealthClient

log = logging.getLogger("crossbar.health")

REFRESH = 60.0  # seconds between reads of /props and /v1/models of a host that stays up
JITTER = 0.1  # a gap between two polls of a host is (1 - JITTER .. 1) x the interval
TICK = 0.25  # seconds; polls wake on this grid (at most a tenth of the interval)


@dataclass(slots=True, frozen=True)
class Probe:
    """What the poller needs to know of a host."""

    name: str
    url: str
    api_key: str = ""


class Poller:
    """Polls hosts into `table`: `run()` every enabled host until cancelled, `poll()` one now.

    `interval` and `poll_timeout` in seconds; `refresh` as above, on `clock`; `rng` decides
    the jitter (a seeded one makes it repeatable). The connections open on first use, on the
    running loop; `aclose()` closes them.
    """

    def __init__(
        self,
        table: HealthTable,
        interval: float,
        poll_timeout: float,
        *,
        refresh: float = REFRESH,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.table = table
        self.interval = interval
        self.refresh = refresh
        self._timeout = aiohttp.ClientTimeout(total=poll_timeout)
        self._health = HealthClient(poll_timeout)
        self._rng = rng or random.Random()
        self._clock = clock
        self._session: aiohttp.ClientSession | None = None

    async def run(self, probes: Callable[[], list[Probe]]) -> None:
        """Poll every host `probes()` names until cancelled; `probes` is read again every
        interval (config may change): a new host starts at a random point of the interval, a
        host gone or changed (address, key) stops."""
        watching: dict[Probe, asyncio.Task[None]] = {}
        async with asyncio.TaskGroup() as group:
            while True:
                targets = dict.fromkeys(probes())
                for probe in [probe for probe in watching if probe not in targets]:
                    watching.pop(probe).cancel()
                    self._health.drop(f"{probe.url}/health")
                for probe in targets:
                    if probe not in watching:
                        first = self._rng.uniform(0, self.interval)
                        watching[probe] = group.create_task(self._watch(probe, first))
                await asyncio.sleep(self.interval)

    async def _watch(self, probe: Probe, first: float) -> None:
        await self._sleep(first)
        faulted = False
        while True:
            try:
                await self.poll(probe)
                faulted = False
            except Exception as exc:
                # `poll` words every way a host can fail; this is a fault of the gateway's own,
                # and the hosts' tasks share one group: uncaught, it would end every host's
                # polling and freeze the health table. The host is down until a poll succeeds;
                # the traceback is logged once, not every round.
                if not faulted:
                    log.exception("health poll of %s failed in the gateway", probe.name)
                faulted = True
                reason = f"/health: the gateway's poll failed ({type(exc).__name__}; see its log)"
                self.table.set(probe.name, HostState.DOWN, reason, url=probe.url)
            await self._sleep(self.interval * self._rng.uniform(1 - JITTER, 1))

    async def _sleep(self, delay: float) -> None:
        """Sleep up to `delay` seconds, to the last tick before: the polls due within one tick
        wake together, in one pass of the event loop rather than one pass each (and a gap
        never outgrows the interval, nor llama-server's keep-alive)."""
        loop = asyncio.get_running_loop()
        tick = min(TICK, self.interval / 10)
        await asyncio.sleep(max(0.0, math.floor((loop.time() + delay) / tick) * tick - loop.time()))

    async def poll(self, probe: Probe) -> None:
        """Ask one host how it is and record the answer in the table. Never raises."""
        table, name, url = self.table, probe.name, probe.url
        headers = _auth(probe.api_key)
        try:
            status = await self._health.status(f"{url}/health", headers)
        except (OSError, ValueError) as exc:  # ValueError: a URL or key HTTP cannot carry
            table.set(name, HostState.DOWN, f"/health: {failure(exc)}", url=url)
            return
        if status == 503:
            table.set(name, HostState.LOADING, "loading model", url=url)
            return
        if status != 200:
            table.set(name, HostState.DOWN, f"/health answered {status}", url=url)
            return
        known = self.table.get(name)
        now = self._clock()
        # None: the first poll, or back up (perhaps another process).
        last = known.described if known.state is HostState.UP else None
        fresh = last is None or now - known.described_at >= self.refresh
        if last is None or fresh:
            props, models = await asyncio.gather(
                self._json(f"{url}/props", headers), self._json(f"{url}/v1/models", headers)
            )
            described = describe(props, models)
        elif last.router:
            described = with_models(last, await self._json(f"{url}/v1/models", headers))
        else:
            table.set(name, HostState.UP, url=url)  # keeps what it said last
            return
        # A host without /v1/models just loses the "loaded" preference.
        loaded = described.loaded if described.models else None
        table.set(
            name,
            HostState.UP,
            loaded=loaded,
            url=url,
            described=described,
            described_at=now if fresh else None,
        )

    async def _get(self, url: str, headers: dict[str, str]) -> tuple[int, bytes]:
        if self._session is None:
            # One connection per host: /props and /v1/models one after the other on it, and a
            # router's /v1/models each round. No environment proxy: as for the proxy's client.
            connector = aiohttp.TCPConnector(
                limit=0, limit_per_host=1, keepalive_timeout=self.interval * 2
            )
            self._session = aiohttp.ClientSession(connector=connector, timeout=self._timeout)
        async with self._session.get(url, headers=headers) as response:
            return response.status, await response.read()

    async def _json(self, url: str, headers: dict[str, str]) -> object:
        """A GET's JSON answer; None for any failure (health said up: this is extra)."""
        try:
            status, body = await self._get(url, headers)
            return json.loads(body) if status == 200 else None
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return None

    async def aclose(self) -> None:
        await self._health.aclose()
        if self._session is not None:
            await self._session.close()
            self._session = None


def _auth(api_key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}
