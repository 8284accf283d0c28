"""Host health: a table of what each host last said.

The poller (`hosts.poller`) writes it: `/health` (200 up, 503 loading, anything else down),
and what `/props` and `/v1/models` said (its slots, its models and which are loaded, which
feeds the chooser's preference for hosts that need no model load: `hosts.describe`). The proxy
marks a host down at once when a connection to it fails; the next good poll brings it back.

Everything here runs on one event loop and imports nothing from `routing`.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from hosts.describe import Described

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
    described_at: float = 0.0  # the poller's clock (monotonic) at the /props read behind it


class HealthTable:
    """The last known health of every host, by name.

    `on_eligible(host)` is called, synchronously, whenever a host that could not take new work
    becomes eligible again (back up, or forgotten after its address changed); `on_change(host)`
    whenever what ranks it changes: its state, the models it has loaded or its description.
    """

    def __init__(
        self,
        on_eligible: Callable[[str], None] | None = None,
        on_change: Callable[[str], None] | None = None,
    ) -> None:
        self._hosts: dict[str, HostHealth] = {}
        self._urls: dict[str, str] = {}
        self._on_eligible = on_eligible
        self._on_change = on_change

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
            self._changed(name)
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
        described_at: float | None = None,
    ) -> None:
        """Record what a host said; an answer from an address it no longer has is ignored.

        A change of state starts a new record, so a host that was not up has no `described`
        until it is read again."""
        if url is not None and self._urls.get(host) != url:
            return
        current = self._hosts.get(host)
        was_eligible = self.eligible(host)
        changed = current is None or current.state != state
        if current is None or changed:
            if current is not None:
                level = logging.WARNING if state == HostState.DOWN else logging.INFO
                log.log(level, "host=%s state=%s reason=%s", host, state, reason or "-")
            current = HostHealth(state=state, reason=reason)
            self._hosts[host] = current
        current.reason = reason
        if (loaded is not None or state != HostState.UP) and current.loaded != loaded:
            current.loaded = loaded
            changed = True
        if described is not None and described != current.described:
            current.described = described
            changed = True
        if described_at is not None:
            current.described_at = described_at
        if changed:
            self._changed(host)
        if not was_eligible and self.eligible(host):
            self._became_eligible(host)

    def _changed(self, host: str) -> None:
        if self._on_change is not None:
            self._on_change(host)

    def _became_eligible(self, host: str) -> None:
        if self._on_eligible is not None:
            self._on_eligible(host)

    def mark_down(self, host: str, reason: str) -> None:
        self.set(host, HostState.DOWN, reason)

    def snapshot(self) -> dict[str, HostHealth]:
        return dict(self._hosts)
