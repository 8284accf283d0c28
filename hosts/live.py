"""What the running gateway knows of each host right now: one typed shape, and where it comes from.

`HostLive` and `ModelLive` are the one shape of a host's live state. `routing.ops.live` builds
them from the runtime; the dashboard (as JSON, through `as_json`), the metrics collector and the
host admin read them. They live here, in the lowest layer, because `hosts` must not import
`routing`: the runtime registers a provider instead (`provide`), and the host admin asks
`host_states()`. In a process with no gateway serving (a `manage.py` shell, the test client),
there is nothing to show.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, NamedTuple

from hosts.health import HostState


class HostLoad(NamedTuple):
    """A host's requests in flight and queued, over all its models: what the dashboard's
    history samples every second (`routing.ops.live.host_loads`), without the rest of
    `HostLive`. The same names as `HostLive`'s and `ModelLive`'s counts."""

    host: str
    in_flight: int
    queued: int


@dataclass(slots=True, frozen=True)
class ModelLive:
    """One model of a host: its slots in flight against `parallel`, and its queue."""

    name: str
    in_flight: int
    parallel: int
    queued: int
    queue_max: int
    # Whether its conversations are told their slots (llama-server's `id_slot`): False once
    # the host was found emptying them between turns (a unified KV cache), None where the
    # gateway names none at all (routing/live_fleet.py `slot_naming`).
    slot_naming: bool | None = None
    # Answers that found only what they share with the conversation that used their named
    # slot last, since the process started (routing/live_fleet.py `shared_slot_lost`).
    shared_slot_lost: int = 0

    def as_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "in_flight": self.in_flight,
            "parallel": self.parallel,
            "queued": self.queued,
            "queue_max": self.queue_max,
            "slot_naming": self.slot_naming,
            "shared_slot_lost": self.shared_slot_lost,
        }


@dataclass(slots=True, frozen=True)
class HostLive:
    """One configured host as the gateway sees it at one instant.

    `since` is when the host entered `state` (wall clock, epoch seconds); None until the health
    poller or the proxy has said anything about it. `reason` says why it is down or loading.
    """

    name: str
    enabled: bool
    draining: bool
    state: HostState
    reason: str
    since: float | None
    leases: int
    models: tuple[ModelLive, ...]
    slots: int | None = None  # the host's own `total_slots`, as its /props said last
    in_a_route: bool = True  # False: configured, but no route sends it requests

    @property
    def in_flight(self) -> int:
        return sum(model.in_flight for model in self.models)

    @property
    def queued(self) -> int:
        return sum(model.queued for model in self.models)

    @property
    def since_iso(self) -> str | None:
        if self.since is None:
            return None
        return datetime.fromtimestamp(self.since, UTC).isoformat(timespec="seconds")

    def as_json(self) -> dict[str, Any]:
        """The JSON-ready form the dashboard receives; the one place this shape is serialised."""
        return {
            "name": self.name,
            "enabled": self.enabled,
            "draining": self.draining,
            "state": str(self.state),
            "reason": self.reason,
            "since": self.since_iso,
            "leases": self.leases,
            "models": [model.as_json() for model in self.models],
        }


HostStates = dict[str, HostLive]

_provider: Callable[[], HostStates] | None = None


def provide(provider: Callable[[], HostStates]) -> None:
    """Register where live host states come from (called once, at app start)."""
    global _provider
    _provider = provider


def host_states() -> HostStates:
    """{host name: HostLive}; {} without a gateway in this process or when it cannot answer."""
    if _provider is None:
        return {}
    try:
        return _provider()
    except Exception:  # the admin page must render even if the gateway is busy or stopping
        return {}
