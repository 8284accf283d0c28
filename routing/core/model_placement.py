"""Which model should be loaded where: fleet placement's decision, from demand, each host's room
and the measured costs.

`decide(snapshot, now)` reads one `Snapshot` (every model's demand and rules, every host's room,
and the state of each (host, model) pair a host can serve) and returns the actions to take now:
`Load(host, model, reason)`, `Unload(host, model, reason)`, and `Unplaced(model, reason)` for a
model that needs a load and cannot have one (no allowed host with room or a victim, the swap
budget spent, a back-off, `max_loaded`), so the operator sees why it waits. The caller carries
out loads and unloads, then calls again on the next event (a request for a model loaded nowhere,
a line that grows, a load that ends, time past an idle limit): each call decides from scratch.

The rules, in the order `decide` applies them (room given to an earlier rule is not given twice):

1. **Idle unload.** A loaded model unused for `idle_unload` seconds is unloaded, and idle copies
   beyond `max_loaded` (lowered by the operator) too.
2. **Pinned.** A model pinned on a host (a hand load) and not there is loaded there.
3. **min_loaded.** A model on fewer hosts (loaded or loading) than `min_loaded` gets one more.
4. **Demand**, models with the longest line first. A model with requests waiting and loaded
   nowhere is loaded on the best host. A model whose line outgrows its loaded hosts (more
   waiting than their free slots) is loaded on one more: at once where a host has free room
   (the copy costs its load only), else, where it would unload another model, when its
   priced wait (waiting x `service_s` / the slots of its loaded copies) is above the load's
   seconds there. A model already loading anywhere gets no load for demand: that load is the
   capacity coming.

Everywhere: at most one load per model per call; never more loaded or loading on a host than
`models_max` (and `memory_gb`, when given, counting `size_gb`); never more than `swap_budget`
loads a host in any `SWAP_WINDOW`; `max_loaded` never exceeded. The best host for a load is an
allowed host the pair is listed on, not failed (until `failed_until`), with budget left, and
room or victims to unload: free room first, then the least busy (requests running or waiting
there, whatever their model: a model loaded beside them shares the host's compute), then the
one holding the fewest models (so a cold fleet spreads its models over its hosts), then the
cheapest load (`load_s` measured, else `DEFAULT_LOAD_S`), then the fewest victims, then name.
A victim is the least valuable (lowest recent rate, then least recently used) loaded model on
that host that is unloadable: nothing running or waiting there, nothing waiting for it
anywhere, not pinned there, loaded for at least the host's `min_residency`, and on more hosts
than its `min_loaded`.

Pure: standard library only, no I/O, no clock of its own (`now` is the caller's, in seconds).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum

__all__ = [
    "DEFAULT_IDLE_UNLOAD",
    "DEFAULT_LOAD_S",
    "DEFAULT_MIN_RESIDENCY",
    "DEFAULT_SERVICE_S",
    "DEFAULT_SWAP_BUDGET",
    "SWAP_WINDOW",
    "Action",
    "Demand",
    "Host",
    "Load",
    "Model",
    "ModelOnHost",
    "ModelRules",
    "Snapshot",
    "Status",
    "Unload",
    "Unplaced",
    "decide",
]

# A load not yet measured on a host is priced at this many seconds (a mid-size GGUF from disk).
DEFAULT_LOAD_S = 20.0
# A request's seconds on one slot when the model's are not measured.
DEFAULT_SERVICE_S = 5.0
# A loaded model nobody used for this long is unloaded (seconds).
DEFAULT_IDLE_UNLOAD = 600.0
# Loads a host may begin per window, so alternating demand cannot thrash its GPU.
DEFAULT_SWAP_BUDGET = 4
# A model stays loaded at least this long after its load ended (seconds).
DEFAULT_MIN_RESIDENCY = 60.0
# The swap budget's window (seconds).
SWAP_WINDOW = 60.0


class Status(StrEnum):
    """A (host, model) pair's state, as the host's `GET /models` says it."""

    UNLOADED = "unloaded"
    LOADING = "loading"
    LOADED = "loaded"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class Demand:
    """A model's requests: arriving per second recently, waiting now (for a slot or a load),
    running now."""

    rate: float = 0.0
    waiting: int = 0
    running: int = 0


@dataclass(frozen=True, slots=True)
class ModelRules:
    """The operator's rules for one model. `hosts` None: any host that lists it. `pinned`: the
    hosts it was loaded on by hand, kept there until unpinned. `idle_unload` None: never."""

    min_loaded: int = 0
    max_loaded: int | None = None
    hosts: frozenset[str] | None = None
    idle_unload: float | None = DEFAULT_IDLE_UNLOAD
    pinned: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class Model:
    """One model: its demand, rules, size and measured seconds per request on one slot."""

    demand: Demand = Demand()
    rules: ModelRules = ModelRules()
    size_gb: float = 0.0
    service_s: float = DEFAULT_SERVICE_S


@dataclass(frozen=True, slots=True)
class Host:
    """One host's room and swap rules; `recent_loads`: when its last loads began."""

    models_max: int
    memory_gb: float | None = None
    swap_budget: int = DEFAULT_SWAP_BUDGET
    min_residency: float = DEFAULT_MIN_RESIDENCY
    recent_loads: tuple[float, ...] = ()


