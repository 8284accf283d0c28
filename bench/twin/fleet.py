"""Fleet placement in the twin: the product's own actor (routing/models_actor, the one the
gateway's `Runtime` builds), on the twin's seams only: the router hosts' `load`/`unload` stand
in for `POST /models/load` and `/models/unload` (`ask_host`), and the twin's poller for the
runtime's on-demand probe (`poll_now`). Everything else (the events, the snapshot, `decide`,
the loading wait of a request for a model loaded nowhere, the failures) is the product code,
so the twin judges it.

What this adds for the twin's report and tests: every decision with its virtual time (`log`),
and the most models each host held at once (`most_held`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from hosts.describe import ModelState
from routing.core.model_placement import DEFAULT_IDLE_UNLOAD, Action
from routing.models_actor.actor import ModelActor
from routing.models_actor.decisions import Decided as Said
from twin.gateway import TwinGateway
from twin.router import LimitReached, RouterHost


@dataclass(frozen=True, slots=True)
class Decided:
    """One action carried out (or an `Unplaced` said), and when (virtual seconds)."""

    at: float
    action: Action


class FleetActor:
    """The gateway's model actor placing `models` (the gateway's names, each to the name the
    hosts know it by) on `hosts`, router-mode hosts with autoload off."""

    def __init__(
        self,
        gateway: TwinGateway,
        hosts: Mapping[str, RouterHost],
        models: Mapping[str, str],
        *,
        idle_unload: float | None = DEFAULT_IDLE_UNLOAD,
    ) -> None:
        actor = gateway.runtime.models
        assert actor is not None, "the runtime's actor: in-process state"
        self.actor: ModelActor = actor
        self.gateway = gateway
        self.hosts = hosts
        self.models = models
        self.log: list[Decided] = []
        self.most_held: dict[str, int] = dict.fromkeys(hosts, 0)  # loaded or loading, at most
        actor.idle_unload = idle_unload
        actor.interval = gateway.poll_interval
        actor.ask_host = self._ask_host  # type: ignore[method-assign]  # the twin's hosts
        actor.poll_now = self._poll_now
        decided = actor.decisions.decided
        actor.decisions.decided = self._logged(decided)  # type: ignore[method-assign, assignment]
        for host in hosts.values():
            host.on_change = self._counting(host.on_change)

    def _logged(self, decided: Callable[[Action], Said]) -> Callable[[Action], Said]:
        def logged(action: Action) -> Said:
            self.log.append(Decided(self.actor.loop.time(), action))
            return decided(action)

        return logged

    def _counting(self, then: Callable[[str], None] | None) -> Callable[[str], None]:
        def changed(name: str) -> None:
            host = self.hosts[name]
            held = sum(1 for u in self.models.values() if host.state(u) is not ModelState.UNLOADED)
            self.most_held[name] = max(self.most_held[name], held)
            if then is not None:
                then(name)

        return changed

    async def _ask_host(self, name: str, upstream: str, action: str) -> str:
        host = self.hosts[name]
        try:
            if action == "load":
                host.load(upstream)
            else:
                host.unload(upstream)
        except (LimitReached, ValueError) as exc:  # the host's 400/503
            return str(exc)
        return ""

    async def _poll_now(self, name: str) -> None:
        self.gateway.poll_now(name)

    def close(self) -> None:
        """Nothing of its own to close: the runtime's actor closes with the gateway."""
