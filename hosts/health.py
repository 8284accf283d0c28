"""Host health: a table of what each host last said, and the poller that keeps it current.

The poller is a task on the serving event loop. Every interval it asks each enabled host for
`/health` (200 up, 503 loading, anything else down), then `/props` and `/v1/models` (its slots,
its models and which are loaded, which feeds the chooser's preference for hosts that need no
model load: `hosts.describe`). The proxy marks a host down at once when a connection to it
fails; the next good poll brings it back.

Everything here runs on one event loop and imports nothing from `routing`.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from hosts.describe import Described, describe

log = logging.getLogger("crossbar.health")


class HostState(enum.StrEnum):
    UNKNOWN = "unknown"  # not polled yet: eligible, so a fresh gateway serves at once
    UP = "up"
    LOADING = "loading"
    DOWN = "down"


@dataclass(slots=True)
class HostHealth:
    state: HostState = HostState.UNKNOWN
    reason: str = ""
    since: float = field(default_factory=time.time)  # wall clock, for people
    loaded: frozenset[str] | None = None  # None: the host did not say
    described: Described | None = None  # what its /props and /v1/models said last


@dataclass(slots=True, frozen=True)
class Probe:
    """What the poller needs to know of a host."""

    name: str
    url: str
    api_key: str = ""


class HealthTable:
    """The last known health of every host, by name.

    `on_eligible(host)` is called, synchronously, whenever a host that could not take new work
    becomes eligible again (back up, or forgotten after its address changed).
    """

    def __init__(self, on_eligible: Callable[[str], None] | None = None) -> None:
        self._hosts: dict[str, HostHealth] = {}
        self._urls: dict[str, str] = {}
        self._on_eligible = on_eligible

    def track(self, hosts: dict[str, str]) -> None:
        """Set the hosts to keep health for ({name: url}).

        A host whose address changed starts afresh, and a poll answer from its old address
        (in flight while the change landed) is ignored.
        """
        forgotten = [name for name in self._hosts if hosts.get(name) != self._urls.get(name)]
        for name in forgotten:
            del self._hosts[name]
        self._urls = dict(hosts)
        for name in forgotten:
            self._became_eligible(name)

    def get(self, host: str) -> HostHealth:
        return self._hosts.get(host) or HostHealth()

    def eligible(self, host: str) -> bool:
        """Whether new work may go to the host (up, or not polled yet)."""
        health = self._hosts.get(host)
        return health is None or health.state in (HostState.UP, HostState.UNKNOWN)

    def set(
        self,
        host: str,
        state: HostState,
        reason: str = "",
        loaded: frozenset[str] | None = None,
        url: str | None = None,
        described: Described | None = None,
    ) -> None:
        """Record what a host said; an answer from an address it no longer has is ignored."""
        if url is not None and self._urls.get(host) != url:
            return
        current = self._hosts.get(host)
        was_eligible = self.eligible(host)
        if current is None or current.state != state:
            if current is not None:
                level = logging.WARNING if state == HostState.DOWN else logging.INFO
                log.log(level, "host=%s state=%s reason=%s", host, state, reason or "-")
            current = HostHealth(state=state, reason=reason)
            self._hosts[host] = current
        current.reason = reason
        if loaded is not None or state != HostState.UP:
            current.loaded = loaded
        if described is not None:
            current.described = described
        if not was_eligible and self.eligible(host):
            self._became_eligible(host)

    def _became_eligible(self, host: str) -> None:
        if self._on_eligible is not None:
            self._on_eligible(host)

    def mark_down(self, host: str, reason: str) -> None:
        self.set(host, HostState.DOWN, reason)

    def snapshot(self) -> dict[str, HostHealth]:
        return dict(self._hosts)


def _auth(api_key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def poll_once(
    client: httpx.AsyncClient, probe: Probe, table: HealthTable, poll_timeout: float
) -> None:
    """Ask one host how it is and record the answer. Never raises."""
    headers = _auth(probe.api_key)
    try:
        response = await client.get(f"{probe.url}/health", headers=headers, timeout=poll_timeout)
    except httpx.HTTPError as exc:
        reason = f"/health: {type(exc).__name__}: {exc}".strip(": ")
        table.set(probe.name, HostState.DOWN, reason, url=probe.url)
        return
    if response.status_code == 503:
        table.set(probe.name, HostState.LOADING, "loading model", url=probe.url)
        return
    if response.status_code != 200:
        reason = f"/health answered {response.status_code}"
        table.set(probe.name, HostState.DOWN, reason, url=probe.url)
        return
    props, models = await asyncio.gather(
        _json(client, f"{probe.url}/props", headers, poll_timeout),
        _json(client, f"{probe.url}/v1/models", headers, poll_timeout),
    )
    described = describe(props, models)
    # A host without /v1/models just loses the "loaded" preference.
    loaded = described.loaded if described.models else None
    table.set(probe.name, HostState.UP, "", loaded, url=probe.url, described=described)


async def _json(
    client: httpx.AsyncClient, url: str, headers: dict[str, str], wait: float
) -> object:
    """A GET's JSON answer within `wait` seconds; None for any failure (health said up: this
    is extra)."""
    try:
        response = await client.get(url, headers=headers, timeout=wait)
        return response.json() if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


async def poll_forever(
    client: httpx.AsyncClient,
    probes: Callable[[], list[Probe]],  # read fresh every round: config may change
    table: HealthTable,
    interval: float,
    poll_timeout: float,
) -> None:
    """Poll every host every `interval` seconds until cancelled."""
    while True:
        targets = probes()
        if targets:
            await asyncio.gather(*(poll_once(client, p, table, poll_timeout) for p in targets))
        await asyncio.sleep(interval)
