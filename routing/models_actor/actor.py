"""Fleet placement's actor: it builds a `model_placement.Snapshot` from what the gateway knows,
calls `decide`, and carries out its loads and unloads through the router hosts' own
`POST /models/load` and `/models/unload`, off the request path.

Driven by events, never by polling faster than the health checks: a request for a model loaded
nowhere (`wait_loaded`), a request that finds its model's line not empty (`arrived`), a host's
state or model states changing as the poller reads them (`host_changed`), the next
`idle_unload` deadline, and, while a model needs a load it cannot have (`Unplaced`: residency,
swap budget, no room), one more try a health interval later. Several events before the loop
runs again make one decision.

What it reads: per model, the requests waiting (in crossbar's lines, `state.queued`, and here
for a load) and running (`state.in_flight`), and its arrivals of the last minute; per (host,
model) pair (`fleet_view`), the host's word on its state, when that began (seen here), its last
use, the load's seconds as measured here (from the POST to the poller seeing `loaded`); per
host, its room (`--models-max`) and the loads begun here in the last minute.

A load: POST /models/load, then the host is read again at once (`poll_now`) so placement
learns its state without waiting a round. It ends when the host lists the model `loaded`, and
fails when the host answers the POST with an error, lists the model `failed`, or has not
loaded it after `load_timeout`: the pair is then failed for `BACKOFF` seconds (decide tries
another host) and the requests waiting for that model hear the host's own words
(`ModelLoadFailed`). Requests that come while a load is under way join it.

One actor per runtime (per event loop). With CROSSBAR_REDIS_URL every process has one, and
only the holder of the decider's lease in Redis decides and acts
(`routing/shared/model_decider.py`): the others read the hosts as always, send it their
requests' demand for a model loaded nowhere (`want`), and release those requests when their
own reading shows the model loaded (read again at once when the decider says a load ended); a
load that fails on the decider reaches their waiters with the host's words. Redis away: no
process decides, and no request waits for a load. Not thread-safe: use it on its loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, defaultdict, deque
from collections.abc import Awaitable, Callable, Collection

import httpx

from hosts.describe import Described
from routing.config.shape import FleetConfig
from routing.core.errors import ModelLoadFailed
from routing.core.model_placement import (
    Demand,
    Host,
    Load,
    Model,
    ModelOnHost,
    Snapshot,
    Status,
    Unload,
    Unplaced,
    decide,
)
from routing.live_fleet import LiveFleet
from routing.models_actor.decisions import Decisions
from routing.models_actor.fleet_view import (
    Pair,
    Seen,
    idle_unload_of,
    models_max,
    pairs_on,
    placeable_hosts,
    rules_of,
)
from routing.shared.model_decider import ModelDecider

log = logging.getLogger("crossbar.models")

RATE_WINDOW = 60.0  # seconds of arrivals a model's rate counts
BACKOFF = 60.0  # seconds a pair whose load failed is not tried again
PairKey = tuple[str, str]


class ModelActor:
    """Places the fleet's models on its router hosts that load none on demand (`fleet_view`).

    `poll_now(host)` reads a host again at once (the runtime's on-demand probe);
    `interval` is the health checks' (the retry after an `Unplaced`); `idle_unload` seconds
    (None: never) a loaded model may stay unused; `load_timeout` seconds a load may take;
    `decider`, with shared state: whether this process decides, and its channel to the others
    (None: the one process, which always decides)."""

    def __init__(
        self,
        live: LiveFleet,
        client: httpx.AsyncClient,
        poll_now: Callable[[str], Awaitable[None]],
        *,
        interval: float,
        idle_unload: float | None,
        load_timeout: float,
        decider: ModelDecider | None = None,
    ) -> None:
        self.live = live
        self.client = client
        self.poll_now = poll_now
        self.interval = interval
        self.idle_unload = idle_unload
        self.load_timeout = load_timeout
        self.decider = decider
        self.loop = asyncio.get_running_loop()
        self.decisions = Decisions()
        self._arrivals: defaultdict[str, deque[float]] = defaultdict(deque)
        self._held: Counter[str] = Counter()  # requests waiting here for a load, by model
        self._ready: dict[str, asyncio.Future[str]] = {}  # what they await: the host loaded
        self._seen: dict[PairKey, tuple[Status, float]] = {}  # each pair's state, and since
        self._started: dict[PairKey, float] = {}  # loads begun here, not ended yet
        self._confirmed: set[PairKey] = set()  # of those, the ones read again since the POST
        self._failed: dict[PairKey, float] = {}  # until when a pair's load may not be tried
        self._load_s: dict[PairKey, float] = {}  # measured
        self._used: dict[PairKey, float] = {}  # last seen busy
        self._model_used: dict[str, float] = {}  # last request for the model
        self._loads: defaultdict[str, deque[float]] = defaultdict(deque)  # begun, per host
        self._tasks: set[asyncio.Task[None]] = set()
        self._pending: asyncio.Handle | None = None
        # The hosts it acts on (`placeable_hosts`) and the configuration they were read from:
        # read again after a host changed (`host_changed`) or the configuration did, not at
        # every arrival and decision (each a pass over the whole fleet).
        self._placeable_hosts: dict[str, Described] | None = None
        self._placeable_of: FleetConfig | None = None
        self._timer: asyncio.TimerHandle | None = None
        live.watchers.append(self.host_changed)

    # -- events -----------------------------------------------------------------------------

    def arrived(self, model: str) -> None:
        """A request for `model` arrives: counted; when its line is not empty, decide again
        (a line that grows may want another copy)."""
        now = self.loop.time()
        arrivals = self._arrivals[model]
        arrivals.append(now)
        # Kept to the rate's window here, not only when `snapshot` reads it: a model the actor
        # places nowhere is never read, and its arrivals would grow with every request.
        while arrivals[0] <= now - RATE_WINDOW:
            arrivals.popleft()
        self._model_used[model] = now
        if not self._seen and not self._placeable():
            return  # it acts on no host and never did: a decision would have nothing to do
        state = self.live.state
        if any(state.queued(host, model) for host in self.live.config.hosts):
            self.poke()

    def host_changed(self, host: str) -> None:
        """The poller (or the proxy) saw the host change: its state or its models'."""
        self._placeable_hosts = None
        self.poke()

    def can_load(self, model: str, hosts: Collection[str]) -> bool:
        """Whether a load could serve `model` on one of `hosts` (a route's)."""
        if self.decider is not None and not self.decider.reachable():
            return False  # nobody would decide the load
        return any(m == model and h in hosts for (h, m) in self._pairs())

    async def wait_loaded(self, model: str) -> str:
        """Wait until `model` is loaded on a host the actor acts on, starting one load (or
        joining the one under way); the host's name. Raises ModelLoadFailed when the load
        fails. The caller bounds the wait."""
        ready = self._ready.get(model)
        if ready is None or ready.done():
            ready = self._ready[model] = self.loop.create_future()
        self._held[model] += 1
        self._tell_wanted(model)
        self.poke()
        try:
            return await asyncio.shield(ready)
        finally:
            self._held[model] -= 1
            self._tell_wanted(model)

    def _tell_wanted(self, model: str) -> None:
        if self.decider is not None:
            self.decider.want(model, self._held[model])

    def loading_on(self, model: str) -> str:
        """The host a load of `model` is under way on, "" when none is."""
        return next((h for (h, m) in self._started if m == model), "")

    def seen(self) -> dict[PairKey, Seen]:
        """The pairs the actor acts on now, each as it last saw it, in wall-clock seconds:
        what the operator's fleet map shows. Read-only; call on the loop."""
        now = self.loop.time()
        wall = time.time() - now
        found = {}
        for key, pair in self._pairs().items():
            status, since = self._seen.get(key, (pair.status, now))
            found[key] = Seen(status, wall + since, wall + self._last_used(key, since))
        return found

    @property
    def deciding(self) -> bool:
        """Whether this process decides (always, but for a follower of the decider's lease)."""
        return self.decider is None or self.decider.deciding()

    # -- heard from the other processes (routing/shared/model_decider.py) --------------------

    def elected(self) -> None:
        """This process took the decider's lease: decide from what it knows now."""
        self.poke()

    def wanted(self) -> None:
        """Another process's requests waiting for a load changed in number."""
        self.poke()

    def loaded(self, host: str, model: str) -> None:
        """The decider saw `model` loaded on `host`: read that host at once when requests here
        wait for it (one read per word, not a poll)."""
        ready = self._ready.get(model)
        if ready is not None and not ready.done():
            self._spawn(self.poll_now(host))

    def failed(self, host: str, model: str, message: str) -> None:
        """The decider's load of `model` on `host` failed: the requests waiting here hear why."""
        self._fail_waiters(host, model, message)

    def poke(self) -> None:
        """Decide again soon (once, however many events come before)."""
        if self._pending is None:
            self._pending = self.loop.call_soon(self._decide)

    # -- the decision, carried out ----------------------------------------------------------

    def _decide(self) -> None:
        self._pending = None
        now = self.loop.time()
        current = self._pairs()
        self._observe(current, now)
        if not self.deciding:
            return
        unplaced = False
        for action in decide(self.snapshot(current, now), now):
            self.decisions.decided(action)
            if isinstance(action, Unplaced):
                unplaced = True
            elif isinstance(action, Unload):
                self._seen[action.host, action.model] = (Status.UNLOADED, now)
                self._spawn(self._ask(current[action.host, action.model], "unload"))
            else:
                self._begin(current[action.host, action.model], action, now)
        self._set_timer(now, unplaced)

    def _begin(self, pair: Pair, action: Load, now: float) -> None:
        key = (pair.host, pair.model)
        self._started[key] = now
        self._confirmed.discard(key)
        self._seen[key] = (Status.LOADING, now)
        self._loads[pair.host].append(now)
        self._spawn(self._ask(pair, "load"))

    async def _ask(self, pair: Pair, action: str) -> None:
        """Ask the pair's host to load or unload the model, then read the host again at once."""
        said = await self.ask_host(pair.host, pair.upstream, action)
        if said and action == "load":
            self._fail((pair.host, pair.model), f"{pair.host} answered the load: {said}")
        elif said:
            log.warning("model unload: host=%s model=%s answered: %s", pair.host, pair.model, said)
        await self.poll_now(pair.host)
        key = (pair.host, pair.model)
        if action == "load" and key in self._started:
            self._confirmed.add(key)
            self.poke()
            # Read it again when a load of this model took as long before (one read, not a
            # poll): the requests waiting go on then rather than at the poller's next round.
            expected = self._load_s_of(key)
            if expected is not None:
                await asyncio.sleep(max(0.0, self._started[key] + expected - self.loop.time()))
                if key in self._started:
                    await self.poll_now(pair.host)
        self.poke()

    async def ask_host(self, name: str, upstream: str, action: str) -> str:
        """`POST /models/<action>` (load or unload) of `upstream` to host `name`, with its
        api_key: "" when it answered 200, else what it said (the twin's seam)."""
        host = self.live.config.hosts.get(name)
        if host is None:
            return "no longer configured"
        headers = {"Authorization": f"Bearer {host.api_key}"} if host.api_key else {}
        url = f"{host.url.rstrip('/')}/models/{action}"
        try:
            response = await self.client.post(
                url, json={"model": upstream}, headers=headers, timeout=self.load_timeout
            )
        except httpx.HTTPError as exc:
            return f"{type(exc).__name__}: {exc}"
        return "" if response.status_code == 200 else _host_words(response)

    def _observe(self, current: dict[PairKey, Pair], now: float) -> None:
        """What the hosts say now: each pair's state and since when; loads that ended, failed
        or took too long; the requests waiting for a model loaded now go on."""
        for key, start in list(self._started.items()):
            pair = current.get(key)
            if now - start > self.load_timeout:
                self._fail(key, f"{key[0]} had not loaded it after {self.load_timeout:.0f} s")
            elif pair is None or key not in self._confirmed:
                continue  # the host is away, or not read since it answered the POST
            elif pair.status is Status.LOADED:
                self._loaded(key, now)
            elif pair.status is Status.FAILED:
                self._fail(key, f"{key[0]} says its load failed (its /models: failed)")
        for key, pair in current.items():
            status = Status.LOADING if key in self._started else pair.status
            if self._seen.get(key, (None, 0.0))[0] is not status:
                self._seen[key] = (status, now)
            if self.live.state.in_flight(*key) or self.live.state.queued(*key):
                self._used[key] = now
        for model, ready in list(self._ready.items()):
            host = next((h for (h, m), p in current.items() if m == model and
                         p.status is Status.LOADED), None)  # fmt: skip
            if host is not None and not ready.done():
                ready.set_result(host)

    def _loaded(self, key: PairKey, now: float) -> None:
        seconds = now - self._started.pop(key)
        self._confirmed.discard(key)
        self._load_s[key] = seconds
        self.decisions.load_took(seconds)
        self.decisions.said("loaded", key[0], key[1], f"load took {seconds:.1f} s")
        if self.decider is not None:
            self.decider.tell_loaded(*key)

    def _fail(self, key: PairKey, message: str) -> None:
        """The load of pair `key` failed: the pair backs off, its waiters hear why."""
        if self._started.pop(key, None) is None:
            return
        self._confirmed.discard(key)
        self._failed[key] = self.loop.time() + BACKOFF
        self._seen[key] = (Status.FAILED, self.loop.time())
        self.decisions.said("failed", key[0], key[1], message)
        if self.decider is not None:
            self.decider.tell_failed(key[0], key[1], message)
        self._fail_waiters(key[0], key[1], message)

    def _fail_waiters(self, host: str, model: str, message: str) -> None:
        ready = self._ready.pop(model, None)
        if ready is not None and not ready.done():
            ready.set_exception(ModelLoadFailed(host, model, message))
            ready.exception()  # retrieved: a future nobody awaits any more must not warn

    def _set_timer(self, now: float, unplaced: bool) -> None:
        """The next decision without an event: the next idle_unload deadline, a load's
        timeout, or a health interval from now while a model waits for a load it could
        not have."""
        deadlines = [start + self.load_timeout for start in self._started.values()]
        for key, (status, since) in self._seen.items():
            idle_unload = idle_unload_of(self.live.config, key[1], self.idle_unload)
            if status is Status.LOADED and idle_unload is not None:
                at = self._last_used(key, since) + idle_unload
                # Past it and still loaded: busy or within its residency; not every instant.
                deadlines.append(at if at > now else now + self.interval)
        if unplaced:
            deadlines.append(now + self.interval)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if deadlines:
            self._timer = self.loop.call_at(max(min(deadlines), now + 0.01), self.poke)

    def _spawn(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def aclose(self) -> None:
        for handle in (self._pending, self._timer):
            if handle is not None:
                handle.cancel()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.host_changed in self.live.watchers:
            self.live.watchers.remove(self.host_changed)

    # -- what the gateway knows, as a snapshot ----------------------------------------------

    def _pairs(self) -> dict[PairKey, Pair]:
        return pairs_on(self.live.config, self._placeable())

    def _placeable(self) -> dict[str, Described]:
        """The hosts the actor acts on now: health changes reach `host_changed`, and a
        reload replaces the configuration."""
        config = self.live.config
        if self._placeable_hosts is None or self._placeable_of is not config:
            self._placeable_hosts = placeable_hosts(config, self.live.health)
            self._placeable_of = config
        return self._placeable_hosts

    def _last_used(self, key: PairKey, since: float) -> float:
        return max(since, self._used.get(key, 0.0), self._model_used.get(key[1], 0.0))

    def snapshot(self, current: dict[PairKey, Pair], now: float) -> Snapshot:
        """The fleet as `decide` reads it, at `now`."""
        state = self.live.state
        models: dict[str, Model] = {}
        for model in {m for (_, m) in current}:
            arrivals = self._arrivals[model]
            while arrivals and arrivals[0] <= now - RATE_WINDOW:
                arrivals.popleft()
            hosts = self.live.config.hosts
            loaded = any(p.status is Status.LOADED for (_, m), p in current.items() if m == model)
            waiting = self._waiting_for_load(model, loaded)
            waiting += sum(state.queued(h, model) for h in hosts)
            running = sum(state.in_flight(h, model) for h in hosts)
            demand = Demand(len(arrivals) / RATE_WINDOW, waiting, running)
            placed = self.live.config.placed.get(model)
            size_gb = placed.size_gb if placed is not None and placed.size_gb else 0.0
            rules = rules_of(self.live.config, model, self.idle_unload)
            models[model] = Model(demand, rules, size_gb)
        on_hosts: dict[PairKey, ModelOnHost] = {}
        for key, pair in current.items():
            status, since = self._seen.get(key, (pair.status, now))
            failed_until = self._failed.get(key, 0.0)
            if failed_until > now:
                status = Status.FAILED
            on_hosts[key] = ModelOnHost(
                status=status, since=since, last_used=self._last_used(key, since),
                failed_until=failed_until, running=state.in_flight(*key),
                waiting=state.queued(*key), slots=pair.slots, load_s=self._load_s_of(key),
            )  # fmt: skip
        return Snapshot(self._hosts(now), models, on_hosts)

    def _waiting_for_load(self, model: str, loaded: bool) -> int:
        """The requests waiting for `model` to load, here and in the other processes; none
        once it has: those go on to its host now (their tasks have yet to run, or their
        process has yet to read the host), and counted as waiting they would ask for a copy
        more."""
        ready = self._ready.get(model)
        here = 0 if ready is not None and ready.done() else self._held[model]
        if self.decider is None or loaded:
            return here
        return here + self.decider.waiting_elsewhere(model)

    def _load_s_of(self, key: PairKey) -> float | None:
        """The pair's measured load; else the model's on other hosts (the same file, most
        often on the same kind of box), averaged; None when never measured."""
        if key in self._load_s:
            return self._load_s[key]
        seen = [s for (_, m), s in self._load_s.items() if m == key[1]]
        return sum(seen) / len(seen) if seen else None

    def _hosts(self, now: float) -> dict[str, Host]:
        found = {}
        for name, described in self._placeable().items():
            loads = self._loads[name]
            while loads and loads[0] <= now - RATE_WINDOW:
                loads.popleft()
            host = self.live.config.hosts[name]
            room = models_max(host, described)
            # A CROSSBAR_MODEL_IDLE_UNLOAD below the residency is the operator's word: no
            # longer kept.
            residency = min(host.min_residency, self.idle_unload or host.min_residency)
            found[name] = Host(
                room, memory_gb=host.memory_gb, swap_budget=host.swap_budget,
                min_residency=residency, recent_loads=tuple(loads),
            )  # fmt: skip
        return found


def _host_words(response: httpx.Response) -> str:
    """What a host said when it refused: its error's message, else its status and body."""
    try:
        error = response.json().get("error", {})
        message = error.get("message") if isinstance(error, dict) else error
    except (ValueError, AttributeError):
        message = None
    return str(message) if message else f"{response.status_code} {response.text[:200]}"