@dataclass(frozen=True, slots=True)
class ModelOnHost:
    """One (host, model) pair the host can serve. `since`: when its status began (a load's
    start for LOADING, its end for LOADED). `running`/`waiting`: the model's requests on this
    host. `load_s`: the measured load there, None when never measured."""

    status: Status = Status.UNLOADED
    since: float = 0.0
    last_used: float = 0.0
    failed_until: float = 0.0
    running: int = 0
    waiting: int = 0
    slots: int = 1
    load_s: float | None = None


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The fleet at one instant. A (host, model) pair missing from `pairs` cannot be loaded;
    every pair's host is in `hosts`."""

    hosts: Mapping[str, Host]
    models: Mapping[str, Model]
    pairs: Mapping[tuple[str, str], ModelOnHost]


@dataclass(frozen=True, slots=True)
class Load:
    host: str
    model: str
    reason: str


@dataclass(frozen=True, slots=True)
class Unload:
    host: str
    model: str
    reason: str


@dataclass(frozen=True, slots=True)
class Unplaced:
    """A model that needs a load it cannot have now; the reason says why, host by host."""

    model: str
    reason: str


Action = Load | Unload | Unplaced
# A load's reason, given the host chosen and the load's seconds there.
_Reason = Callable[[str, float], str]


@dataclass(slots=True)
class _Plan:
    """The fleet as `decide` changes it: each pair's status so far, loads begun per host."""

    snapshot: Snapshot
    now: float
    status: dict[tuple[str, str], Status]
    loads: dict[str, int]
    actions: list[Action] = field(default_factory=list)
    loaded: set[str] = field(default_factory=set)

    def held(self, host: str) -> list[str]:
        """The models loaded or loading on `host`, in name order."""
        return sorted(m for (h, m), s in self.status.items() if h == host and _holds(s))

    def copies(self, model: str) -> list[str]:
        """The hosts `model` is loaded or loading on."""
        return sorted(h for (h, m), s in self.status.items() if m == model and _holds(s))

    def unload(self, host: str, model: str, reason: str) -> None:
        self.status[host, model] = Status.UNLOADED
        self.actions.append(Unload(host, model, reason))

    def load(self, host: str, model: str, reason: str) -> None:
        self.status[host, model] = Status.LOADING
        self.loads[host] += 1
        self.loaded.add(model)
        self.actions.append(Load(host, model, reason))


def _holds(status: Status) -> bool:
    return status in (Status.LOADED, Status.LOADING)


def decide(snapshot: Snapshot, now: float) -> list[Action]:
    """The loads and unloads to begin at `now`, each with its reason, unloads that make room
    just before the load they make it for; and an `Unplaced` for each model that needs a load
    it cannot have. Pure: the same snapshot and time give the same actions."""
    plan = _start(snapshot, now)
    _unload_idle(plan)
    for model in sorted(snapshot.models):
        for host in sorted(snapshot.models[model].rules.pinned):
            _load_pinned(plan, host, model)
    for model in sorted(snapshot.models):
        _keep_min_loaded(plan, model)
    by_line = sorted(snapshot.models, key=lambda m: (-snapshot.models[m].demand.waiting, m))
    for model in by_line:
        _load_for_demand(plan, model)
    return plan.actions


