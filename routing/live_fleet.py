"""The live fleet as placement sees it: the configuration, the hosts' health, the fleet state
(slots, lines, leases), what their caches hold (the prefix index) and how fast they serve
(priced patience's figures), and each route's ranking kept from them.

This is `routing.core.placement.Fleet` for the gateway. A host's place in a ranking
(routing/core/ranking.py) is computed from the facts this part alone puts together: what the
configuration says of the host (route, weight, drain, models), what its health says (up,
which models are loaded, a router's model limit) and what the fleet state counts (free slots,
queued requests, leases). The state and the health table tell the rankings of every change
(`on_change`), so a request reads its route's order instead of building it.

A reload (`apply`) reconfigures the state in place, so in-flight slots, lines and the leases
of hosts that still exist survive it, and builds the rankings anew: a host's route position,
weight, drain and models are configuration.

Not thread-safe: use it on its event loop.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from accounting.report import is_cache_lost
from hosts.describe import Described, ModelState
from hosts.health import HealthTable, HostHealth
from routing.config.shape import FleetConfig, HostConfig, ModelConfig, RouteConfig, renamed_hosts
from routing.core.choose import Candidate
from routing.core.leases import LeaseKey
from routing.core.named_slots import NamedSlot
from routing.core.patience import Figures
from routing.core.prefixes import Prefix, PrefixIndex
from routing.core.ranking import Ranking, Rankings
from routing.core.slot_names import SlotNames
from routing.core.state import FleetState, Held

# Builds the fleet state, given what it must call when a host's counts change.
MakeState = Callable[[Callable[[str], None]], FleetState]


class LiveFleet:
    """The configured fleet, its health and its state, and the rankings kept from them."""

    def __init__(
        self,
        config: FleetConfig,
        make_state: MakeState,
        prefixes: PrefixIndex,
        prefix_margin: int,
        figures: Figures,
        name_slots: bool = True,
        slot_similarity: float = 0.1,
    ) -> None:
        self.rankings = Rankings(self._candidate)
        touch = self.rankings.touch
        self.state = make_state(touch)
        self.health = HealthTable(on_eligible=self._usable_again, on_change=self._health_changed)
        # What each host's KV cache holds, as this process has seen it (routing/core/prefixes.py);
        # with shared state too, each process keeps its own (docs/replicas.md).
        self.prefixes = prefixes
        self.prefix_margin = prefix_margin
        # The hosts' recent service times and prompt speeds, for priced patience
        # (routing/core/patience.py); with shared state too, each process keeps its own.
        self.figures = figures
        self.name_slots = name_slots  # CROSSBAR_NAME_SLOTS: see `id_slot`
        # The slots named on each host and what their answers said (`id_slot`), at the hosts'
        # --slot-prompt-similarity as CROSSBAR_SLOT_PROMPT_SIMILARITY says.
        self.slot_names = SlotNames(figures, prefixes, slot_similarity)
        self.config = config
        self._route_hosts: dict[str, frozenset[str]] = {}  # by route name, for `usable`
        # Every name each route serves a model by, to the model's own (`FleetConfig.route_names`).
        self._served: dict[str, Mapping[str, str]] = {}
        # Told of each host whose health changed (the model actor: routing/models_actor).
        self.watchers: list[Callable[[str], None]] = []
        self.apply(config)

    def apply(self, config: FleetConfig) -> None:
        """Serve `config` from now on. A host gone, or replaced by another machine under the
        same name, is forgotten: its caches hold nothing of ours any more. A host renamed (its
        box under another name: `renamed_hosts`) keeps its slots in flight under the new name;
        requests waiting for a host or model gone are placed again (`FleetState.remove`)."""
        old = self.config
        replaced: list[str] = []
        renamed = renamed_hosts(old, config)
        for was, now in renamed.items():
            self.state.rename(was, now)
        for host in config.hosts.values():
            for model in host.models.values():
                self.state.configure(host.name, model.name, model.parallel, model.queue_max)
        for host in old.hosts.values():
            name = renamed.get(host.name, host.name)
            current = config.hosts.get(name)
            for model_name in host.models:
                if current is None or model_name not in current.models:
                    self.state.remove(name, model_name)
            if current is None or name != host.name or current.url != host.url:
                self.state.drop_host(host.name)
                replaced.append(host.name)
        self.prefixes.forget(replaced)
        self.figures.forget(replaced)
        self.health.track({host.name: host.url for host in config.hosts.values()})
        self.config = config
        self.rankings.clear()
        self._route_hosts = {name: frozenset(route.hosts) for name, route in config.routes.items()}
        self._served = {name: config.route_names(route) for name, route in config.routes.items()}
        for name in config.hosts:  # undrained, enabled or added to a route: waiters may go there
            self.state.wake(name)

    def _usable_again(self, host: str) -> None:
        """A host that was down is up again: it offers its free slots to the requests waiting,
        and what the prefix index knew of its cache is forgotten. Whatever made it go down
        (a restart, most often) may have emptied its cache: the next answers are its word on
        what it holds now, not losses to count against it (`crossbar_cache_lost_total`, the
        cards' hint to change a setting)."""
        self.prefixes.forget([host])
        self.state.wake(host)

    def _health_changed(self, host: str) -> None:
        """What ranks the host changed: its place is found again, and its free slots are
        offered to the requests watching it, as when it comes back up: a model loaded there
        (by hand, or by the host) makes it usable for that model when it loads none on demand
        (`_answers`)."""
        self.rankings.touch(host)
        self.state.wake(host)
        for watcher in self.watchers:
            watcher(host)

    def serves(self, route: RouteConfig, model: str) -> bool:
        """Whether any enabled host of the route serves the model under this, its own, name."""
        return self._served.get(route.name, {}).get(model) == model

    def served(self, route: RouteConfig) -> Mapping[str, str]:
        """Every name the route's enabled hosts serve a model by (its own or an alias), to the
        model's own name, kept at each reload: a request asks, and `FleetConfig.route_names` walks
        every host of the route (4.5% of a request's CPU on 200)."""
        return self._served.get(route.name, {})

    def usable(self, route: RouteConfig, model: str, name: str) -> bool:
        """Whether a host may take new work for this route and model right now (a host that
        would refuse the model as not loaded may not: `_answers`)."""
        host = self.config.hosts.get(name)
        return (
            host is not None
            and name in self._route_hosts.get(route.name, ())
            and host.enabled
            and not host.draining
            and model in host.models
            and self.health.eligible(name)
            and _answers(host, host.models[model], self.health.get(name))
        )

    def ranking(self, route: RouteConfig, model: str | None) -> Ranking:
        """The route's usable hosts for `model` in the chooser's order (kept, not rebuilt:
        routing/core/ranking.py). `model` None: a request that names none (a GET such as
        /props), for which every enabled host qualifies by its free slots over all models."""
        self.state.expire_leases()  # the lease counts as of now
        return self.rankings.of(route.name, route.hosts, model)

    async def id_slot(self, key: LeaseKey, slot: Held, prefix: Prefix) -> NamedSlot | None:
        """The slot to name (llama-server's `id_slot`) for a request of the conversation `key`
        that holds `slot` on its lease's host, whose prompt is `prefix`: the number it keeps
        there (with a slot for each conversation leased to the host, a number of its own; with
        more, shared with as few as can be), unless the slots named there say to name none
        (`SlotNames.name`: a busy slot not worth waiting for, a request running in a slot
        llama-server chose, an empty slot llama-server would give it anyway). None, and
        llama-server chooses as it does for a request that names none, where no slot is named
        (`slot_naming`).

        Only a host whose `/props` gave its slots (a llama-server, not in router mode) is
        told a slot. Conversations sharing a slot take turns in it: llama-server saves the
        prompt a slot holds to its `--cache-ram` before another overwrites it, and loads the
        incoming one's back, when the slot holds no more than `--slot-prompt-similarity` of
        the incoming prompt (docs/config.md advises 0.95; at the default 0.1, only when it
        would keep less than half of the slot's).
        Measured on three hosts of two slots with 16 conversations, a number shared by the
        fewest saved a tenth of the prompt tokens that llama-server's own choice evaluated
        (bench/README.md, "4 Dec 2026"). A host found emptying its idle slots (a unified KV
        cache: `named_answered`) is told no slot until it is read anew. Its `--cache-ram`
        serves the conversations there better than any slot number.

        A conversation served on a host before the host was first read stays unnamed there
        (`LeaseTable.leave_to_host`): llama-server chose its slot, and finds it again by the
        prompt it holds, where its number might be an empty slot or another conversation's."""
        host, model = slot.host, key.model
        if self.name_slots and self.health.get(host).described is None:
            # Not read yet: llama-server puts the request where it likes, and the number its
            # conversation would keep may be another slot.
            await self.state.leave_to_host(key, host)
            return None
        namable = self._namable(host, model)
        if namable is None or self.slot_names.emptying(host, model, namable[1]):
            return None
        slots, described = namable
        number = await self.state.slot_number(key, host, slots)
        if number is None:
            return None
        in_flight = self.state.in_flight(host, model)
        return self.slot_names.name(number, key, slot, prefix, slots, described, in_flight)

    def slot_naming(self, host: str, model: str) -> bool | None:
        """Whether the conversations on `host` may be told their slots there (`id_slot`):
        False once the host was found emptying them (`named_answered`), until it is read
        anew; None where no slot is named at all (CROSSBAR_NAME_SLOTS off, a host whose
        `/props` gave no slots, a router, a model it does not serve)."""
        namable = self._namable(host, model)
        if namable is None:
            return None
        return not self.slot_names.emptying(host, model, namable[1])

    def _namable(self, host: str, model: str) -> tuple[int, Described] | None:
        """The slots `model` has on `host` to name (the fewer of its configured `parallel`
        and the slots its `/props` gave) and the host's description they come from; None
        where no slot is named at all (see `slot_naming`)."""
        config = self.config.hosts.get(host)
        described = self.health.get(host).described
        if (
            not self.name_slots
            or config is None
            or model not in config.models
            or described is None
            or described.router
            or not described.slots
        ):
            return None
        return min(config.models[model].parallel, described.slots), described

    def named_answered(
        self,
        named: NamedSlot,
        prompt_tokens: int | None,
        cached_tokens: int | None,
        predicted: int | None,
        reported: int | None,
    ) -> None:
        """What the host reported for a request that named a slot, once its answer ended well
        (status under 400); `predicted` and `reported`: the blocks of its prompt the prefix
        index expected there and the host reported cached (`prefix_check`). A host found
        emptying its idle slots is named no more until it is read anew; an answer that lost
        its cache (`is_cache_lost`) to another conversation's opening left in the slot is
        counted (`shared_slot_lost`): `SlotNames.answered`."""
        lost = is_cache_lost(predicted, reported)
        self.slot_names.answered(named, prompt_tokens, cached_tokens, predicted, reported, lost)

    def shared_slot_lost(self, host: str, model: str) -> int:
        """How many answers on `host` for `model` found only what they share with the
        conversation that used their named slot last (`named_answered`), since the host was
        last read (it came up, or changed): a host restarted with another
        --slot-prompt-similarity starts again from 0."""
        return self.slot_names.shared_lost(host, model, self.health.get(host).described)

    def fallback_of(self, route: RouteConfig) -> RouteConfig | None:
        """The route's fallback route, when it names an enabled one."""
        fallback = self.config.routes.get(route.fallback) if route.fallback else None
        return fallback if fallback is not None and fallback.enabled else None

    # -- the facts behind a host's place ---------------------------------------------------

    def _candidate(self, name: str, model: str | None) -> Candidate | None:
        """One host as the chooser sees it for `model`; None when it is unknown or disabled."""
        host = self.config.hosts.get(name)
        if host is None or not host.enabled:
            return None
        evicts_busy = crowded = False
        answers = True
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
                known is None or any(name in known for name in host_names(spec))
            )
            free = self.state.free_for(name, model) if can_serve else 0
            queued = self.state.queued(name, model)
            evicts_busy = can_serve and not loaded and self._evicts_busy(host, health)
            crowded = spec is not None and self.state.leases_held(name, model) >= spec.parallel
            answers = spec is None or _answers(host, spec, health)
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
            crowded=crowded,
            answers=answers,
        )

    def _evicts_busy(self, host: HostConfig, health: HostHealth) -> bool:
        """Whether loading one more model on this router-mode host would unload a busy one:
        it holds its most models already, and each has requests or leased conversations."""
        described = health.described
        if described is None or not described.router or not described.max_models:
            return False
        running = [  # by id: a model's aliases are the same instance
            upstream
            for upstream in described.aliases or described.models
            if described.models.get(upstream) in (ModelState.LOADED, ModelState.LOADING)
        ]
        if len(running) < described.max_models:
            return False
        by_upstream = {
            name: m.name for m in host.models.values() for name in reversed(host_names(m))
        }
        return all(
            (name := by_upstream.get(upstream)) is not None
            and (
                self.state.in_flight(host.name, name)
                or self.state.queued(host.name, name)
                or self.state.leases_held(host.name, name)
            )
            for upstream in running
        )


