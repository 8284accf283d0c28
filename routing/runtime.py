"""The gateway's live state: the fleet as configured, and the fleet state (slots, lines,
leases), health table and upstream client that serve it.

The fleet state is this process's own (`LocalState`: a `Limiter` and a `LeaseTable`), or,
with `CROSSBAR_REDIS_URL`, shared by every gateway process through Redis (`SharedState`,
routing/shared; docs/replicas.md). Placement and the proxy use either the same way.

There is one `Runtime` per event loop (in production: daphne's one loop; in tests: each test's
loop), built lazily from the database on first use. Configuration changes reach it two ways:
this process's signals bump a generation that `refresh()` compares on every request (admin edits
apply to the next request), and a watcher task polls the shared `ConfigRevision` row for changes
made by other processes. A reload swaps in a new immutable `Fleet` and reconfigures the limiter
in place, so in-flight slots, queues and the leases of hosts that still exist survive it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import weakref

from asgiref.sync import sync_to_async
from django.conf import settings

from hosts.describe import ModelState
from hosts.health import HealthTable, HostHealth
from hosts.poller import Poller, Probe
from routing import signals
from routing.config.reader import current_revision, load_fleet
from routing.config.shape import Fleet, HostConfig, RouteConfig
from routing.core.choose import Candidate
from routing.core.clients import Admitted, ClientGate, ClientSpec
from routing.core.leases import LeaseTable
from routing.core.limiter import Limiter
from routing.core.patience import Figures
from routing.core.prefixes import PrefixIndex
from routing.core.ranking import Ranking, Rankings
from routing.core.running import RunningTable
from routing.core.state import FleetState, LocalState
from routing.shared.fleet_state import SharedState
from routing.upstream_client import upstream_client

log = logging.getLogger("crossbar.runtime")

# Set once this process begins a graceful stop (crossbar_site/serve.py, the ASGI lifespan):
# `/health` then answers 503 "draining" so a load balancer stops sending while requests finish.
STOPPING = threading.Event()


class Runtime:
    """Everything the proxy needs, bound to one event loop. Not thread-safe: use it on its loop."""

    def __init__(self, fleet: Fleet, generation: int) -> None:
        conf = settings.CROSSBAR
        self.fleet = fleet
        self.loop = asyncio.get_running_loop()
        # Each route's hosts in the chooser's order, per model: whatever changes a host's
        # place (its slots, line, leases, health) touches it there.
        self.rankings = Rankings(self._candidate)
        touch = self.rankings.touch
        self.shared: SharedState | None = None
        if conf["REDIS_URL"]:
            self.shared = SharedState(
                conf["REDIS_URL"], hold_ttl=conf["REDIS_HOLD_TTL"], on_change=touch
            )
            self.state: FleetState = self.shared
        else:
            self.state = LocalState(Limiter(on_change=touch), LeaseTable(on_change=touch))
        # A host that becomes usable again offers its free slots to the requests waiting.
        self.health = HealthTable(on_eligible=self.state.wake, on_change=touch)
        self._route_hosts: dict[str, frozenset[str]] = {}  # by route name, for `usable`
        self._served: dict[str, frozenset[str]] = {}  # the models each route serves
        self.poller = Poller(self.health, conf["HEALTH_INTERVAL"], conf["HEALTH_TIMEOUT"])
        self.clients = ClientGate(require=conf["REQUIRE_KEY"])
        self.running = RunningTable()
        # What each host's KV cache holds, as this process has seen it (routing/core/prefixes.py);
        # with shared state too, each process keeps its own (docs/replicas.md).
        self.prefixes = PrefixIndex(conf["PREFIX_INDEX_ENTRIES"])
        # The hosts' recent service times and prompt speeds, for priced patience
        # (routing/core/patience.py); with shared state too, each process keeps its own.
        self.figures = Figures()
        self.connect_timeout: float = conf["CONNECT_TIMEOUT"]
        self.headers_timeout: float = conf["HEADERS_TIMEOUT"]
        self.stream_idle_timeout: float = conf["STREAM_IDLE_TIMEOUT"]
        self.keepalive: float = conf["KEEPALIVE"]
        self.client = upstream_client(conf["UPSTREAM_TRANSPORT"], self.connect_timeout)
        self._generation = generation
        self._reload_lock = asyncio.Lock()
        self._tasks: list[asyncio.Task[None]] = []
        self._probing: dict[str, asyncio.Future[None]] = {}  # on-demand probes, by host
        self._apply(fleet)

    async def start(self) -> None:
        """Start the health poller and the config watcher on the running loop, and the
        shared state's liveness and grant listener (Redis being away is logged, not raised)."""
        conf = settings.CROSSBAR
        if self.shared is not None:
            await self.shared.start()
        self._tasks = [
            asyncio.create_task(self.poller.run(self._probes), name="crossbar-health"),
            asyncio.create_task(self._watch_revision(conf["CONFIG_POLL"]), name="crossbar-config"),
        ]

    async def aclose(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.shared is not None:
            await self.shared.aclose()
        await self.poller.aclose()
        await self.client.aclose()

    # -- configuration -------------------------------------------------------------------

    async def refresh(self) -> None:
        """Reload when this process committed a configuration change since the last load."""
        if signals.config_generation() != self._generation:
            await self.reload()

    async def reload(self, *, force: bool = False) -> None:
        """Load the fleet again; unless forced, only when this process changed it."""
        async with self._reload_lock:
            generation = signals.config_generation()
            if generation == self._generation and not force:
                return  # another request reloaded while this one waited for the lock
            fleet = await sync_to_async(load_fleet)()
            self._generation = generation
            self._apply(fleet)

    def _apply(self, fleet: Fleet) -> None:
        old = getattr(self, "fleet", fleet)
        replaced: list[str] = []
        for host in fleet.hosts.values():
            for model in host.models.values():
                self.state.configure(host.name, model.name, model.parallel, model.queue_max)
        for host in old.hosts.values():
            current = fleet.hosts.get(host.name)
            for model_name in host.models:
                if current is None or model_name not in current.models:
                    self.state.remove(host.name, model_name)
            if current is None or current.url != host.url:
                # Gone, or another machine under the same name: its caches hold nothing of ours.
                self.state.drop_host(host.name)
                replaced.append(host.name)
        self.prefixes.forget(replaced)
        self.figures.forget(replaced)
        self.health.track({host.name: host.url for host in fleet.hosts.values()})
        self.clients.configure(fleet.clients)
        self.fleet = fleet
        self.rankings.clear()
        self._route_hosts = {name: frozenset(route.hosts) for name, route in fleet.routes.items()}
        self._served = {
            name: frozenset(fleet.route_models(route)) for name, route in fleet.routes.items()
        }
        for name in fleet.hosts:  # undrained, enabled or added to a route: waiters may go there
            self.state.wake(name)
        log.info(
            "config loaded: revision=%s hosts=%d routes=%d",
            fleet.revision,
            len(fleet.hosts),
            len(fleet.routes),
        )

    async def _watch_revision(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                revision = await sync_to_async(current_revision)()
            except Exception as exc:  # the database being down must not kill the watcher
                log.warning("config revision check failed: %s", exc)
                continue
            if revision != self.fleet.revision:
                try:
                    await self.reload(force=True)
                except Exception as exc:
                    log.warning("config reload failed: %s", exc)

    async def probe_down(self, route: RouteConfig) -> None:
        """Ask the route's hosts that are not up how they are now, once each, all at once.

        For a request that found no usable host: a host that restarted since the last poll
        serves it at once instead of after the next poll. Concurrent callers share each
        host's probe.
        """
        waits = []
        for name in route.hosts:
            host = self.fleet.hosts.get(name)
            if host is None or not host.enabled or self.health.eligible(name):
                continue
            probing = self._probing.get(name)
            if probing is None:
                probe = Probe(host.name, host.url, host.api_key)
                probing = asyncio.ensure_future(self.poller.poll(probe))
                self._probing[name] = probing
                probing.add_done_callback(lambda _, name=name: self._probing.pop(name, None))  # type: ignore[misc]  # mypy cannot infer a lambda with a default argument
            waits.append(probing)
        if waits:
            await asyncio.wait(waits)

    def _probes(self) -> list[Probe]:
        return [
            Probe(host.name, host.url, host.api_key)
            for host in self.fleet.hosts.values()
            if host.enabled
        ]

    # -- placement -----------------------------------------------------------------------

    def serves(self, route: RouteConfig, model: str) -> bool:
        """Whether any enabled host of the route lists the model."""
        return model in self._served.get(route.name, ())

    def usable(self, route: RouteConfig, model: str, name: str) -> bool:
        """Whether a host may take new work for this route and model right now."""
        host = self.fleet.hosts.get(name)
        return (
            host is not None
            and name in self._route_hosts.get(route.name, ())
            and host.enabled
            and not host.draining
            and model in host.models
            and self.health.eligible(name)
        )

    def ranking(self, route: RouteConfig, model: str | None) -> Ranking:
        """The route's usable hosts for `model` in the chooser's order (kept, not rebuilt:
        routing/core/ranking.py). `model` None: a request that names none (a GET such as
        /props), for which every enabled host qualifies by its free slots over all models."""
        self.state.expire_leases()  # the counts as of now, as `candidates` would read them
        return self.rankings.of(route.name, route.hosts, model)

    def _candidate(self, name: str, model: str | None) -> Candidate | None:
        """One host as the chooser sees it for `model`; None when it is unknown or disabled."""
        host = self.fleet.hosts.get(name)
        if host is None or not host.enabled:
            return None
        evicts_busy = False
        if model is None:
            can_serve = loaded = True
            free = self.state.free_slots(name)
            queued = 0
        else:
            spec = host.models.get(model)
            can_serve = spec is not None
            health = self.health.get(name)
            known = health.loaded
            loaded = spec is not None and (
                known is None or (spec.upstream_name or spec.name) in known
            )
            free = self.state.free_for(name, model) if can_serve else 0
            queued = self.state.queued(name, model)
            evicts_busy = can_serve and not loaded and self._evicts_busy(host, health)
        return Candidate(
            host=name,
            healthy=self.health.eligible(name),
            draining=host.draining,
            loaded=loaded,
            can_serve=can_serve,
            free=free,
            queued=queued,
            weight=host.weight,
            leases=self.state.leases_held(name),
            evicts_busy=evicts_busy,
        )

    def _evicts_busy(self, host: HostConfig, health: HostHealth) -> bool:
        """Whether loading one more model on this router-mode host would unload a busy one:
        it holds its most models already, and each has requests or leased conversations."""
        described = health.described
        if described is None or not described.router or not described.max_models:
            return False
        running = [
            upstream
            for upstream, state in described.models.items()
            if state in (ModelState.LOADED, ModelState.LOADING)
        ]
        if len(running) < described.max_models:
            return False
        by_upstream = {(m.upstream_name or m.name): m.name for m in host.models.values()}
        return all(
            (name := by_upstream.get(upstream)) is not None
            and (
                self.state.in_flight(host.name, name)
                or self.state.queued(host.name, name)
                or self.state.leases_held(host.name, name)
            )
            for upstream in running
        )

    async def admit(self, client: ClientSpec, route: str) -> Admitted:
        """Count a request of `client` on `route` against its key's limits: in this process,
        or over every process when the state is shared. Raises what `ClientGate.admit` does
        (and StateUnavailable)."""
        if self.shared is None:
            return self.clients.admit(client, route)
        return await self.shared.clients.admit(client, route)

    def fallback_of(self, route: RouteConfig) -> RouteConfig | None:
        """The route's fallback route, when it names an enabled one."""
        fallback = self.fleet.routes.get(route.fallback) if route.fallback else None
        return fallback if fallback is not None and fallback.enabled else None


_runtimes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Runtime] = (
    weakref.WeakKeyDictionary()
)
_building: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Lock] = (
    weakref.WeakKeyDictionary()
)


async def get_runtime() -> Runtime:
    """The runtime of the running loop, built from the database on first use."""
    loop = asyncio.get_running_loop()
    runtime = _runtimes.get(loop)
    if runtime is not None:
        return runtime
    lock = _building.setdefault(loop, asyncio.Lock())
    async with lock:
        runtime = _runtimes.get(loop)
        if runtime is None:
            generation = signals.config_generation()
            fleet = await sync_to_async(load_fleet)()
            runtime = Runtime(fleet, generation)
            await runtime.start()
            _runtimes[loop] = runtime
    return runtime


def current_runtime() -> Runtime | None:
    """The runtime of some loop in this process, for read-only views (admin, metrics)."""
    for runtime in list(_runtimes.values()):
        return runtime
    return None


async def close_runtime() -> None:
    """Stop and forget the running loop's runtime (tests; graceful shutdown)."""
    runtime = _runtimes.pop(asyncio.get_running_loop(), None)
    if runtime is not None:
        await runtime.aclose()
