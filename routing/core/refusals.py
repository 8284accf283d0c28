"""What a refusal tells the client and the operator: what, where, and what to do.

A request placement cannot serve is refused with a stable `code` (`routing.core.errors`); the
functions here give that refusal its words and its facts: the route, the model, each host
concerned and its state (down since when and why, loading, draining, disabled, full with its
in_flight/parallel and queued/queue_max), the route's models for a model it does not serve, and
`Retry-After` only where waiting helps (a host that is down or loading comes back by itself;
one an operator drained or disabled does not).

They run only when a request is refused, never on the way of one that is served: the runtime
reads the hosts' `Standing`s then (`routing.ops.live.standings`). Pure: standard library only.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from routing.core.errors import (
    ModelNotLoaded,
    NoHealthyHost,
    PinnedHostDown,
    QueueFull,
    UnknownModel,
)

__all__ = [
    "Standing",
    "model_not_loaded",
    "no_healthy_host",
    "pinned_host_down",
    "queue_full",
    "unknown_model",
]

SHOWN = 10  # hosts (and 2x models) named in a message; the JSON detail lists them all
# States a host leaves without an operator.
_COMES_BACK = ("down", "loading", "model_loading")


@dataclass(slots=True, frozen=True)
class Standing:
    """One host as a refusal shows it: its health, the operator's switches, its counts for
    the model asked (`parallel` 0: the host does not serve it)."""

    host: str
    health: str  # the health table's state: up, down, loading, unknown (not polled yet)
    since: float  # wall clock (time.time) when the health state began
    reason: str = ""  # what the last poll or failed connection said
    enabled: bool = True
    draining: bool = False
    in_flight: int = 0
    parallel: int = 0
    queued: int = 0
    queue_max: int = 0
    # The model asked where the host loads none on demand and has not loaded it: "unloaded",
    # or "loading" (a load under way there); "" otherwise.
    not_loaded: str = ""

    @property
    def state(self) -> str:
        """Why the host takes no new request, the first that applies: disabled, draining,
        down, loading; the model asked unloaded or loading there (`not_loaded`, states
        "unloaded" and "model_loading"); else full (slots and queue), else up."""
        if not self.enabled:
            return "disabled"
        if self.draining:
            return "draining"
        if self.health in ("down", "loading"):
            return self.health
        if self.not_loaded:
            return "unloaded" if self.not_loaded == "unloaded" else "model_loading"
        if self.in_flight >= self.parallel and self.queued >= self.queue_max:
            return "full"
        return "up"

    def describe(self) -> str:
        """The host in a few words, e.g. `gpu1 full (4/4 running, 8/8 queued)`."""
        state = self.state
        if state == "down":
            return f"{self.host} down since {_clock(self.since)} ({self.reason or 'no answer'})"
        if state == "loading":
            return f"{self.host} loading its model since {_clock(self.since)}"
        if state == "draining":
            return f"{self.host} draining (health {self.health}; takes no new requests)"
        if state == "disabled":
            return f"{self.host} disabled"
        if state == "unloaded":
            return f"{self.host} has it unloaded and loads no model on demand"
        if state == "model_loading":
            return f"{self.host} is loading it (it serves the model once the load ends)"
        return f"{self.host} {state} ({self._counts()})"

    def as_json(self) -> dict[str, object]:
        return {
            "name": self.host,
            "state": self.state,
            "health": self.health,
            "since": datetime.fromtimestamp(self.since, UTC).isoformat(timespec="seconds"),
            "reason": self.reason,
            "running": self.in_flight,  # the refusal's word for it, as its message says
            "parallel": self.parallel,
            "queued": self.queued,
            "queue_max": self.queue_max,
        }

    def _counts(self) -> str:
        return f"{self.in_flight}/{self.parallel} running, {self.queued}/{self.queue_max} queued"


def queue_full(route: str, model: str, hosts: Sequence[Standing]) -> QueueFull:
    """Every usable host of `route` for `model` (`hosts`, in the order tried) is full."""
    message = (
        f"queue full: every usable host of route “{route}” for model “{model}” is busy and "
        f"its queue is full: {_listed(hosts)}. Retry after {QueueFull.retry_after} s; if "
        "this is frequent, give these hosts more slots (parallel) or queue places "
        "(queue_max), or add a host to the route"
    )
    detail = _detail(route, model, hosts)
    return QueueFull([standing.host for standing in hosts], model, message, detail=detail)


def no_healthy_host(route: str, model: str | None, hosts: Sequence[Standing]) -> NoHealthyHost:
    """No host of `route` may take a request for `model` (None: a request naming none);
    `hosts` are those that would serve it. Retry-After only while one may come back alone."""
    wanted = f" for model “{model}”" if model else ""
    if not hosts:
        facts, advice = "it has no host serving it", "add one in the admin"
    else:
        facts, advice = _listed(hosts), _advice(hosts)
    refusal = NoHealthyHost(
        f"no healthy host: route “{route}” has no host that can take a request{wanted} now: "
        f"{facts}. {advice}",
        detail=_detail(route, model, hosts),
    )
    if not _comes_back(hosts):
        refusal.retry_after = None  # waiting alone will not help
    return refusal


def model_not_loaded(route: str, model: str, hosts: Sequence[Standing]) -> ModelNotLoaded:
    """No host of `route` has `model` loaded, and those up (`hosts` are those that
    would serve it) load no model on demand: only an operator's load serves it."""
    if _comes_back(hosts):
        advice = f"Retry after {NoHealthyHost.retry_after} s: a host may serve it by then"
    else:
        advice = (
            "An operator can load it from the admin (Hosts: select the host, then “Load the "
            "selected router-mode hosts' models”); to have it loaded on demand, start the host "
            "without --no-models-autoload"
        )
    refusal = ModelNotLoaded(
        f"model not loaded: route “{route}” has no host with model “{model}” loaded, and its "
        f"hosts load no model on demand: {_listed(hosts)}. {advice}",
        detail=_detail(route, model, hosts),
    )
    if _comes_back(hosts):
        refusal.retry_after = NoHealthyHost.retry_after  # a load under way, or a host back
    return refusal


