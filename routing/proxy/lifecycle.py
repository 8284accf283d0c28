"""One request's life, from its route to its row, in one owner.

Read top to bottom, this module is the life of a proxied request once the view has found its
route (docs/architecture.md, "One request"):

1. `routed`: the route is known; from here every way out but a path no route names writes the
   request's one row.
2. `admit`: the client key's pass, counted against the key's limits until the request ends.
3. `place`: the ask is known: its line among the running requests, then placement's first try
   (`routing.core.placement`): a slot now, a place in a queue, or a refusal, in one step.
   No usable host: its down hosts are asked how they are now, once, and the request tried
   again, then once more after a load of its model where one would serve it (`probing`).
   A request that takes no slot is not placed: `through` finds it a usable host likewise.
4. `through`: wait for the slot if needed (shown on `waiting`, for a status stream), then ask
   the host. A host that refuses or resets the connection before its head is marked down (by
   `forward`) and the request placed again by the same `Placer`, unless the route is
   `sticky = strict` (`pinned_host_down`). Each attempt owns the slot it was placed on: it
   passes it to the lifecycle with the host's head (`answered`), or gives it back on every
   other way out.
5. `respond` (or `relay`, for a status stream): the host's answer goes back through a `Relay`,
   which only moves bytes. It says when the host is done (`host_done`: the slot goes back
   while a slow client still reads the buffer) and how the answer ended (`end`).
6. `end(outcome)`: what the answer teaches (the hosts' figures, the prefix index, the named
   slots), then the row. `fail(exc)` is the one error ending: the refusal explained, the
   answer for the client, the row.

What the request holds is held here, never on its `Trail` (plain values): the client pass, its
running entry, a placement not yet taken up by an attempt, the slot and the host's response.
The first ending (`end` or `fail`, whichever comes first; later ones do nothing) gives back all
that is still held, once each; a slot and a response that arrive after it (an attempt whose
cancellation was lost on its way) are given back as they arrive.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import httpx

from routing.config.shape import RouteConfig
from routing.core.clients import Admitted, ClientSpec
from routing.core.errors import (
    Answer,
    HostDown,
    HostRemoved,
    NoHealthyHost,
    NotARoute,
    PinnedHostDown,
    QueueFull,
    answer_for,
)
from routing.core.fairness import ANONYMOUS, Work
from routing.core.patience import Pricing
from routing.core.placement import Placement, Placer, Waiting
from routing.core.refusals import unknown_model
from routing.core.running import RunningRequest
from routing.core.state import Held, charge, charge_later, on_lost
from routing.proxy import upstream
from routing.proxy.ask import Ask
from routing.proxy.figures import held, pricing
from routing.proxy.learning import learnt
from routing.proxy.loading import can_load, probing
from routing.proxy.naming import slot_to_name
from routing.proxy.prefix_check import predicted
from routing.proxy.record import Arrival, Outcome, Trail, finish
from routing.proxy.refusal import counted_where_it_happened, explained
from routing.proxy.relay import Relay, close_soon
from routing.proxy.respond import StreamedResponse, streamed
from routing.runtime import Runtime

Forward = Callable[[Runtime, Ask, "str | None", str, "int | None"], Awaitable[httpx.Response]]
"""How a host is asked (`routing.proxy.upstream.forward`; the tests' models stand in hosts)."""
Prices = Callable[[Runtime, RouteConfig, Ask], "Pricing | None"]
"""A request's prices for priced patience (`routing.proxy.figures.pricing`)."""

T = TypeVar("T")


@dataclass(slots=True, frozen=True)
class Answered:
    """A host's response head, where it came from, and the request's trail up to it."""

    upstream: httpx.Response
    placement: Placement | None  # None for requests that take no slot
    trail: Trail


class Lifecycle:
    """The one owner of one request, from its route to its row. Use it on its event loop.

    `trail` is what is known of the request so far; `waiting` its current wait (None while it
    holds a slot or takes none), for a status stream. `runtime` and `route` are given by
    `routed` (or at construction, by a test); `forward` and `prices` are the seams a test's
    model of the request path stands its own hosts and prices in."""

    __slots__ = (
        "trail", "runtime", "route", "ask", "waiting", "loading", "_forward", "_prices", "_routed",
        "_placer", "_next", "_pass", "_running", "_answered", "_slot", "_upstream", "_ended",
        "_share", "_charged",
    )  # fmt: skip

    runtime: Runtime
    route: RouteConfig
    ask: Ask

    def __init__(
        self,
        trail: Trail | None = None,
        runtime: Runtime | None = None,
        route: RouteConfig | None = None,
        *,
        forward: Forward = upstream.forward,
        prices: Prices = pricing,
    ) -> None:
        self.trail = trail if trail is not None else Trail(Arrival())
        self.waiting: Waiting | None = None
        self.loading = False  # placed nowhere yet: `through` waits for the model's load first
        self._forward = forward
        self._prices = prices
        self._routed = False
        self._placer: Placer[RouteConfig] | None = None  # None until placed, and without a slot
        self._next: Placement | Waiting | None = None  # placement's result, for `through`
        self._pass: Admitted | None = None
        self._running: RunningRequest | None = None
        self._answered: Answered | None = None
        self._slot: Held | None = None  # the answered placement's, until the host is done
        self._upstream: httpx.Response | None = None  # the host's, until a relay takes it
        self._ended = False
        self._share = ANONYMOUS  # whose share it counts against in a host's line
        self._charged: Held | None = None  # the answered slot, charged the work at the end
        if runtime is not None:
            self.runtime, self._routed = runtime, route is not None
        if route is not None:
            self.route = route

    # -- 1-3: route, client, placement's first try ------------------------------------------

    def routed(self, runtime: Runtime, route: RouteConfig) -> None:
        """The request's route is known (and the runtime serving it)."""
        self.runtime, self.route, self._routed = runtime, route, True
        self.trail = self.trail._replace(route=route.name)

    async def admit(self, client: ClientSpec | None) -> None:
        """The client key's pass (none without a key). Raises what `Runtime.admit` does."""
        if client is not None:
            self.trail = self.trail._replace(client=client.name)
            self._pass = await self.runtime.admit(client, self.route.name)
            self._share = client.share()

    async def place(self, ask: Ask) -> None:
        """The ask is known: its running entry, then placement's first try (a request that
        takes no slot is placed by `through`). Raises UnknownModel, QueueFull, NoHealthyHost
        or PinnedHostDown."""
        self.ask = ask
        running = self.runtime.running
        self._running = running.add(self.route.name, ask.model or "", self.trail.client)
        self.trail = self.trail._replace(
            model=ask.model or "", fingerprint=ask.fingerprint, prefix=ask.prefix
        )
        if ask.model is not None and not self.runtime.live.serves(self.route, ask.model):
            models = self.runtime.fleet.route_models(self.route)
            raise unknown_model(self.route.name, ask.model, models)
        self.runtime.arrived(ask.model)  # demand, for fleet model placement
        if ask.takes_slot:
            try:
                first = self._next = await probing(self, self._first_try, loads=False)
            except NoHealthyHost:
                # `through` waits for the load, so that a status stream hears it (`loading`).
                self.loading = can_load(self)
                if not self.loading:
                    raise
                return
            if isinstance(first, Waiting):
                self._waits(first)

    async def _first_try(self) -> Placement | Waiting:
        ask = self.ask
        assert ask.model is not None
        placer = self._placer = Placer(
            self.runtime.live, self.route, ask.model, ask.fingerprint,
            asyncio.get_running_loop().time(), ask.prefix.blocks,
            self._prices(self.runtime, self.route, ask), self._share,
        )  # fmt: skip
        return await placer.now()

    # -- 4: the host's head, placed again while hosts are found down ------------------------

    async def through(self) -> Answered:
        """The host's response head, which the lifecycle holds from then on (`answered`).
        Nothing here counts attempts: the route's `queue_timeout` bounds how long a request
        may wait. Raises what placement and forwarding raise."""
        if self.loading:
            try:
                self._next = await probing(self, self._first_try)
            finally:
                self.loading = False
        placer, current = self._placer, self._next
        if placer is None:
            return self.answered(await probing(self, self._unplaced))
        self._next = None  # the attempts own it now
        assert current is not None
        while True:
            try:
                placement = await self._slot_of(placer, current)
            except HostRemoved as removed:
                current = await self._moved_off(placer, removed)
                continue
            try:
                upstream = await self._ask_placed(placement)
            except HostDown as down:
                placement.slot.release()
                if self.route.strict:
                    raise PinnedHostDown(placement.host) from None
                current = await self._again(placer, down)
                continue
            except BaseException:
                placement.slot.release()
                raise
            return self.answered(Answered(upstream, placement, self._headed()))

    async def _slot_of(
        self, placer: Placer[RouteConfig], current: Placement | Waiting
    ) -> Placement:
        """The attempt's slot: at once, or after waiting for it (shown on `waiting`)."""
        if isinstance(current, Placement):
            return current
        self._waits(current)
        try:
            return await placer.wait(current)
        finally:
            self.waiting = None

    async def _ask_placed(self, placement: Placement) -> httpx.Response:
        """Ask the placement's host, naming the conversation's slot there when it has one."""
        trail = self.trail = predicted(self.trail.placed(placement), self.runtime)
        if self._running is not None:
            self._running.table.placed(
                self._running, placement.host, trail.queued_ms, placement.model
            )
        named = await slot_to_name(self.runtime, self.ask, placement)
        # Most requests name none: no other trail to build, unless an earlier attempt (on a
        # host found down since) named one, which this attempt's must replace.
        if named is not None or trail.named_slot is not None:
            self.trail = trail._replace(named_slot=named)
        id_slot = None if named is None or not named.told else named.number
        return await self._forward(self.runtime, self.ask, placement.model, placement.host, id_slot)

    async def _again(self, placer: Placer[RouteConfig], down: HostDown) -> Placement | Waiting:
        """Placed again after `down`; with no other host (and no fallback to wait for), the
        client hears which host failed, and how."""
        try:
            return await placer.now()
        except NoHealthyHost:
            raise down from None

    async def _moved_off(
        self, placer: Placer[RouteConfig], removed: HostRemoved
    ) -> Placement | Waiting:
        """Placed again after the host (or model) it waited for left the configuration; when
        no other host of the route can take it, refused with a 503 that says so, and why."""
        try:
            return await placer.now()
        except (QueueFull, NoHealthyHost, PinnedHostDown) as refusal:
            why = explained(self.runtime, self.route, self.ask.model, refusal)
            route = self.route.name
            raise HostRemoved(
                removed.host,
                removed.model,
                f"{removed.message}, and no other host of route {route} can take it: {why}",
                retry_after=getattr(why, "retry_after", None),
                detail=getattr(why, "detail", {}),
            ) from None

    async def _unplaced(self) -> Answered:
        """A request that takes no slot: the best usable host (serving its model, if it names
        one), no lease; a host found down is skipped for the next. Raises NoHealthyHost when
        no host is usable, else the last host's failure."""
        if self.ask.host:  # an operator asking one host, whatever its health says
            return await self._ask_unplaced(self.ask.host)
        tried: set[str] = set()
        failure: HostDown | None = None
        while (host := self._next_host(tried)) is not None:
            try:
                return await self._ask_unplaced(host)
            except HostDown as down:  # marked down: the next ranking leaves it out
                tried.add(host)
                failure = down
        raise failure or NoHealthyHost()

    def _next_host(self, tried: set[str]) -> str | None:
        for host in self.runtime.live.ranking(self.route, self.ask.model).hosts():
            if host not in tried:
                return host
        return None

    async def _ask_unplaced(self, host: str) -> Answered:
        self.trail = self.trail._replace(host=host)
        if self._running is not None:
            self._running.table.placed(self._running, host, 0, self.ask.model or "")
        upstream = await self._forward(self.runtime, self.ask, self.ask.model, host, None)
        return Answered(upstream, None, self._headed())

    def _waits(self, waiting: Waiting) -> None:
        """The request waits: a status stream sees it, and a row for a wait that fails names
        where it waited."""
        self.waiting = waiting
        self.trail = self.trail._replace(
            host=waiting.host, lease=str(waiting.lease), placement=str(waiting.reason)
        )
        if self._running is not None:
            self._running.table.waits(self._running, waiting.waiter)

    def _headed(self) -> Trail:
        self.trail = self.trail._replace(ttfb_ms=self.trail.arrival.elapsed_ms())
        return self.trail

    def answered(self, answered: Answered) -> Answered:
        """The host's head is in: its slot and response are the lifecycle's from here (given
        back at once if the request has ended meanwhile)."""
        self._answered, self._upstream = answered, answered.upstream
        slot = self._slot = answered.placement.slot if answered.placement is not None else None
        if self._ended:
            self._give_back()
        elif slot is not None:
            charge_later(slot)  # with what the host reports, once the answer has ended
            self._charged = slot
        return answered

    # -- 5: the host's answer, relayed ------------------------------------------------------

    def respond(self, origins: frozenset[str]) -> StreamedResponse:
        """The response that relays the host's answer. The server's handler closes it on every
        way out, which ends the request (`Relay.close`); until it is built, the host's
        response stays the lifecycle's, so a failure here is answered by `fail`."""
        relay, answered = self._relay(), self._answered
        assert answered is not None
        response = streamed(answered.upstream, self.trail, relay, origins)
        self._upstream = None  # the relay's to close from here
        return response

    def relay(self) -> Relay:
        """The relay of the host's answer, which closes the host's response from here."""
        relay, self._upstream = self._relay(), None
        return relay

    def _relay(self) -> Relay:
        answered = self._answered
        assert answered is not None
        relay = Relay(
            answered.upstream, self, self.trail.host, self.runtime.stream_idle_timeout,
            self._running,
        )  # fmt: skip
        if relay.streamed and not self.trail.streamed:
            self.trail = self.trail._replace(streamed=True)
        if self._slot is not None:
            on_lost(self._slot, relay.lost)
        return relay

    def streams_status(self) -> None:
        """The client hears how its wait goes, as an SSE stream (`routing.proxy.waiting`)."""
        self.trail = self.trail._replace(streamed=True)

    def host_done(self, work: Work | None = None) -> None:
        """The host is done with: its slot back, and how long it was held to the figures (a
        slow client may still be reading). `work`, when known, is charged to the request's
        key first, so the line picks who the slot goes to with it counted. Safe to call
        again."""
        slot = self._slot
        if slot is None:
            return
        self._slot = None
        if work is not None and self._charged is not None:
            charge(self._charged, work)
            self._charged = None
        held(self.trail, self.runtime)
        if self._running is not None:
            self._running.table.freed(self._running)  # what a slow reader still reads holds none
        slot.release()

    # -- 6: the end, and its row --------------------------------------------------------------

    def end(self, outcome: Outcome) -> None:
        """The request has ended: what the host's answer teaches, then its row; everything
        still held is given back. Only the first ending counts."""
        if self._ended:
            return
        self.host_done()
        trail = self.trail if self._answered is None else learnt(self.trail, self.runtime, outcome)
        self._close(outcome, trail)

    def fail(self, exc: Exception) -> Answer:
        """The one error ending: `exc` explained (a refusal says what, where and what to do),
        the client's answer, and the row, counted where it happened (a path no route names
        has none). Only the first ending writes a row."""
        if self._routed:
            exc = explained(self.runtime, self.route, self.trail.model or None, exc)
        answer = answer_for(exc)
        if not self._ended and not isinstance(exc, NotARoute):
            outcome = Outcome(answer.status, answer.message, answer.code)
            self._close(outcome, counted_where_it_happened(self.trail, exc))
        return answer

    def _close(self, outcome: Outcome, trail: Trail) -> None:
        self._ended = True
        self._give_back(outcome.tokens())
        if self._charged is not None:
            charge(self._charged, outcome.work())
            self._charged = None
        finish(trail, outcome)

    def _give_back(self, tokens: int = 0) -> None:
        """Give back what is still held, each once: the slot, the host's response (closed in
        a background task), a placement no attempt took up, the pass (with the `tokens` the
        request spent, counted against its key's budgets), the running entry."""
        self.host_done()
        if self._upstream is not None:
            close_soon(self._upstream)
            self._upstream = None
        first, self._next = self._next, None
        if isinstance(first, Placement):
            first.slot.release()
        elif first is not None:
            granted = first.waiter.cancel()  # its place in line, and a slot handed over
            if granted is not None:
                granted.release()
        if self._pass is not None:
            self._pass.release(tokens)
            self._pass = None
        if self._running is not None:
            self._running.table.finish(self._running)
            self._running = None