def not_loaded(host: HostConfig, model: str, health: HostHealth) -> str:
    """Why `host` would not serve a request for `model` (one it lists) as it stands now: ""
    when it would (`_answers`), else "loading" (a load under way there) or "unloaded"."""
    spec = host.models.get(model)
    if spec is None or _answers(host, spec, health):
        return ""
    described = health.described
    names = host_names(spec)
    if described is not None and any(
        described.models.get(name) is ModelState.LOADING for name in names
    ):
        return "loading"
    return "unloaded"


def _answers(host: HostConfig, model: ModelConfig, health: HostHealth) -> bool:
    """Whether `host` would serve a request for `model` as it stands: the model is loaded there
    (or the host did not say which it has), or the host loads models on demand. Else it would
    refuse it, and the request goes where the model is loaded, or is refused with
    `model_not_loaded` (`routing.proxy.refusal`). A llama-server router started with
    --no-models-autoload answers 400 "model is not loaded" for a model it holds unloaded, and
    sends a request for one still loading straight to its instance, which answers 503
    "Loading model" until the load ends (it listens before it loads: tools/server/server.cpp
    and server-models.cpp, `router_validate_model` and `proxy_post`, build 11434), so a load
    under way serves nothing yet either."""
    known = health.loaded
    if known is None or any(name in known for name in host_names(model)):
        return True
    return loads_on_demand(host, health.described)


def loads_on_demand(host: HostConfig, described: Described | None) -> bool:
    """Whether `host` loads a model a request names that it has not loaded. A router's own
    word (`models_autoload` in its /props) wins over the operator's setting: it is what the
    host will do with the request, and the setting can be stale (a host restarted with other
    flags). The setting speaks for hosts that say nothing (a proxy in front of llama-server,
    another engine); without either, yes, as a host that lists a model it has not loaded was
    always taken to do."""
    if described is not None and described.autoload is not None:
        return described.autoload
    return host.loads_on_demand is not False


def host_names(model: ModelConfig) -> tuple[str, ...]:
    """The names a host may list the model by: the one it is sent as, then its aliases."""
    return (model.upstream_name or model.name, *model.aliases)
