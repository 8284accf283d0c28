"""The gateway's live state: the live fleet placement reads (routing/live_fleet.py: the fleet
as configured, its health, its state and the rankings kept from them), and beside it the
health poller, client keys, the running table, the prefix index and the upstream client.

The fleet state is this process's own (`LocalState`: a `Limiter` and a `LeaseTable`), or,
with `CROSSBAR_REDIS_URL`, shared by every gateway process through Redis (`SharedState`,
routing/shared; docs/replicas.md). Placement and the proxy use either the same way.

There is one `Runtime` per event loop (in production: daphne's one loop; in tests: each test's
loop), built lazily from the database on first use. Configuration changes reach it two ways:
this process's signals bump a generation that `refresh()` compares on every request (admin edits
apply to the next request), and a watcher task polls the shared `ConfigRevision` row for changes
made by other processes. A reload swaps in a new immutable `FleetConfig` and reconfigures the
limiter in place, so in-flight slots, queues and the leases of hosts that still exist survive it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import weakref
from collections.abc import Callable

from asgiref.sync import sync_to_async
from django.conf import settings

from accounting.spend import spend_by_client
from hosts.poller import Poller, Probe
from routing import signals
from routing.config.reader import current_revision, load_fleet
from routing.config.shape import FleetConfig, RouteConfig
from routing.core.budgets import Spend
from routing.core.clients import Admitted, ClientGate, ClientSpec
from routing.core.leases import LeaseTable
from routing.core.limiter import Limiter
from routing.core.line import headroom_in_use
from routing.core.patience import Figures
from routing.core.prefixes import PrefixIndex
from routing.core.running import RunningTable
from routing.core.state import FleetState, LocalState
from routing.live_fleet import LiveFleet
from routing.models_actor.actor import ModelActor
from routing.shared.fleet_state import SharedState
from routing.shared.model_decider import ModelDecider
from routing.shared.state import StateUnavailable
from routing.upstream_client import upstream_client

log = logging.getLogger("crossbar.runtime")

# Set once this process begins a graceful stop (crossbar_site/serve.py, the ASGI lifespan):
# `/health` then answers 503 "draining" so a load balancer stops sending while requests finish.
STOPPING = threading.Event()

DECIDER_INTERVALS = 3  # health intervals (or ticks) the model decider's lease outlives its holder


class Runtime:
    """Everything the proxy needs, bound to one event loop. Not thread-safe: use it on its loop."""

    def __init__(self, fleet: FleetConfig, generation: int, figures: Figures | None = None) -> None:
        """`figures`: what priced patience learns from the answers; new ones by default (the
        fleet twin passes its own, to watch what they are taught)."""
        conf = settings.CROSSBAR
        self.loop = asyncio.get_running_loop()
        self.shared: SharedState | None = None

        def make_state(touch: Callable[[str], None]) -> FleetState:
            if conf["REDIS_URL"]:
                self.shared = SharedState(
                    conf["REDIS_URL"], hold_ttl=conf["REDIS_HOLD_TTL"], on_change=touch
                )
                return self.shared
            return LocalState(Limiter(on_change=touch), LeaseTable(on_change=touch))

        # What placement reads: the fleet, its health, state and caches, each route's ranking.
        prefixes, figures = PrefixIndex(conf["PREFIX_INDEX_ENTRIES"]), figures or Figures()
        self.live = LiveFleet(
            fleet,
            make_state,
            prefixes,
            conf["PREFIX_MARGIN"],
            figures,
            conf["NAME_SLOTS"],
            conf["SLOT_PROMPT_SIMILARITY"],
        )
        self.state = self.live.state
        self.health = self.live.health
        self.prefixes = prefixes
        self.figures = figures
        self.poller = Poller(self.health, conf["HEALTH_INTERVAL"], conf["HEALTH_TIMEOUT"])
        self.clients = ClientGate(require=conf["REQUIRE_KEY"])
        self.running = RunningTable()
        self.connect_timeout: float = conf["CONNECT_TIMEOUT"]
        self.headers_timeout: float = conf["HEADERS_TIMEOUT"]
        self.stream_idle_timeout: float = conf["STREAM_IDLE_TIMEOUT"]
        self.keepalive: float = conf["KEEPALIVE"]
        self.client = upstream_client(self.connect_timeout)
        self._generation = generation
        self._reload_lock = asyncio.Lock()
        self._tasks: list[asyncio.Task[None]] = []
        self._probing: dict[str, asyncio.Future[None]] = {}  # on-demand probes, by host
        # Fleet model placement: with shared state, the holder of a lease in Redis decides
        # (docs/replicas.md); it outlives a dead holder by a few health intervals.
        self.decider: ModelDecider | None = None
        if self.shared is not None:
            ttl = DECIDER_INTERVALS * max(conf["HEALTH_INTERVAL"], self.shared.shared.tick)
            self.decider = ModelDecider(self.shared.shared, ttl)
        idle = conf["MODEL_IDLE_UNLOAD"]
        self.models: ModelActor | None = ModelActor(
            self.live, self.client, self.poll_host, interval=conf["HEALTH_INTERVAL"],
            idle_unload=idle if idle > 0 else None, load_timeout=conf["MODEL_LOAD_TIMEOUT"],
            decider=self.decider,
        )  # fmt: skip
        self._configured(fleet)

    @property
    def fleet(self) -> FleetConfig:
        """The fleet as configured now (replaced whole by a reload)."""
        return self.live.config

    async def start(self) -> None:
        """Start the health poller and the config watcher on the running loop, and the
        shared state's liveness and grant listener (Redis being away is logged, not raised)."""
        conf = settings.CROSSBAR
        if self.shared is not None:
            await self.shared.start()
        if self.decider is not None and self.models is not None:
            await self.decider.start(self.models)
        await self._seed_budgets(self.clients.names())
        self._tasks = [
            asyncio.create_task(self.poller.run(self._probes), name="crossbar-health"),
            asyncio.create_task(self._watch_revision(conf["CONFIG_POLL"]), name="crossbar-config"),
        ]

    async def aclose(self) -> None:
        if self.decider is not None:
            await self.decider.aclose()
        if self.models is not None:
            await self.models.aclose()
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

    def stale(self) -> bool:
        """Whether this process committed a configuration change the runtime has not loaded."""
        return signals.config_generation() != self._generation

    async def adopt(self, generation: int, fleet: FleetConfig) -> None:
        """Apply `fleet`, read as of `generation` by a thread that may use the ORM: a sync
        admin view's, which holds the thread `reload`'s `sync_to_async` would read it in."""
        async with self._reload_lock:
            if generation > self._generation:
                self._generation = generation
                await self._apply_seeded(fleet)

    async def reload(self, *, force: bool = False) -> None:
        """Load the fleet again; unless forced, only when this process changed it."""
        async with self._reload_lock:
            generation = signals.config_generation()
            if generation == self._generation and not force:
                return  # another request reloaded while this one waited for the lock
            fleet = await sync_to_async(load_fleet)()
            self._generation = generation
            await self._apply_seeded(fleet)

    async def _apply_seeded(self, fleet: FleetConfig) -> None:
        """Apply `fleet`; keys new to this runtime get their spend from the rows."""
        before = self.clients.names()
        self._apply(fleet)
        await self._seed_budgets(self.clients.names() - before)

    def _apply(self, fleet: FleetConfig) -> None:
        self.live.apply(fleet)
        self._configured(fleet)
        if self.models is not None:  # the operator's placement rules may have changed
            self.models.poke()

    async def _seed_budgets(self, names: set[str]) -> None:
        """Count the day's and month's rows of the keys `names` against their budgets, so a
        restart (or a key enabled again) does not give a key its budget back. With shared
        state, only a period Redis does not count yet is seeded (another process may have)."""
        if not names:
            return
        now = self.clients.now()
        try:
            found = await sync_to_async(spend_by_client)(names, now)
        except Exception as exc:  # a database away: budgets count from 0, as rows come back
            log.warning("budgets: the spend in the rows could not be read: %s", exc)
            return
        spends = {name: Spend(day, month) for name, (day, month) in found.items()}
        if self.shared is None:
            self.clients.ledger.seed(spends, now)
            return
        try:
            await self.shared.clients.seed(spends, now)
        except StateUnavailable as exc:
            log.warning("budgets: the spend could not be seeded in Redis: %s", exc)

    def _configured(self, fleet: FleetConfig) -> None:
        self.clients.configure(fleet.clients)
        if isinstance(self.state, LocalState):
            conf = settings.CROSSBAR
            classes = {client.priority for client in fleet.clients.values()}
            headroom = headroom_in_use(conf["HEADROOM"], classes)
            self.state.limiter.set_fairness(headroom, conf["STARVATION_BOUND"])
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
            waits.append(self._probe(host.name, host.url, host.api_key))
        if waits:
            await asyncio.wait(waits)

    async def poll_host(self, name: str) -> None:
        """Read the host again now (the model actor, after a load or unload it asked for)."""
        host = self.fleet.hosts.get(name)
        if host is not None and host.enabled:
            await self._probe(name, host.url, host.api_key)

    def _probe(self, name: str, url: str, api_key: str) -> asyncio.Future[None]:
        """The host's on-demand poll, shared by concurrent callers."""
        probing = self._probing.get(name)
        if probing is None:
            probing = asyncio.ensure_future(self.poller.poll(Probe(name, url, api_key)))
            self._probing[name] = probing
            probing.add_done_callback(lambda _, name=name: self._probing.pop(name, None))  # type: ignore[misc]  # mypy cannot infer a lambda with a default argument
        return probing

    def _probes(self) -> list[Probe]:
        return [
            Probe(host.name, host.url, host.api_key)
            for host in self.fleet.hosts.values()
            if host.enabled
        ]

    def arrived(self, model: str | None) -> None:
        """A request for `model` arrives (the model actor counts demand)."""
        if model is not None and self.models is not None:
            self.models.arrived(model)

    # -- admission -----------------------------------------------------------------------

    async def admit(self, client: ClientSpec, route: str) -> Admitted:
        """Count a request of `client` on `route` against its key's limits: in this process,
        or over every process when the state is shared. Raises what `ClientGate.admit` does
        (and StateUnavailable)."""
        if self.shared is None:
            return self.clients.admit(client, route)
        return await self.shared.clients.admit(client, route)


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
