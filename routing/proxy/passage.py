"""The one way from a placed (or waiting) request to the host's response head.

Both ways of waiting go through here: the silent wait awaits `Passage.through()`; the wait that
streams status comments runs the same coroutine as a task and reports on `Passage.waiting`
meanwhile. A host that refuses or resets the connection before any response byte is marked down
(by `forward`) and the request is placed again on another usable host (its lease moves), unless
the route is `sticky = strict`, which answers `pinned_host_down`.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import httpx

from routing.config.shape import RouteConfig
from routing.core.errors import HostDown, HostRemoved, NoHealthyHost, PinnedHostDown, QueueFull
from routing.core.leases import LeaseKey, LeaseOutcome
from routing.core.named_slots import NamedSlot
from routing.core.placement import Placement, Placer, Waiting
from routing.proxy import upstream
from routing.proxy.ask import Ask
from routing.proxy.prefix_check import predicted
from routing.proxy.record import Trail
from routing.proxy.refusal import explained
from routing.proxy.relay import close_soon
from routing.runtime import Runtime

Forward = Callable[[Runtime, Ask, "str | None", str, "int | None"], Awaitable[httpx.Response]]
"""How a passage asks a host (`routing.proxy.upstream.forward`; a model of the request path
in the tests stands in its own hosts)."""

# The leases that keep the conversation on the host serving it (a spill serves it elsewhere).
_AT_HOME = frozenset({LeaseOutcome.NEW, LeaseOutcome.REUSED, LeaseOutcome.MOVED})


@dataclass(slots=True, frozen=True)
class Answered:
    """A host's response head, where it came from, and the request's trail up to it."""

    upstream: httpx.Response
    placement: Placement | None  # None for requests that take no slot
    trail: Trail

    def give_back(self) -> None:
        """Give back what the answer holds, for a request that will not relay it: its slot,
        and the host's response (closed in a background task). Safe to call again."""
        if self.placement is not None:
            self.placement.slot.release()
        close_soon(self.upstream)


class Passage:
    """Wait for a slot if needed, then ask the host; place again while hosts are found down.

    `waiting` is the current wait (None while the request holds a slot or takes none), for a
    status view. Raises what placement and forwarding raise; a slot is never left held by a
    failure or a cancellation.
    """

    def __init__(
        self,
        runtime: Runtime,
        route: RouteConfig,
        ask: Ask,
        trail: Trail,
        placer: Placer | None,
        first: Placement | Waiting | None,
        forward: Forward = upstream.forward,
    ) -> None:
        self.runtime = runtime
        self.forward = forward
        self.route = route
        self.ask = ask
        self.trail = trail
        self.placer = placer
        self.waiting: Waiting | None = None
        self._first = first
        if isinstance(first, Waiting):
            self._waits(first)

    async def through(self) -> Answered:
        """The host's response head. Each attempt owns the slot it was placed on: it hands it
        to the `Answered` it returns, or gives it back on every other way out. A host that
        fails before its head is marked down (by `forward`), so the next `now()` places the
        request elsewhere, or makes it wait (a route with a fallback); nothing here counts
        attempts, since the route's `queue_timeout` bounds how long a request may wait."""
        if self.placer is None:
            return await self._unplaced()
        placer, current = self.placer, self._first
        assert current is not None
        while True:
            try:
                placement = await self._slot(placer, current)
            except HostRemoved as removed:
                current = await self._moved_off(placer, removed)
                continue
            trail = self.trail = predicted(self.trail.placed(placement), self.runtime)
            try:
                named = await self._named_slot(placement)
                # Most requests name none: no other trail to build, unless an earlier attempt
                # (on a host found down since) named one, which this attempt's must replace.
                if named is not None or trail.named_slot is not None:
                    trail = self.trail = trail._replace(named_slot=named)
                id_slot = None if named is None or not named.told else named.number
                upstream = await self.forward(
                    self.runtime, self.ask, placement.model, placement.host, id_slot
                )
            except HostDown as down:
                placement.slot.release()
                if self.route.strict:
                    raise PinnedHostDown(placement.host) from None
                current = await self._again(placer, down)
                continue
            except BaseException:
                placement.slot.release()
                raise
            return Answered(upstream, placement, self._answered(trail))

    async def _named_slot(self, placement: Placement) -> NamedSlot | None:
        """The slot to name on the host: the conversation's own there, when it is served on its
        lease's host and the host keeps one for it (`LiveFleet.id_slot`); the client's own
        `id_slot`, when it names one, goes as sent."""
        ask = self.ask
        if (
            not ask.fingerprint
            or placement.lease not in _AT_HOME
            or placement.fallback
            or not ask.names_slot
            or "id_slot" in (ask.payload or ())
        ):
            return None
        key = LeaseKey(placement.route, ask.fingerprint, placement.model)
        return await self.runtime.live.id_slot(key, placement.slot, ask.prefix)

    async def _slot(self, placer: Placer[RouteConfig], current: Placement | Waiting) -> Placement:
        """The attempt's slot: at once, or after waiting for it (shown on `waiting`)."""
        if isinstance(current, Placement):
            return current
        self._waits(current)
        try:
            return await placer.wait(current)
        finally:
            self.waiting = None

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
        one), no lease; a host found down is skipped for the next."""
        if self.ask.host:  # an operator asking one host, whatever its health says
            return await self._ask(self.ask.host)
        tried: set[str] = set()
        if self._next_host(tried) is None:
            await self.runtime.probe_down(self.route)  # a host may just have come back
        failure: HostDown | None = None
        while (host := self._next_host(tried)) is not None:
            try:
                return await self._ask(host)
            except HostDown as down:  # marked down: the next ranking leaves it out
                tried.add(host)
                failure = down
        raise failure or NoHealthyHost()

    def _next_host(self, tried: set[str]) -> str | None:
        for host in self.runtime.live.ranking(self.route, self.ask.model).hosts():
            if host not in tried:
                return host
        return None

    async def _ask(self, host: str) -> Answered:
        trail = self.trail = self.trail._replace(host=host)
        if trail.running is not None:
            trail.running.table.placed(trail.running, host, 0, self.ask.model or "")
        upstream = await self.forward(self.runtime, self.ask, self.ask.model, host, None)
        return Answered(upstream, None, self._answered(trail))

    def _waits(self, waiting: Waiting) -> None:
        """The request waits: a status view sees it, and a row for a wait that fails names
        where it waited."""
        self.waiting = waiting
        self.trail = self.trail._replace(
            host=waiting.host, lease=str(waiting.lease), placement=str(waiting.reason)
        )
        if self.trail.running is not None:
            self.trail.running.table.waits(self.trail.running, waiting.waiter)

    def _answered(self, trail: Trail) -> Trail:
        self.trail = trail._replace(ttfb_ms=int((time.perf_counter() - trail.arrival.t0) * 1000))
        return self.trail
