"""Placement: which host serves a request, and the slot it holds there.

A request first takes its conversation's lease (the cache-warm "home" host), then a slot for
its model on that host. When the home host is busy the route decides between cache warmth and
waiting (DESIGN.md, "Waiting clients"):

- a free slot at home: taken at once;
- home's queue is full: spill at once to another eligible host with room (`spilled`), and
  refuse with `queue full` only when every host is full;
- otherwise wait in home's queue; after `lease_patience` a free slot on another host takes the
  request instead (`spilled`; the lease stays home); after `fallback_after` the route's fallback
  route takes it if one of its hosts has room right now; after `queue_timeout`, `QueueTimeout`.

A route with a fallback also waits, rather than refusing, while it has no healthy host.

While it waits, a request re-examines the fleet every `TICK` seconds; nothing here polls
otherwise. The slot wait itself is the limiter's FIFO queue.
"""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass

from routing.config.shape import RouteConfig
from routing.core.choose import best
from routing.core.errors import QueueTimeout
from routing.core.leases import LeaseOutcome, NoHealthyHost, PinnedHostDown
from routing.core.limiter import QueueFull, Slot, Ticket
from routing.runtime import Runtime

log = logging.getLogger("crossbar.placement")

TICK = 0.1
SPILLED = "spilled"


@dataclass(slots=True)
class Placement:
    """Where a request runs: the host, its held slot, and what led there."""

    host: str
    slot: Slot
    lease: str  # new / reused / moved / spilled / "" (no fingerprint)
    route: RouteConfig  # the route that serves: the fallback's when one was taken
    model: str  # the model asked of that route
    waited: float  # seconds from arrival to the slot
    fallback: str = ""  # the fallback route's name, when one was taken


