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

import logging
from collections.abc import Callable, Mapping

from accounting.report import is_cache_lost
from hosts.describe import Described, ModelState
from hosts.health import HealthTable, HostHealth
from routing.config.shape import Fleet, HostConfig, ModelConfig, RouteConfig, renamed_hosts
from routing.core.choose import Candidate
from routing.core.leases import LeaseKey
from routing.core.named_slots import (
    NamedSlot,
    chooses_the_empty_slot,
    common_blocks,
    found_emptied,
    kept_only_shared,
    waits_for_its_slot,
)
from routing.core.patience import Figures, prefill
from routing.core.prefixes import Prefix, PrefixIndex
from routing.core.ranking import Ranking, Rankings
from routing.core.state import FleetState, Held

log = logging.getLogger("crossbar.slots")

# Builds the fleet state, given what it must call when a host's counts change.
MakeState = Callable[[Callable[[str], None]], FleetState]


class LiveFleet:
    """The configured fleet, its health and its state, and the rankings kept from them."""

    def __init__(
        self,
        config: Fleet,
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
        self.health = HealthTable(on_eligible=self._usable_again, on_change=touch)
        # What each host's KV cache holds, as this process has seen it (routing/core/prefixes.py);
        # with shared state too, each process keeps its own (docs/replicas.md).
        self.prefixes = prefixes
        self.prefix_margin = prefix_margin
        # The hosts' recent service times and prompt speeds, for priced patience
        # (routing/core/patience.py); with shared state too, each process keeps its own.
        self.figures = figures
        self.name_slots = name_slots  # CROSSBAR_NAME_SLOTS: see `id_slot`
        # CROSSBAR_SLOT_PROMPT_SIMILARITY: the hosts' --slot-prompt-similarity (`id_slot`).
        self.slot_similarity = slot_similarity
        # (host, model, number) -> the last request that named it here.
        self._named: dict[tuple[str, str, int], NamedSlot] = {}
        # (host, model, number) -> the host's description when that slot was last found
        # emptied between two named requests (routing/core/named_slots.py), and (host,
        # model) -> the description when one slot was found so twice: named no more until
        # the host is read anew.
        self._emptied: dict[tuple[str, str, int], object] = {}
        self._emptying: dict[tuple[str, str], object] = {}
        # (host, model) -> the host's description and the answers since it was read that found
        # only what they share with the slot's last conversation, and the description when
        # that was last logged.
        self._shared_lost: dict[tuple[str, str], tuple[object, int]] = {}
        self._shared_logged: dict[tuple[str, str], object] = {}
        self.config = config
        self._route_hosts: dict[str, frozenset[str]] = {}  # by route name, for `usable`
        # Every name each route serves a model by, to the model's own (`Fleet.route_names`).
        self._served: dict[str, Mapping[str, str]] = {}
        self.apply(config)

    def apply(self, config: Fleet) -> None:
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

    def serves(self, route: RouteConfig, model: str) -> bool:
        """Whether any enabled host of the route serves the model under this, its own, name."""
        return self._served.get(route.name, {}).get(model) == model

    def served(self, route: RouteConfig) -> Mapping[str, str]:
        """Every name the route's enabled hosts serve a model by (its own or an alias), to the
        model's own name, kept at each reload: a request asks, and `Fleet.route_names` walks
        every host of the route (4.5% of a request's CPU on 200)."""
        return self._served.get(route.name, {})

    def usable(self, route: RouteConfig, model: str, name: str) -> bool:
        """Whether a host may take new work for this route and model right now."""
        host = self.config.hosts.get(name)
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
        self.state.expire_leases()  # the lease counts as of now
        return self.rankings.of(route.name, route.hosts, model)

    async def id_slot(self, key: LeaseKey, slot: Held, prefix: Prefix) -> NamedSlot | None:
        """The slot to name (llama-server's `id_slot`) for a request of the conversation `key`
        that holds `slot` on its lease's host, whose prompt is `prefix`: the number it keeps
        there (with a slot for each conversation leased to the host, a number of its own; with
        more, shared with as few as can be). None, and llama-server chooses as it does for a
        request that names none, where no slot is named (`slot_naming`), while another
        request runs in that slot and waiting for it is not priced sooner (`_waits_for`), or
        while a request runs on the host in a slot llama-server chose (`_unplaced_by_us`).

        Only a host whose `/props` gave its slots (a llama-server, not in router mode) is
        told a slot. Conversations sharing a slot take turns in it: llama-server saves the
        prompt a slot holds to its `--cache-ram` before another overwrites it, and loads the
        incoming one's back, when the slot holds no more than `--slot-prompt-similarity` of
        the incoming prompt (docs/config.md advises 0.95; at the default 0.1, only when it
        would keep less than half of the slot's).
        Measured on three hosts of two slots with 16 conversations, a number shared by the
        fewest saved a tenth of the prompt tokens that llama-server's own choice evaluated
        (bench/README.md, "4 Dec 2026"). A slot still empty is not named where
        llama-server would give the request an empty slot itself, loaded from `--cache-ram`
        (`_lands_in_empty`). A host found emptying its idle slots (a unified KV
        cache: `named_answered`) is told no slot until it is read anew. Its `--cache-ram`
        serves the conversations there better than any slot number.

        (What runs in a slot is known in this process only: with shared state, two processes
        may each name it.)"""
        host, model = slot.host, key.model
        namable = self._namable(host, model)
        if namable is None or self._emptying.get((host, model)) is namable[1]:
            return None
        slots, described = namable
        number = await self.state.slot_number(key, host, slots)
        if number is None:
            return None
        where = (host, model, number)
        last = self._named.get(where)
        running = last if last is not None and not last.slot.released else None
        if running is None and self._unplaced_by_us(host, model, slots):
            return None
        if running is not None and not self._waits_for(running, prefix, slots):
            return None
        # An answer ended there since the host was read: the slot holds its prompt, and what
        # came after it. Where the request before named none (`told`), only as foreseen, so a
        # turn finding nothing there does not say the host empties its slots.
        holds = last is not None and last.answered and last.described is described
        filled = holds and last is not None and last.told
        told = (
            holds
            or running is not None
            or not self._lands_in_empty(where, prefix, slots, described)
        )
        took = last.prefix if last is not None and holds and last.key != key else None
        named = NamedSlot(
            number, key, slot, described, filled, prefix, running, took=took, told=told
        )
        self._named[where] = named  # one entry per slot of the fleet at most
        return named

    def _unplaced_by_us(self, host: str, model: str, slots: int) -> bool:
        """Whether a request runs on the (host, model) in a slot llama-server chose (one
        spilled there, or told no slot), besides the one being named: it may be in any slot
        not known busy. A request naming a busy slot waits for it in llama-server however idle
        the others are (its task is deferred until that slot is free), so a slot is named
        free only when the slots of every other request there are known. The slots' holders
        named here, and those waiting behind them, are known; the rest of `in_flight` (the
        other processes' too, with shared state) is not."""
        known = 0
        for number in range(slots):
            named = self._named.get((host, model, number))
            while named is not None and not named.slot.released:
                known += named.told
                named = named.behind
        return self.state.in_flight(host, model) - 1 > known

    def _lands_in_empty(
        self, where: tuple[str, str, int], prefix: Prefix, slots: int, described: Described
    ) -> bool:
        """Whether a request for the slot `where`, which holds nothing this process knows of,
        would be put there by llama-server if it named none (`chooses_the_empty_slot`).

        Only where every other slot of the host is known here: busy (llama-server passes it
        by), or idle with the prompt of the answer that ended in it since the host was read. An
        unknown one may be empty too, and of two empty slots llama-server takes the one with
        the higher number (its least recently used, on a tie, is the last it looks at)."""
        host, model, number = where
        idle: list[Prefix] = []
        for n in range(slots):
            if n == number:
                continue
            other = self._named.get((host, model, n))
            if other is not None and not other.slot.released:
                continue
            if other is None or not other.answered or other.described is not described:
                return False
            idle.append(other.prefix)
        return chooses_the_empty_slot(prefix, idle, self.slot_similarity)

    def _waits_for(self, running: NamedSlot, prefix: Prefix, slots: int) -> bool:
        """Whether a request with the prompt `prefix` should wait for its slot, which
        `running` holds (routing/core/named_slots.py, `waits_for_its_slot`). Naming a busy
        slot holds the request inside llama-server until the slot is free, while another
        slot may sit idle: a conversation's parallel request, or one whose slot another
        conversation is using, waits only when reading its prompt in another slot, and what
        that slot's conversation would lose there, would take longer. Never behind a request
        that is itself waiting, and never without the figures to price it (a host that has not
        answered yet, an engine without `timings`)."""
        host, model, size = running.host, running.key.model, prefix.block_size
        service = self.figures.service(host, model)
        speed = self.figures.speed(host)
        per_token = self.figures.units_per_token(model, size)
        waiting = running.behind is not None and not running.behind.slot.released
        if waiting or not service or not speed or not per_token or not prefix.blocks:
            return False
        tokens = prefix.length / per_token
        at_home = self.prefixes.match(host, model, prefix.blocks) * size / per_token
        # The free slot that holds the most of the prompt, of those named here: llama-server
        # puts an unnamed request in the one whose prompt it shares the most of. A slot not
        # named here (or whose prompt is counted in other units) is taken to hold nothing of
        # it, and nothing to lose.
        others = (self._named.get((host, model, number)) for number in range(slots))
        free = [
            other.prefix
            for other in others
            if other is not None and other.slot.released and other.prefix.block_size == size
        ]
        shared, there = max(
            ((common_blocks(prefix.blocks, other.blocks), other) for other in free),
            key=lambda found: found[0],
            default=(0, None),
        )
        held = shared * size / per_token
        # What the free slot's own conversation loses there, and reads again on its next turn.
        lost = 0.0 if there is None else prefill(there.length / per_token, held, speed)
        return waits_for_its_slot(
            service, prefill(tokens, at_home, speed), prefill(tokens, held, speed) + lost
        )

    def slot_naming(self, host: str, model: str) -> bool | None:
        """Whether the conversations on `host` may be told their slots there (`id_slot`):
        False once the host was found emptying them (`named_answered`), until it is read
        anew; None where no slot is named at all (CROSSBAR_NAME_SLOTS off, a host whose
        `/props` gave no slots, a router, a model it does not serve)."""
        namable = self._namable(host, model)
        if namable is None:
            return None
        return self._emptying.get((host, model)) is not namable[1]

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
        index expected there and the host reported cached (`prefix_check`). A request to
        a filled slot that took no token from cache found it emptied; a slot found so a second
        time since the host was read says the host empties its idle slots (a unified KV
        cache), and its slots are named no more until it is read anew (after it was down, or
        changed). Found once, it may have been a restart the poller did not see. A request
        that lost its cache there (`is_cache_lost`: more than a block under the prediction)
        and found only what it shares with the conversation that used the slot last, where
        its own history was expected (`kept_only_shared`), is counted for the host
        (`shared_slot_lost`), and the first such answer since the host was read is logged
        with the setting that keeps it. An answer without counts says nothing."""
        if cached_tokens is None:
            return
        named.answered = True
        if is_cache_lost(predicted, reported) and kept_only_shared(named, predicted, reported):
            self._kept_shared(named)
        if not found_emptied(named, prompt_tokens, cached_tokens):
            return
        where, pair = (named.host, named.key.model, named.number), (named.host, named.key.model)
        if self._emptied.get(where) is not named.described:
            self._emptied[where] = named.described  # one entry per slot of the fleet at most
            return
        if self._emptying.get(pair) is not named.described:
            log.warning(
                "host=%s model=%s emptied slot %d twice between named requests (a unified KV "
                "cache: llama-server's default without -np, or --kv-unified): its slots are "
                "no longer named, and llama-server chooses them from its --cache-ram",
                named.host, named.key.model, named.number,
            )  # fmt: skip
        self._emptying[pair] = named.described

    def _kept_shared(self, named: NamedSlot) -> None:
        pair = (named.host, named.key.model)
        since, count = self._shared_lost.get(pair, (named.described, 0))
        if since is not named.described:  # read anew since: what was counted is of the past
            count = 0
        self._shared_lost[pair] = (named.described, count + 1)  # one per (host, model)
        if self._shared_logged.get(pair) is named.described:
            return
        self._shared_logged[pair] = named.described
        log.warning(
            "host=%s model=%s gave a conversation back only what it shares with the one that "
            "used its named slot %d last, where its own history was expected: start "
            "llama-server with --slot-prompt-similarity 0.95 so that it loads each "
            "conversation back from --cache-ram (or give it a larger --cache-ram)",
            named.host, named.key.model, named.number,
        )  # fmt: skip

    def shared_slot_lost(self, host: str, model: str) -> int:
        """How many answers on `host` for `model` found only what they share with the
        conversation that used their named slot last (`named_answered`), since the host was
        last read (it came up, or changed): a host restarted with another
        --slot-prompt-similarity starts again from 0."""
        since, count = self._shared_lost.get((host, model), (None, 0))
        return count if since is not None and since is self.health.get(host).described else 0

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
                known is None or any(name in known for name in _host_names(spec))
            )
            free = self.state.free_for(name, model) if can_serve else 0
            queued = self.state.queued(name, model)
            evicts_busy = can_serve and not loaded and self._evicts_busy(host, health)
            crowded = spec is not None and self.state.leases_held(name, model) >= spec.parallel
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
            name: m.name for m in host.models.values() for name in reversed(_host_names(m))
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


def _host_names(model: ModelConfig) -> tuple[str, ...]:
    """The names a host may list the model by: the one it is sent as, then its aliases."""
    return (model.upstream_name or model.name, *model.aliases)
