"""Fleet placement's actor in the twin: it builds a `model_placement.Snapshot` from what the
gateway knows, calls `decide`, and carries out its loads and unloads through the router hosts'
own `load`/`unload` (`POST /models/load` and `/models/unload`).

Driven by events, never by polling: a request for a model loaded nowhere, a request that finds
its model's line not empty (a line that grows), a model's state changing on a host (a load
begun or ended, an unload), the next `idle_unload` deadline; and, while a model needs a load it
cannot have (`Unplaced`: residency, swap budget), one more try a poll interval later.

What it reads:

- per model: requests waiting (in crossbar's lines, `state.queued`, and held here for a load)
  and running (`state.in_flight`), and the arrivals of the last minute (counted as they come);
- per (host, model): the router host's state, its last use, the load's seconds from the preset;
  when its state began (seen here as it changes);
- per host: its room (`models_max`, `memory_gb`, the models' `size_gb`, from the preset), and
  the loads this actor began there.

What crossbar does now and the actor relies on: a router host with autoload off (its /props
says `models_autoload: false`) is never sent a model it has not loaded, so a request for a
model loaded somewhere waits in the lines of its loaded hosts (a line the decision sees grow),
and one for a model loaded nowhere would be refused with `model_not_loaded`. The actor holds
such a request (`hold`, which the gateway awaits before placing, so the wait is in its TTFB:
the issue's `loading` wait status, not in crossbar yet) until a load of its model has ended,
and tells the gateway at once of each change it makes (`poll_now`), as the product actor,
which knows what it loaded and unloaded, must.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from hosts.describe import ModelState
from routing.core.model_placement import (
    DEFAULT_IDLE_UNLOAD,
    Action,
    Demand,
    Host,
    Model,
    ModelOnHost,
    ModelRules,
    Snapshot,
    Status,
    Unload,
    Unplaced,
    decide,
)
from twin.gateway import TwinGateway
from twin.router import LimitReached, RouterHost

RATE_WINDOW = 60.0  # seconds of arrivals a model's rate is counted over

STATUS = {
    ModelState.LOADED: Status.LOADED,
    ModelState.LOADING: Status.LOADING,
    ModelState.UNLOADED: Status.UNLOADED,
    ModelState.FAILED: Status.FAILED,
}


@dataclass(frozen=True, slots=True)
class Decided:
    """One action carried out (or an `Unplaced` said), and when."""

    at: float
    action: Action


class FleetActor:
    """Places `models` (the gateway's names, each to the name the hosts know it by) on
    `hosts`, router-mode hosts with autoload off, for `gateway`."""

    def __init__(
        self,
        gateway: TwinGateway,
        hosts: Mapping[str, RouterHost],
        models: Mapping[str, str],
        *,
        idle_unload: float | None = DEFAULT_IDLE_UNLOAD,
    ) -> None:
        self.gateway = gateway
        self.hosts = hosts
        self.models = models
        self.idle_unload = idle_unload
        self.loop = asyncio.get_running_loop()
        self.log: list[Decided] = []
        self.most_held: dict[str, int] = dict.fromkeys(hosts, 0)  # loaded or loading, at most
        self._arrivals: dict[str, deque[float]] = {model: deque() for model in models}
        self._held: defaultdict[str, int] = defaultdict(int)  # requests held for a load
        self._ready: dict[str, asyncio.Future[None]] = {}  # what held requests await
        self._seen: dict[tuple[str, str], tuple[ModelState, float]] = {}
        self._loads: dict[str, list[float]] = {name: [] for name in hosts}
        self._pending: asyncio.Handle | None = None
        self._timer: asyncio.TimerHandle | None = None
        for name, host in hosts.items():
            for upstream in models.values():
                self._seen[name, upstream] = (host.state(upstream), self.loop.time())
            then = host.on_change
            host.on_change = self._chained(then)
        gateway.hold = self.hold

    def _chained(self, then: Callable[[str], None] | None) -> Callable[[str], None]:
        def changed(name: str) -> None:
            if then is not None:
                then(name)
            self._changed(name)

        return changed

    # -- events -----------------------------------------------------------------------------

    async def hold(self, model: str) -> None:
        """A request for `model` arrives: counted; held until a load of it ends when the
        gateway knows it loaded nowhere."""
        arrivals = self._arrivals[model]
        arrivals.append(self.loop.time())
        if self.gateway.loaded_on(model):
            if self._waiting(model):
                self.poke()  # its line grows
            return
        self._held[model] += 1
        self.poke()
        ready = self._ready.get(model)
        if ready is None:
            ready = self._ready[model] = self.loop.create_future()
        try:
            await ready
        finally:
            self._held[model] -= 1

    def _changed(self, name: str) -> None:
        """A model's state changed on host `name`: the gateway is told at once; a held request
        goes on when its model is loaded; then decide again."""
        now = self.loop.time()
        host = self.hosts[name]
        for upstream in self.models.values():
            state = host.state(upstream)
            if self._seen[name, upstream][0] is not state:
                self._seen[name, upstream] = (state, now)
        held = sum(1 for u in self.models.values() if host.state(u) is not ModelState.UNLOADED)
        self.most_held[name] = max(self.most_held[name], held)
        self.gateway.poll_now(name)
        for model, ready in list(self._ready.items()):
            if self.gateway.loaded_on(model):
                del self._ready[model]
                ready.set_result(None)
        self.poke()

    def poke(self) -> None:
        """Decide again soon (once, however many events come before)."""
        if self._pending is None:
            self._pending = self.loop.call_soon(self._decide)

    # -- the decision, carried out ----------------------------------------------------------

    def _decide(self) -> None:
        self._pending = None
        now = self.loop.time()
        unplaced = False
        for action in decide(self.snapshot(now), now):
            self.log.append(Decided(now, action))
            if isinstance(action, Unplaced):
                unplaced = True
                continue
            host = self.hosts[action.host]
            upstream = self.models[action.model]
            if isinstance(action, Unload):
                host.unload(upstream)
                continue
            try:
                host.load(upstream)
            except (LimitReached, ValueError):
                continue  # the host disagrees; the next event decides again
            self._loads[action.host].append(now)
        self._set_timer(now, unplaced)

    def _set_timer(self, now: float, unplaced: bool) -> None:
        """The next decision without an event: the next idle_unload deadline, or a poll
        interval from now while a model waits for a load it could not have."""
        deadlines = []
        if self.idle_unload is not None:
            for (name, upstream), (state, _) in self._seen.items():
                if state is ModelState.LOADED:
                    at = self.hosts[name].last_used(upstream) + self.idle_unload
                    # Past it and still loaded: busy, or within its residency; not every instant.
                    deadlines.append(at if at > now else now + self.gateway.poll_interval)
        if unplaced:
            deadlines.append(now + self.gateway.poll_interval)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if deadlines:
            self._timer = self.loop.call_at(min(deadlines), self.poke)

    def close(self) -> None:
        for handle in (self._pending, self._timer):
            if handle is not None:
                handle.cancel()

    # -- what the gateway knows, as a snapshot ----------------------------------------------

    def snapshot(self, now: float) -> Snapshot:
        state = self.gateway.runtime.state
        preset = next(iter(self.hosts.values())).profile
        rules = ModelRules(idle_unload=self.idle_unload)
        models: dict[str, Model] = {}
        pairs: dict[tuple[str, str], ModelOnHost] = {}
        for model, upstream in self.models.items():
            arrivals = self._arrivals[model]
            while arrivals and arrivals[0] <= now - RATE_WINDOW:
                arrivals.popleft()
            demand = Demand(
                rate=len(arrivals) / RATE_WINDOW,
                waiting=self._waiting(model),
                running=sum(state.in_flight(name, model) for name in self.hosts),
            )
            models[model] = Model(demand, rules, size_gb=preset.models[upstream].size_gb)
            for name, host in self.hosts.items():
                seen, since = self._seen[name, upstream]
                pairs[name, model] = ModelOnHost(
                    status=STATUS[seen], since=since, last_used=host.last_used(upstream),
                    running=state.in_flight(name, model), waiting=state.queued(name, model),
                    slots=host.profile.slots, load_s=host.profile.models[upstream].load_s,
                )  # fmt: skip
        hosts = {
            name: Host(
                models_max=host.profile.models_max,
                memory_gb=host.profile.memory_gb,
                recent_loads=tuple(t for t in self._loads[name] if now - t < RATE_WINDOW),
            )  # fmt: skip
            for name, host in self.hosts.items()
        }
        return Snapshot(hosts, models, pairs)

    def _waiting(self, model: str) -> int:
        state = self.gateway.runtime.state
        return self._held[model] + sum(state.queued(name, model) for name in self.hosts)
