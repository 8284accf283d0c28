"""Placement: which host serves a request, and the slot it holds there.

A request with a conversation first looks up its lease (the cache-warm "home" host). Then, in
one step (`FleetState.place`: in one process nothing suspends in between; across processes one
atomic script in Redis), so no other request can take the place meanwhile:

- home usable, a free slot there: taken (`home`);
- home busy, room in its queue: the request queues at home; after the route's
  `lease_patience` it also watches the route's other hosts and takes the first slot freed there
  (`spilled`, the lease stays home unless home holds more conversations per slot than that host
  would with this one: then it goes along). With `lease_patience` auto (None), it watches them at
  once, and a free slot there takes it only when its cold start is priced lower than the wait
  in line (`routing.core.priced_wait`; the fixed default for a host without figures);
- home's queue full: the first other usable host with a free slot, else with room in its queue
  (`spilled`); `QueueFull` only when every usable host is full;
- no lease, or home down/draining: the hosts ranked by the chooser (`routing.core.choose`),
  the first with a free slot, else the first with room in its queue (`new`, or `moved`;
  a `sticky = strict` route refuses with `PinnedHostDown` instead of moving). A host whose
  cache holds more of the prompt than the best-ranked host's, within the load margin, goes
  first (`routing.core.affinity`: `prefix` when it takes the request); so also for a request
  with no conversation.

A waiting request is woken only by events: a slot freed where it may go (the limiter hands it
over), a host becoming usable again (`Limiter.wake`), its place in line moving (priced
patience only), or its own deadlines as loop timers: patience (auto: the fixed default, for
the hosts without figures), `fallback_after` (it then also watches the fallback route's hosts
for `fallback_model` and takes the first free slot there: `fallback`), and `queue_timeout`
(`QueueTimeout`). A route with a fallback waits, rather than refusing, while it has no usable
host: it watches its hosts until one comes back or the fallback takes it.

Pure: standard library and asyncio only. Call from the request's event loop. The fleet's
state is `routing.core.state.FleetState`: in-process, or shared through Redis.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Generic, Protocol, TypeVar

from routing.core.affinity import Affinity, prefer_in
from routing.core.errors import NoHealthyHost, PinnedHostDown, QueueFull, QueueTimeout
from routing.core.fairness import ANONYMOUS, Share
from routing.core.leases import LeaseKey, LeaseOutcome
from routing.core.limiter import Pair
from routing.core.opening import Opening, keep_or_give_back
from routing.core.patience import DEFAULT_PATIENCE, Pricing
from routing.core.placed import Placement, Reason, Waiting
from routing.core.prefixes import PrefixIndex
from routing.core.priced_wait import PricedWait
from routing.core.ranking import Ranking
from routing.core.state import FleetState, Held, InLine

__all__ = ["Placement", "Placer", "Reason", "Waiting"]


class RouteRules(Protocol):
    """What placement reads of a route (`routing.config.shape.RouteConfig` is one)."""

    @property
    def name(self) -> str: ...
    @property
    def lease_ttl(self) -> float: ...
    @property
    def strict(self) -> bool: ...
    @property
    def queue_timeout(self) -> float: ...
    @property
    def lease_patience(self) -> float | None: ...  # None: auto (priced)
    @property
    def fallback(self) -> str: ...
    @property
    def fallback_after(self) -> float: ...
    @property
    def fallback_model(self) -> str: ...


# A fleet takes and gives back its own route type (RouteConfig for the runtime): methods typed
# with RouteRules itself would demand that every fleet accept any kind of route.
RouteT = TypeVar("RouteT", bound=RouteRules)


class Fleet(Protocol[RouteT]):
    """The live fleet as placement sees it (`routing.live_fleet.LiveFleet` is one)."""

    @property
    def state(self) -> FleetState: ...
    @property
    def prefixes(self) -> PrefixIndex:
        """What each host's KV cache holds (routing/core/prefixes.py)."""
        ...

    @property
    def prefix_margin(self) -> int:
        """How much more load than the best-ranked host a host holding more of the prompt may
        carry and still go first (routing/core/affinity.py)."""
        ...

    def ranking(self, route: RouteT, model: str) -> Ranking:
        """The route's usable hosts for `model`, best first (`routing.core.ranking`)."""
        ...

    def usable(self, route: RouteT, model: str, host: str) -> bool:
        """Whether `host` may take new work for this route and model right now."""
        ...

    def fallback_of(self, route: RouteT) -> RouteT | None:
        """The route's fallback route, when it has an enabled one."""
        ...