def _start(snapshot: Snapshot, now: float) -> _Plan:
    status = {}
    for pair, state in snapshot.pairs.items():
        failed_over = state.status is Status.FAILED and state.failed_until <= now
        status[pair] = Status.UNLOADED if failed_over else state.status
    loads = {
        name: sum(1 for t in host.recent_loads if now - t < SWAP_WINDOW)
        for name, host in snapshot.hosts.items()
    }
    return _Plan(snapshot, now, status, loads)


def _unload_idle(plan: _Plan) -> None:
    for (host, model), status in sorted(plan.status.items()):
        if status is not Status.LOADED or not _unloadable(plan, host, model):
            continue
        rules = plan.snapshot.models[model].rules
        idle = plan.now - plan.snapshot.pairs[host, model].last_used
        if rules.idle_unload is not None and idle >= rules.idle_unload:
            reason = f"idle {idle:.0f} s past idle_unload {rules.idle_unload:.0f} s"
            plan.unload(host, model, reason)
        elif rules.max_loaded is not None and len(plan.copies(model)) > rules.max_loaded:
            plan.unload(host, model, f"max_loaded {rules.max_loaded}")


def _unloadable(plan: _Plan, host: str, model: str) -> bool:
    """Whether `model` may leave `host` now: loaded, idle there and everywhere, not pinned
    there, past the host's minimum residency, and on more hosts than its min_loaded."""
    if model not in plan.snapshot.models or host not in plan.snapshot.hosts:
        return False
    state = plan.snapshot.pairs[host, model]
    spec = plan.snapshot.models[model]
    return (
        plan.status[host, model] is Status.LOADED
        and state.running == 0
        and state.waiting == 0
        and spec.demand.waiting == 0
        and host not in spec.rules.pinned
        and plan.now - state.since >= plan.snapshot.hosts[host].min_residency
        and len(plan.copies(model)) > spec.rules.min_loaded
    )


def _load_pinned(plan: _Plan, host: str, model: str) -> None:
    if (host, model) not in plan.status or _holds(plan.status[host, model]):
        return
    if model in plan.loaded or _at_max(plan, model):
        return
    if _why_not(plan, host, model) is None:
        _load(plan, host, model, "pinned")


def _keep_min_loaded(plan: _Plan, model: str) -> None:
    rules = plan.snapshot.models[model].rules
    if model in plan.loaded or len(plan.copies(model)) >= rules.min_loaded:
        return
    _place(plan, model, lambda host, load_s: f"min_loaded {rules.min_loaded}")


def _load_for_demand(plan: _Plan, model: str) -> None:
    spec = plan.snapshot.models[model]
    waiting = spec.demand.waiting
    copies = plan.copies(model)
    # A model loading anywhere (also one this call loads) has its capacity coming.
    if waiting == 0 or any(plan.status[host, model] is Status.LOADING for host in copies):
        return
    if not copies:
        _place(plan, model, lambda host, load_s: f"demand: {waiting} waiting, loaded nowhere; "
               f"load {load_s:.0f} s on {host}")  # fmt: skip
        return
    slots = sum(plan.snapshot.pairs[host, model].slots for host in copies)
    if waiting <= slots - spec.demand.running:
        return  # its copies have a free slot for each
    priced = waiting * spec.service_s / max(slots, 1)
    best = _best_host(plan, model)
    if isinstance(best, str):
        return  # served where it is loaded, only slower: nothing to explain
    host, victims = best
    load_s = _load_s(plan, host, model)
    if victims == 0:
        # Room nobody uses: the copy costs its load only, and serves the line from then on.
        _load(plan, host, model, f"demand: {waiting} waiting, free room on {host}")
    elif priced > load_s:
        reason = f"demand: {waiting} waiting, priced wait {priced:.0f} s > load {load_s:.0f} s"
        _load(plan, host, model, f"{reason} on {host}")


def _place(plan: _Plan, model: str, reason: _Reason) -> None:
    """Load `model` on its best host, or say why it cannot be loaded anywhere."""
    best = _best_host(plan, model)
    if isinstance(best, str):
        plan.actions.append(Unplaced(model, best))
        return
    host, _ = best
    _load(plan, host, model, reason(host, _load_s(plan, host, model)))


