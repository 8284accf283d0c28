"""The one way from a placed (or waiting) request to the host's response head.

Both ways of waiting go through here: the silent wait awaits `Passage.through()`; the wait that
streams status comments runs the same coroutine as a task and reports on `Passage.waiting`
meanwhile. A host that refuses or resets the connection before any response byte is marked down
(by `forward`) and the request is placed again on another usable host (its lease moves), unless
the route is `sticky = strict`, which answers `pinned_host_down`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import httpx

from routing.config.shape import RouteConfig
from routing.core.choose import ranked
from routing.core.errors import HostDown, NoHealthyHost, PinnedHostDown
from routing.core.placement import Placement, Placer, Waiting
from routing.proxy.ask import Ask
from routing.proxy.record import Trail
from routing.proxy.upstream import forward
from routing.runtime import Runtime


@dataclass(slots=True, frozen=True)
class Answered:
    """A host's response head, where it came from, and the request's trail up to it."""

    upstream: httpx.Response
    placement: Placement | None  # None for requests that take no slot
    trail: Trail


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
    ) -> None:
        self.runtime = runtime
        self.route = route
        self.ask = ask
        self.trail = trail
        self.placer = placer
        self.waiting = first if isinstance(first, Waiting) else None
        self._first = first
        if self.waiting is not None:  # a row for a wait that fails names where it waited
            self.trail = replace(
                trail,
                host=self.waiting.host,
                lease=str(self.waiting.lease),
                placement=str(self.waiting.reason),
            )

    async def through(self) -> Answered:
        if self.placer is None:
            return await self._unplaced()
        placer, current = self.placer, self._first
        assert current is not None
        # Each failed attempt marks a host down, so the hosts run out: a bounded loop.
        for _ in range(len(self.route.hosts)):
            if isinstance(current, Waiting):
                self.waiting = current
                placement = await placer.wait(current)
                self.waiting = None
            else:
                placement = current
            trail = self.trail.placed(placement)
            self.trail = trail
            try:
                upstream = await forward(self.runtime, self.ask, placement.model, placement.host)
            except HostDown as down:
                placement.slot.release()
                if self.route.strict:
                    raise PinnedHostDown(placement.host) from None
                try:
                    current = await placer.now()
                except NoHealthyHost:
                    raise down from None  # no other host: say which one failed, and how
                continue
            except BaseException:
                placement.slot.release()
                raise
            return Answered(upstream, placement, self._answered(trail))
        raise NoHealthyHost()

    async def _unplaced(self) -> Answered:
        """A request that takes no slot: the best usable host (serving its model, if it names
        one), no lease."""
        tried: set[str] = set()
        failure: HostDown | None = None
        probed = False
        while True:
            if self.ask.host:  # an operator asking one host, whatever its health says
                hosts = [self.ask.host] if self.ask.host not in tried else []
            else:
                hosts = [
                    host
                    for host in ranked(self.runtime.candidates(self.route, self.ask.model))
                    if host not in tried
                ]
            if not hosts and not probed and failure is None:
                probed = True
                await self.runtime.probe_down(self.route)  # a host may just have come back
                continue
            if not hosts:
                raise failure or NoHealthyHost()
            host = hosts[0]
            trail = self.trail = replace(self.trail, host=host)
            if trail.running is not None:
                trail.running.table.placed(trail.running, host, 0)
            try:
                upstream = await forward(self.runtime, self.ask, self.ask.model, host)
            except HostDown as down:  # marked down: the next round ranks it out
                tried.add(host)
                failure = down
                continue
            return Answered(upstream, None, self._answered(trail))

    def _answered(self, trail: Trail) -> Trail:
        return replace(trail, ttfb_ms=int((time.perf_counter() - trail.arrival.t0) * 1000))