def pinned_host_down(route: str, model: str, host: Standing) -> PinnedHostDown:
    """A `sticky = strict` route's conversation is leased to `host`, which cannot take it."""
    wait = f"retry after {PinnedHostDown.retry_after} s, or " if _comes_back([host]) else ""
    refusal = PinnedHostDown(
        host.host,
        f"pinned host down: route “{route}” keeps each conversation on its host (sticky = "
        f"strict), and this one's host is {host.describe()}. To go on, {wait}start a new "
        "conversation (another X-Crossbar-Session)",
        detail=_detail(route, model, [host]),
    )
    if not wait:
        refusal.retry_after = None
    return refusal


def unknown_model(route: str, model: str, served: Sequence[str]) -> UnknownModel:
    """`route` serves no `model`; `served` are the models it does serve."""
    names = sorted(served)
    shown = ", ".join(names[: 2 * SHOWN])
    more = f" and {len(names) - 2 * SHOWN} more" if len(names) > 2 * SHOWN else ""
    serves = f"it serves {shown}{more}" if names else "it serves no model now"
    return UnknownModel(
        f"model “{model}” is not served by route “{route}”: {serves} "
        f"(GET /{route}/v1/models lists them)",
        detail={"param": "model", "route": route, "model": model, "models": names},
    )


def _listed(hosts: Sequence[Standing]) -> str:
    text = "; ".join(standing.describe() for standing in hosts[:SHOWN])
    if len(hosts) > SHOWN:
        text += f"; and {len(hosts) - SHOWN} more"
    return text


def _advice(hosts: Sequence[Standing]) -> str:
    if _comes_back(hosts):
        return (
            f"Retry after {NoHealthyHost.retry_after} s: a host serves again as soon as its "
            "health check passes"
        )
    states = {standing.state for standing in hosts}
    if "draining" in states:
        return "Stop draining a host (the admin's Hosts page, or the dashboard) to serve again"
    return "Enable a host of the route in the admin to serve again"


def _comes_back(hosts: Sequence[Standing]) -> bool:
    return any(standing.state in _COMES_BACK for standing in hosts)


def _detail(route: str, model: str | None, hosts: Sequence[Standing]) -> dict[str, object]:
    return {
        "route": route,
        "model": model,
        "hosts": [standing.as_json() for standing in hosts],
    }


def _clock(moment: float) -> str:
    return time.strftime("%H:%M:%S UTC", time.gmtime(moment))