def _load(plan: _Plan, host: str, model: str, reason: str) -> None:
    """Unload the victims that make room for `model` on `host`, then load it there."""
    victims = _victims(plan, host, model)
    assert victims is not None, "a load is decided only where there is room"
    for victim in victims:
        plan.unload(host, victim, f"making room for {model}")
    plan.load(host, model, reason)


def _best_host(plan: _Plan, model: str) -> tuple[str, int] | str:
    """The best host for a load of `model` and how many victims it needs, or, when there is
    none, why not (host by host)."""
    if _at_max(plan, model):
        return f"max_loaded {plan.snapshot.models[model].rules.max_loaded} reached"
    candidates: list[tuple[bool, int, int, float, int, str]] = []
    refusals: list[str] = []
    for host in sorted(plan.snapshot.hosts):
        why = _why_not(plan, host, model)
        if why is not None:
            refusals.append(f"{host} {why}")
            continue
        victims = _victims(plan, host, model)
        assert victims is not None
        held = len(plan.held(host))
        load_s = _load_s(plan, host, model)
        candidates.append((bool(victims), _busy(plan, host), held, load_s, len(victims), host))
    if not candidates:
        return "no host: " + ("; ".join(refusals) or "none in the fleet")
    *_, count, host = min(candidates)
    return host, count


def _busy(plan: _Plan, host: str) -> int:
    """The requests running or waiting on `host`, whatever their model: a model loaded beside
    them shares the host's compute with them."""
    pairs = plan.snapshot.pairs
    return sum(state.running + state.waiting for (h, _), state in pairs.items() if h == host)


def _at_max(plan: _Plan, model: str) -> bool:
    """Whether `model` is loaded or loading on `max_loaded` hosts already."""
    most = plan.snapshot.models[model].rules.max_loaded
    return most is not None and len(plan.copies(model)) >= most


def _why_not(plan: _Plan, host: str, model: str) -> str | None:
    """Why `model` cannot be loaded on `host` now, or None when it can."""
    rules = plan.snapshot.models[model].rules
    pair = (host, model)
    if pair not in plan.status:
        return "does not list it"
    if rules.hosts is not None and host not in rules.hosts and host not in rules.pinned:
        return "not allowed"
    if _holds(plan.status[pair]):
        return "has it"
    if plan.status[pair] is Status.FAILED:
        return f"failed until {plan.snapshot.pairs[pair].failed_until:.0f} s"
    if plan.loads[host] >= plan.snapshot.hosts[host].swap_budget:
        budget = plan.snapshot.hosts[host].swap_budget
        return f"swap budget of {budget} loads a minute spent"
    if _victims(plan, host, model) is None:
        return "full, and nothing there may be unloaded"
    return None


def _victims(plan: _Plan, host: str, model: str) -> list[str] | None:
    """The least valuable unloadable models to unload from `host` so that `model` fits: [] when
    it fits already, None when unloading every unloadable one would not make room."""
    held = plan.held(host)
    if _fits(plan, host, model, held):
        return []
    pairs = plan.snapshot.pairs
    spare = [m for m in held if _unloadable(plan, host, m)]
    spare.sort(key=lambda m: (plan.snapshot.models[m].demand.rate, pairs[host, m].last_used, m))
    victims: list[str] = []
    for victim in spare:
        victims.append(victim)
        if _fits(plan, host, model, [m for m in held if m not in victims]):
            return victims
    return None


def _fits(plan: _Plan, host: str, model: str, held: list[str]) -> bool:
    """Whether `model` fits on `host` beside `held` (count, and memory when given)."""
    room = plan.snapshot.hosts[host]
    if len(held) + 1 > room.models_max:
        return False
    if room.memory_gb is None:
        return True
    models = plan.snapshot.models
    # A model loaded by someone else and unknown here takes a place but is counted as size 0.
    held_gb = sum(models[m].size_gb for m in held if m in models)
    return held_gb + models[model].size_gb <= room.memory_gb


def _load_s(plan: _Plan, host: str, model: str) -> float:
    measured = plan.snapshot.pairs[host, model].load_s
    return DEFAULT_LOAD_S if measured is None else measured