class Placer:
    """Places one request. `now()` tries without waiting; `wait()` does the rest.

    Use from the request's event loop. If `wait()` is cancelled, it gives back its place in
    line; a slot granted in that same instant is released, never leaked.
    """

    def __init__(self, runtime: Runtime, route: RouteConfig, model: str, fingerprint: str) -> None:
        self.runtime = runtime
        self.route = route
        self.model = model
        self.fingerprint = fingerprint
        self.host = ""  # the host waited for; "" while no host is healthy
        self.lease = ""
        self._ticket = Ticket()
        loop = asyncio.get_running_loop()
        self._loop = loop
        started = loop.time()
        self._started = started
        self._deadline = started + route.queue_timeout
        self._fallback_at = started + route.fallback_after if route.fallback else math.inf
        self._patience_at = started + route.lease_patience

    async def queued(self) -> None:
        """Return once the request has joined a queue (it may never: then wait for `wait()`)."""
        await self._ticket.queued.wait()

    @property
    def position(self) -> int:
        """The request's place in its host's queue; 0 when not queued (e.g. no host yet)."""
        return self._ticket.position

    async def now(self) -> Placement | None:
        """A placement that needs no waiting, or None when the request must wait.

        Raises QueueFull (every host full), NoHealthyHost or PinnedHostDown (when the route has
        no fallback to wait for).
        """
        if not await self._take_lease():
            return None
        if (placement := await self._take_free_slot()) is not None:
            return placement
        if self.runtime.limiter.has_room(self.host, self.model):
            return None
        other = self._other_host(need_free=False)
        if other is None:
            raise QueueFull(self.host, self.model)
        self.host, self.lease = other, SPILLED
        return await self._take_free_slot()

    async def wait(self) -> Placement:
        """Wait for a placement, after `now()` returned None.

        Raises QueueTimeout after the route's queue_timeout, QueueFull if the queue filled up
        meanwhile.
        """
        while not self.host:
            if (placement := await self._try_fallback()) is not None:
                return placement
            self._check_deadline()
            await asyncio.sleep(TICK)
            if (placement := await self.now()) is not None:
                return placement
        return await self._wait_in_line()

    async def _take_free_slot(self) -> Placement | None:
        """A slot on the current host when one is free right now (the acquire does not wait)."""
        limiter = self.runtime.limiter
        if limiter.free_for(self.host, self.model) > 0:
            return self._placed(self.host, await limiter.acquire(self.host, self.model))
        return None

    async def _wait_in_line(self) -> Placement:
        waiting = asyncio.ensure_future(
            self.runtime.limiter.acquire(self.host, self.model, self._ticket)
        )
        settled = False  # whether the acquire's outcome is in hand (a slot to use, or none)
        try:
            while True:
                done, _ = await asyncio.wait((waiting,), timeout=TICK)
                if done:
                    settled = True
                    return self._placed(self.host, waiting.result())
                switch = self._spill_target() or self._fallback_target()
                if switch is not None:
                    slot = await _withdraw(waiting)
                    settled = True
                    if slot is not None:  # granted at home in the same instant: stay
                        return self._placed(self.host, slot)
                    return await self._switch(*switch)
                self._check_deadline()
        finally:
            if not settled:
                # Cancelled (the client left) or timed out. The acquire may still be pending,
                # or may have been granted a slot in the turn this wait was cancelled: either
                # way the slot goes back (a callback on a done future runs on the next turn).
                waiting.cancel()
                waiting.add_done_callback(_release_if_granted)

    def _spill_target(self) -> tuple[RouteConfig, str, str, str] | None:
        if self._loop.time() < self._patience_at:
            return None
        other = self._other_host(need_free=True)
        return (self.route, self.model, other, SPILLED) if other is not None else None

    def _fallback_target(self) -> tuple[RouteConfig, str, str, str] | None:
        if self._loop.time() < self._fallback_at:
            return None
        fallback = self.runtime.fleet.routes.get(self.route.fallback)
        if fallback is None or not fallback.enabled:
            return None
        model = self.route.fallback_model or self.model
        candidates = [
            c
            for c in self.runtime.candidates(fallback, model)
            if self.runtime.limiter.has_room(c.host, model)
        ]
        host = best(candidates)
        return (fallback, model, host, "") if host is not None else None

    async def _try_fallback(self) -> Placement | None:
        target = self._fallback_target()
        return await self._switch(*target) if target is not None else None

    async def _switch(self, route: RouteConfig, model: str, host: str, lease: str) -> Placement:
        """Go to another host (a spill) or another route (a fallback), waiting there if needed."""
        if route is not self.route:
            log.info(
                "fallback route=%s -> %s model=%s -> %s after %.1f s",
                self.route.name,
                route.name,
                self.model,
                model,
                self._loop.time() - self._started,
            )
            fallback = route.name
            self.route, self.model, self._fallback_at = route, model, math.inf
        else:
            fallback = ""
        self.host, self.lease, self._patience_at = host, lease, math.inf
        placement = await self._take_free_slot() or await self._wait_in_line()
        placement.fallback = fallback or placement.fallback
        return placement

    async def _take_lease(self) -> bool:
        """Lease the conversation's host; False when none is healthy and a fallback may come."""
        try:
            self.host, outcome = await self.runtime.lease(self.route, self.fingerprint, self.model)
        except (NoHealthyHost, PinnedHostDown):
            if not self.route.fallback:
                raise
            return False
        self.lease = str(outcome) if outcome is not LeaseOutcome.NONE else ""
        return True

    def _other_host(self, *, need_free: bool) -> str | None:
        """The best usable host of the route, other than the current one, with room."""
        limiter = self.runtime.limiter
        candidates = [
            c
            for c in self.runtime.candidates(self.route, self.model)
            if c.host != self.host
            and self.runtime.usable(self.route, self.model, c.host)
            and (c.free > 0 if need_free else limiter.has_room(c.host, self.model))
        ]
        return best(candidates)

    def _check_deadline(self) -> None:
        if self._loop.time() >= self._deadline:
            raise QueueTimeout(
                f"queue timeout: no slot for {self.model} within {self.route.queue_timeout:g} s"
            )

    def _placed(self, host: str, slot: Slot) -> Placement:
        waited = self._loop.time() - self._started
        return Placement(host, slot, self.lease, self.route, self.model, waited)


async def _withdraw(waiting: asyncio.Future[Slot]) -> Slot | None:
    """Cancel a queued acquire; the slot when it was granted before the cancel landed."""
    waiting.cancel()
    await asyncio.wait((waiting,))
    if waiting.cancelled() or waiting.exception() is not None:
        return None
    return waiting.result()


def _release_if_granted(waiting: asyncio.Future[Slot]) -> None:
    if not waiting.cancelled() and waiting.exception() is None:
        waiting.result().release()