class Placer(Generic[RouteT]):
    """Places one request of `route` for `model`: `now()`, then `wait()` when it must wait.

    `prompt`: the prompt's block chain (routing/core/prefixes.py), for prefix affinity; empty
    for none. `pricing`: the request's prices, for a route whose patience is auto; without it
    such a route waits the fixed default.
    """

    def __init__(
        self,
        fleet: Fleet[RouteT],
        route: RouteT,
        model: str,
        fingerprint: str,
        started: float,
        prompt: tuple[int, ...] = (),
        pricing: Pricing | None = None,
        share: Share = ANONYMOUS,
    ) -> None:
        self.fleet = fleet
        self.prompt = prompt
        self.share = share  # whose share it counts against in a host's line
        self.route = route
        self.model = model
        self.key = LeaseKey(route.name, fingerprint, model) if fingerprint else None
        self.started = started  # loop time of the request's arrival
        self._home: str | None = None  # the usable lease host the last `now()` found
        self._fallback: RouteT | None = None  # set once `fallback_after` has passed
        self._fallback_pairs: set[Pair] = set()
        self._pricing = pricing
        self._priced: PricedWait | None = None  # priced patience over the current wait

    async def now(self) -> Placement | Waiting:
        """A placement, or a `Waiting` holding the request's place, taken in one step.

        Raises QueueFull (every usable host full), NoHealthyHost or PinnedHostDown (when the
        route has no fallback to wait for).
        """
        ranking = self._ranking()
        if self.key is None:
            order = ranking.hosts()
            if not order:
                return self._homeless(list(ranking.listed), Reason.NONE, LeaseOutcome.NONE,
                                      NoHealthyHost())  # fmt: skip
            affinity = self._affinity(ranking)
            got = await self.fleet.state.place(self._pairs_for(ranking, affinity), self.share)
            if got is None:
                raise QueueFull(ranking.hosts(), self.model)  # each was asked, each was full
            return self._result(got, self._by(affinity, got, Reason.NONE), LeaseOutcome.NONE)
        had_hosts = bool(ranking.hosts())
        affinity = self._affinity(ranking)
        opening = Opening(
            key=self.key,
            ttl=self.route.lease_ttl,
            pairs=self._pairs_for(ranking, affinity),
            usable=self._usable,
            unusable=ranking.unusable(),
            strict=self.route.strict,
            patient=self.route.lease_patience is None or self.route.lease_patience > 0,
            share=self.share,
        )
        opened = await self.fleet.state.open(opening)
        home = opened.home
        self._home = home if opened.at_home else None
        if opened.pinned:
            assert home is not None
            return self._homeless([home], Reason.HOME, LeaseOutcome.REUSED, PinnedHostDown(home))
        if opened.at_home:
            assert home is not None
            if opened.got is None:
                # Every usable host was asked (home alone when it is the only one): all full.
                others = [host for host in ranking.hosts() if host != home]
                raise QueueFull([home, *others], self.model)
            if opened.got.host != home:
                lease = LeaseOutcome.SPILLED
                if opened.got.held:
                    lease = await self._spilled(home, opened.got)
                return self._result(opened.got, Reason.SPILLED, lease)
            return self._result(opened.got, Reason.HOME, LeaseOutcome.REUSED)
        if home is not None:
            reason, lease = Reason.MOVED, LeaseOutcome.MOVED
        else:
            reason, lease = Reason.NEW, LeaseOutcome.NEW
        if opened.got is None:
            if not had_hosts:
                return self._homeless(list(ranking.listed), reason, lease, NoHealthyHost())
            raise QueueFull(ranking.hosts(), self.model)  # each was asked, each was full
        return self._result(opened.got, self._by(affinity, opened.got, reason), lease)

    async def wait(self, waiting: Waiting) -> Placement:
        """Wait for the slot: a grant, a deadline (QueueTimeout after the route's
        queue_timeout), or a free slot elsewhere that patience lets take it.

        Cancel-safe: a cancelled wait gives back its place, and a slot handed over in the same
        loop turn is released.
        """
        loop = asyncio.get_running_loop()
        waiter = waiting.waiter
        spills = bool(waiting.host) and len(self._ranking().listed) > 1  # other hosts to go to
        priced = self._priced = (
            PricedWait(self._pricing, waiter, self.model, self._free_elsewhere)
            if spills and self.route.lease_patience is None
            else None
        )
        fallback = self.fleet.fallback_of(self.route)
        timers = self._deadlines(waiting, fallback, spills)
        try:
            slot: Held = await self._granted(waiter)
        except BaseException:  # cancelled, or a deadline: a slot handed over meanwhile goes back
            granted = waiter.cancel()
            if granted is not None:
                granted.release()
            raise
        finally:
            for timer in timers:
                timer.cancel()
        if priced is not None and (slot.host, slot.model) == (waiting.host, self.model):
            priced.waited(loop.time())  # the grant's time, before any placing I/O
        placement = await self._placed_after(waiting, slot, fallback)
        if priced is None:
            return placement
        return replace(placement, patience=priced.choice(slot.host))

    def _deadlines(
        self, waiting: Waiting, fallback: RouteT | None, spills: bool
    ) -> list[asyncio.TimerHandle]:
        """The wait's timers: its queue timeout, its patience (priced: the fixed default, for
        the hosts without figures) and its fallback."""
        loop, waiter, started = asyncio.get_running_loop(), waiting.waiter, self.started
        timers = [loop.call_at(started + self.route.queue_timeout, self._time_out, waiter)]
        patience = self.route.lease_patience
        if self._priced is not None:
            default = self._pricing.default if self._pricing else DEFAULT_PATIENCE
            timers.append(loop.call_at(started + default, self._default_spent, waiter))
        elif spills and patience is not None:
            timers.append(loop.call_at(started + patience, self._spill, waiter))
        if fallback is not None:
            after = started + self.route.fallback_after
            timers.append(loop.call_at(after, self._fall_back, waiter, fallback))
        return timers

    async def _placed_after(
        self, waiting: Waiting, slot: Held, fallback: RouteT | None
    ) -> Placement:
        """The placement of a wait that ended with `slot`."""
        waited = asyncio.get_running_loop().time() - self.started
        own = slot.model == self.model and self._ranking().lists(slot.host)
        if fallback is not None and not own:
            return Placement(
                slot, Reason.FALLBACK, LeaseOutcome.NONE, fallback.name, slot.model, waited,
                fallback.name,
            )  # fmt: skip
        if waiting.host and slot.host != waiting.host and slot.host == self._home:
            # Queued elsewhere because home's queue was full, then handed home's slot.
            return Placement(slot, Reason.HOME, LeaseOutcome.REUSED, self.route.name,
                             self.model, waited)  # fmt: skip
        if waiting.host and slot.host != waiting.host:
            if waiting.reason in (Reason.NEW, Reason.MOVED, Reason.PREFIX):
                # No cache was warm where it queued: the conversation's cache starts here.
                await self._keep_lease(slot.host, slot)
                lease = waiting.lease
            else:
                lease = await self._spilled(self._home, slot)
            return Placement(slot, Reason.SPILLED, lease, self.route.name, self.model, waited)
        if waiting.reason is Reason.SPILLED:  # handed a slot in the line it spilled to
            lease = await self._spilled(self._home, slot)
            return Placement(slot, Reason.SPILLED, lease, self.route.name, self.model, waited)
        if not waiting.host:
            await self._keep_lease(slot.host, slot)
        return Placement(slot, waiting.reason, waiting.lease, self.route.name, self.model, waited)

    # -- the steps ------------------------------------------------------------------------

    def _homeless(
        self, hosts: list[str], reason: Reason, lease: LeaseOutcome, refusal: Exception
    ) -> Waiting:
        """No usable host now: wait for one of `hosts` (or the fallback), if the route may."""
        if not self.route.fallback or self.fleet.fallback_of(self.route) is None:
            raise refusal
        waiter = self.fleet.state.watcher(self.share)
        if waiter is None:  # shared state keeps no watch-only places: refuse as without one
            raise refusal
        pairs = [Pair(host, self.model) for host in hosts]
        self.fleet.state.watch(waiter, pairs, self._accepts)
        return Waiting(waiter, "", reason, lease)

    def _result(
        self, got: Held | InLine, reason: Reason, lease: LeaseOutcome
    ) -> Placement | Waiting:
        if got.held:
            # A slot at once spent no time in a line (a shared state's round trips are not one).
            return Placement(got, reason, lease, self.route.name, self.model, 0.0)
        return Waiting(got, got.host, reason, lease)

    async def _granted(self, waiter: InLine) -> Held:
        """The slot `waiter` is handed. A slot freed on a pair it watches is offered to it
        and decided here, in its own task (`settle`: `_accepts`). A priced wait is priced
        now (a free slot elsewhere priced lower takes it at once) and again each time its
        place in line moves."""
        moved, reprice = None, True
        if self._priced is not None:
            self._priced.begin(asyncio.get_running_loop().time())
            moved = waiter.changes()
        while not waiter.granted.done():
            if moved is not None and (reprice or moved.is_set()):
                moved.clear()  # before pricing: a move from here on wakes the wait below
                self._reprice(waiter)
            reprice = False
            waiter.settle()
            if waiter.granted.done():
                break
            moving = asyncio.ensure_future(moved.wait()) if moved is not None else None
            try:
                events = [waiter.granted, waiter.offered, *([moving] if moving else [])]
                await asyncio.wait(events, return_when=asyncio.FIRST_COMPLETED)
            finally:
                if moving is not None:
                    moving.cancel()
        granted: Held = waiter.granted.result()  # raises as awaiting it would
        return granted

    def _spill(self, waiter: InLine) -> None:
        """Patience spent (or priced): a slot freed on another usable host of the route may
        take it, as `_accepts` says. The hosts not usable now are watched too, last: one that
        comes back (a restart) offers its free slots at once, and a request moved into
        another's line while it was down would otherwise wait there while it idles."""
        ranking = self._ranking()
        out = ranking.unusable()
        pairs = [
            *ranking.pairs(),
            *(Pair(host, self.model) for host in ranking.listed if host in out),
        ]
        self.fleet.state.watch(waiter, pairs, self._accepts)

    def _default_spent(self, waiter: InLine) -> None:
        """Priced patience: the fixed default has passed, for the hosts without figures."""
        if self._priced is not None:
            self._priced.spend()
        self._reprice(waiter)

    def _reprice(self, waiter: InLine) -> None:
        """Price staying against the soonest free slot elsewhere (the choice the row keeps if
        the request stays), then offer the free slots elsewhere to `_accepts`."""
        if self._priced is None:
            self._spill(waiter)
            return
        with self._priced.repriced():  # the slots `_spill` finds free at once, priced once
            self._spill(waiter)

    def _free_elsewhere(self, *besides: str) -> Iterator[str]:
        """The route's usable hosts, but `besides`, with a free slot and an empty line now,
        found as they are read (a price may need only the first few)."""
        state, model = self.fleet.state, self.model
        return (
            host
            for host in self._ranking().listed
            if host not in besides
            and state.free_for(host, model) > 0
            and state.queued(host, model) == 0
            and self._usable(host)
        )

    def _fall_back(self, waiter: InLine, fallback: RouteT) -> None:
        """Waited `fallback_after`: a free slot of the fallback route may take it."""
        model = self.route.fallback_model or self.model
        pairs = list(self.fleet.ranking(fallback, model).pairs())
        self._fallback = fallback
        self._fallback_pairs.update(pairs)
        self.fleet.state.watch(waiter, pairs, self._accepts)

    def _time_out(self, waiter: InLine) -> None:
        timeout = self.route.queue_timeout
        waiter.fail(QueueTimeout(f"queue timeout: no slot for {self.model} within {timeout:g} s"))

    # -- helpers --------------------------------------------------------------------------

    def _ranking(self) -> Ranking:
        # Asked of the fleet each time: a reload replaces the rankings.
        return self.fleet.ranking(self.route, self.model)

    def _affinity(self, ranking: Ranking) -> Affinity | None:
        # The ranking read once: asking the fleet again would count the leases again.
        fleet, order = self.fleet, ranking.hosts()
        return prefer_in(fleet.state, order, self.model, self.prompt, fleet.prefixes,
                         fleet.prefix_margin, ranking.places())  # fmt: skip

    def _pairs_for(self, ranking: Ranking, affinity: Affinity | None) -> Sequence[Pair]:
        """The ranking's pairs, the affinity's host first when there is one."""
        if affinity is None:
            return ranking.pairs()
        first = Pair(affinity.host, self.model)
        return [first, *(pair for pair in ranking.pairs() if pair != first)]

    @staticmethod
    def _by(affinity: Affinity | None, got: Held | InLine, reason: Reason) -> Reason:
        """`prefix` when the host put first for its cache is the one that took the request."""
        return Reason.PREFIX if affinity is not None and got.host == affinity.host else reason

    def _usable(self, host: str) -> bool:
        return self.fleet.usable(self.route, self.model, host)

    def _accepts(self, pair: Pair) -> bool:
        """Whether a slot freed on `pair` may go to this request right now."""
        host, model = pair
        if model == self.model and self._usable(host):
            # Patience spent: any free slot; priced: one priced lower than staying.
            return self._priced is None or self._priced.takes(host)
        fallback = self._fallback
        return (
            fallback is not None
            and pair in self._fallback_pairs
            and self.fleet.usable(fallback, model, host)
        )

    async def _spilled(self, home: str | None, slot: Held) -> LeaseOutcome:
        """A turn of a conversation leased to `home` runs on `slot`'s host, which now holds
        its history. The lease stays with home's warm cache (SPILLED), unless home holds more
        conversations per slot than that host would with this one too: then the lease goes
        along (MOVED), or its turns would wait in the longer line every time while the other
        host idles between its own conversations' turns."""
        state, model, host = self.fleet.state, self.model, slot.host
        if home is None or self.key is None:
            return LeaseOutcome.SPILLED
        slots = {name: state.in_flight(name, model) + state.free_for(name, model)
                 for name in (home, host)}  # fmt: skip
        held_home, held_here = state.leases_held(home, model), state.leases_held(host, model)
        if (held_here + 1) * slots[home] > (held_home - 1) * slots[host]:
            return LeaseOutcome.SPILLED
        await self._keep_lease(host, slot)
        return LeaseOutcome.MOVED

    async def _keep_lease(self, host: str, got: Held | InLine) -> None:
        """Lease the conversation to `host`; a cancellation meanwhile gives back `got`."""
        if self.key is not None:
            await keep_or_give_back(
                self.fleet.state, self.key, host, self.route.lease_ttl, got, self._home
            )
