"""`FleetState` in Redis: what placement uses, shared by every gateway process.

`SharedState` puts `RedisSlots`, `RedisLeases` and `RedisClients` behind the same shape as the
in-process `LocalState` (routing/core/state.py), so placement and the proxy are the same code
with one process or many. What differs, and why:

- `place` is one atomic script (one round trip): the host order comes from this process's
  ranking, and the script takes the first pair in that order with a free slot, else the
  first line with room. So `parallel` holds and lines are FIFO across processes; only the
  ranking's counts of other processes may be up to a tick old (refreshed every tick; this
  process's own slots are counted exactly, by RedisSlots).
- A place in line hears of its grant by pub/sub (routing/shared/slots.py), never by polling.
- Watches (a spill after the route's patience, a fallback) are given only the pairs usable
  when they begin: Redis cannot ask this process whether a freed slot may go to a request.
  A slot granted on a host that went down meanwhile is found out by the request itself,
  which is then placed again (routing/proxy/passage.py).
- A request of a route with a fallback that finds none of its hosts usable waits in no
  line (`SharedWatcher`): a host of it becoming usable here (`wake`), or the fallback's
  hosts once `fallback_after` has passed, make it try to place itself there; it then takes a
  free slot, or else a place in that line.
- `release` and the clean-up of a wait run in tasks of their own: they are called from
  synchronous code (a relay's end, a cancelled wait) and never raise; an unreachable Redis
  gets them at its next tick (RedisSlots' reconcile), so nothing leaks.

Redis unreachable: `place`, `find_lease` and `admit` raise `StateUnavailable` (503
`state_unavailable` with Retry-After); a lease write that fails is logged and the request
goes on, since it holds its slot already and a lease is only where its cache is warm.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Iterable, Sequence
from typing import Any

from routing.core.leases import LeaseKey
from routing.core.limiter import Pair, PairSnapshot
from routing.core.state import InLine
from routing.shared.clients import RedisClients
from routing.shared.leases import RedisLeases
from routing.shared.slots import Grant, Queued, RedisSlots
from routing.shared.state import Shared, StateUnavailable

__all__ = ["SharedPlace", "SharedSlot", "SharedState", "SharedWatcher"]

log = logging.getLogger("crossbar.shared")

class SharedSlot:
    """One slot held in Redis. `release()` is idempotent and returns at once."""

    __slots__ = ("host", "model", "_state", "_grant")

    def __init__(self, state: SharedState, grant: Grant) -> None:
        self.host = grant.host
        self.model = grant.model
        self._state = state
        self._grant = grant

    def release(self) -> None:
        self._state.slots.release_soon(self._grant)

    def __repr__(self) -> str:
        return f"<SharedSlot {self.host}/{self.model} {self._grant.id}>"


class _Awaiting:
    """What a shared place in line and a shared watcher have alike: the future a slot
    arrives by, and the `InLine` methods around it. `_on_done` cleans up in Redis."""

    __slots__ = ("granted", "_state", "_changed")

    def __init__(self, state: SharedState) -> None:
        self.granted: asyncio.Future[SharedSlot] = asyncio.get_running_loop().create_future()
        self._state = state
        self._changed: asyncio.Event | None = None
        self.granted.add_done_callback(self._on_done)

    def _on_done(self, granted: asyncio.Future[SharedSlot]) -> None:
        if self._changed is not None:
            self._changed.set()

    def changes(self) -> asyncio.Event:
        if self._changed is None:
            self._changed = asyncio.Event()
            if self.granted.done():
                self._changed.set()
        return self._changed

    def cancel(self) -> SharedSlot | None:
        granted = self.granted
        if granted.done():
            if granted.cancelled() or granted.exception() is not None:
                return None
            return granted.result()
        granted.cancel()  # _on_done cleans up
        return None

    def fail(self, error: BaseException) -> None:
        if not self.granted.done():
            self.granted.set_exception(error)


class SharedPlace(_Awaiting):
    """A place in one pair's line in Redis; `granted` resolves when a release hands it a slot.

    `position` is the place it was given when it joined (later moves are not followed: that
    would cost a round trip per change per waiter).
    """

    __slots__ = ("queued", "_task")

    def __init__(self, state: SharedState, queued: Queued) -> None:
        self.queued = queued
        self._task = asyncio.get_running_loop().create_task(
            self._wait(), name="crossbar-shared-wait"
        )
        super().__init__(state)

    @property
    def host(self) -> str:
        return self.queued.host

    @property
    def position(self) -> int:
        return 0 if self.granted.done() else self.queued.position

    async def _wait(self) -> None:
        slots = self._state.slots
        try:
            grant = await slots.wait(self.queued)
        except asyncio.CancelledError:
            return  # the wait ended here first; _on_done cleans up
        except Exception as exc:  # StateUnavailable: the place was lost
            self.fail(exc)
            return
        if self.granted.done():  # ended meanwhile (a deadline, a cancel): hand the slot on
            slots.release_soon(grant)
            return
        self.granted.set_result(SharedSlot(self._state, grant))

    def _on_done(self, granted: asyncio.Future[SharedSlot]) -> None:
        super()._on_done(granted)
        if granted.cancelled() or granted.exception() is not None:
            self._task.cancel()
            self._state.slots.cancel_soon(self.queued)


class SharedWatcher(_Awaiting):
    """A request waiting in no line for one of the pairs it watches to become usable.

    Each `watch` and each `wake` of a watched host tries to place it on the watched pairs
    usable then (one round trip, one attempt at a time); a place in a line found so is
    followed (`granted` resolves with its slot).
    """

    __slots__ = ("_pairs", "_accept", "_place", "_trying", "_again")

    def __init__(self, state: SharedState) -> None:
        self._pairs: list[Pair] = []
        self._accept: Callable[[Pair], bool] = lambda pair: True
        self._place: SharedPlace | None = None
        self._trying = False
        self._again = False
        super().__init__(state)

    @property
    def host(self) -> str:
        return ""

    @property
    def position(self) -> int:
        return 0

    def watches(self, host: str) -> bool:
        return self._place is None and any(pair[0] == host for pair in self._pairs)

    def watch(self, pairs: Iterable[Pair], accept: Callable[[Pair], bool]) -> None:
        self._accept = accept
        self._pairs.extend(pair for pair in pairs if pair not in self._pairs)
        self.try_now()

    def try_now(self) -> None:
        if self.granted.done() or self._place is not None:
            return
        if self._trying:
            self._again = True  # something changed during the attempt: one more after it
            return
        self._trying = True
        self._state._spawn(self._try())

    async def _try(self) -> None:
        try:
            while True:
                self._again = False
                usable = [pair for pair in self._pairs if self._accept(pair)]
                if usable and not self.granted.done():
                    got = await self._state.place(usable)
                    if got is not None:
                        self._follow(got)
                        return
                if not self._again:
                    return
        except Exception as exc:  # StateUnavailable
            self.fail(exc)
        finally:
            self._trying = False

    def _follow(self, got: SharedSlot | SharedPlace) -> None:
        if isinstance(got, SharedSlot):
            if self.granted.done():
                got.release()
            else:
                self.granted.set_result(got)
            return
        self._place = got
        if self.granted.done():  # ended during the attempt: leave that line
            got.cancel()
            return
        got.granted.add_done_callback(self._landed)

    def _landed(self, inner: asyncio.Future[SharedSlot]) -> None:
        if inner.cancelled():
            return
        error = inner.exception()
        if error is not None:
            self.fail(error)
        elif self.granted.done():
            inner.result().release()
        else:
            self.granted.set_result(inner.result())

    def _on_done(self, granted: asyncio.Future[SharedSlot]) -> None:
        self._state._watchers.discard(self)
        super()._on_done(granted)
        if (granted.cancelled() or granted.exception() is not None) and self._place is not None:
            late = self._place.cancel()
            if late is not None:
                late.release()


class SharedState:
    """Slots, lines, leases and client counts in Redis, for one process and event loop."""

    def __init__(self, url: str, *, hold_ttl: float) -> None:
        self.shared = Shared(url, hold_ttl=hold_ttl)
        self.slots = RedisSlots(self.shared)
        self.leases = RedisLeases(self.shared)
        self.clients = RedisClients(self.shared)
        self._limits: dict[Pair, tuple[int, int]] = {}  # as configured here
        self._others: dict[Pair, PairSnapshot] = {}  # other processes' slots, and the queues
        self._lease_counts: dict[str, int] = {}
        self._new_leases: dict[str, int] = {}  # this process's, since the last refresh
        self._watchers: set[SharedWatcher] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self.shared.on_tick(self._refresh)

    @property
    def available(self) -> bool:
        """Whether the last round trip to Redis went through."""
        return self.shared.available

    @property
    def where(self) -> str:
        return self.shared.where

    async def start(self) -> None:
        """Begin the liveness beat and the grant listener; never raises for Redis being away
        (requests then get 503 state_unavailable until it answers)."""
        await self.shared.start()
        await self.slots.start(patience=2.0)

    async def aclose(self) -> None:
        await self.slots.aclose()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.shared.aclose()

    # -- placing ------------------------------------------------------------------------

    async def place(self, pairs: Sequence[Pair]) -> SharedSlot | SharedPlace | None:
        if not pairs:
            return None
        got = await self.slots.place(pairs)
        if got is None:
            return None
        if isinstance(got, Grant):
            return SharedSlot(self, got)
        return SharedPlace(self, got)

    def watcher(self) -> SharedWatcher:
        watcher = SharedWatcher(self)
        self._watchers.add(watcher)
        return watcher

    def watch(self, waiter: InLine, pairs: Iterable[Pair], accept: Callable[[Pair], bool]) -> None:
        if isinstance(waiter, SharedWatcher):
            waiter.watch(pairs, accept)
            return
        assert isinstance(waiter, SharedPlace), "a shared watch needs a shared place"
        usable = [pair for pair in pairs if accept(pair)]
        if usable and not waiter.granted.done():
            self._spawn(self._watch(waiter, usable))

    def wake(self, host: str) -> None:
        """The host became usable here: requests waiting in no line for it try it now. (A
        line's waiters need nothing: every slot of that host comes back by a release.)"""
        for watcher in list(self._watchers):
            if watcher.watches(host):
                watcher.try_now()

    async def _watch(self, waiter: SharedPlace, pairs: list[Pair]) -> None:
        try:
            await self.slots.watch(waiter.queued, pairs)  # a grant also reaches waiter's wait
        except ValueError:
            pass  # granted or cancelled meanwhile
        except StateUnavailable as exc:
            waiter.fail(exc)

    # -- leases -------------------------------------------------------------------------

    async def find_lease(self, key: LeaseKey, ttl: float) -> str | None:
        return await self.leases.slide(key, ttl)  # the read slides it

    async def keep_lease(self, key: LeaseKey, host: str, ttl: float, found: str | None) -> None:
        if found == host:
            return  # `find_lease` slid it just now: no second round trip
        try:
            await self.leases.keep(key, host, ttl)
        except StateUnavailable as exc:
            log.warning("lease not kept (%s): the conversation may move next turn", exc)
            return
        # Counted at once, so conversations arriving within a tick spread over hosts.
        self._new_leases[host] = self._new_leases.get(host, 0) + 1

    # -- configuration ------------------------------------------------------------------

    def configure(self, host: str, model: str, parallel: int, queue_max: int) -> None:
        self._limits[(host, model)] = (max(1, parallel), max(0, queue_max))
        self.slots.configure_soon(host, model, parallel, queue_max)

    def remove(self, host: str, model: str) -> None:
        self._limits.pop((host, model), None)
        self.slots.remove_soon(host, model)

    def drop_host(self, host: str) -> None:
        self._lease_counts.pop(host, None)
        self._new_leases.pop(host, None)

        async def drop() -> None:
            try:
                await self.leases.drop_host(host)
            except StateUnavailable:
                pass  # its leases expire by themselves

        self._spawn(drop())

    # -- counts (ranking, dashboard): other processes' refreshed every tick, ours exact --

    def free_for(self, host: str, model: str) -> int:
        parallel, _ = self._limits.get((host, model), (1, 0))
        return max(0, parallel - self.in_flight(host, model))

    def free_slots(self, host: str) -> int:
        return sum(self.free_for(*pair) for pair in self._limits if pair[0] == host)

    def queued(self, host: str, model: str) -> int:
        others = self._others.get((host, model))
        return others.queued if others is not None else 0

    def in_flight(self, host: str, model: str) -> int:
        others = self._others.get((host, model))
        return (others.in_flight if others is not None else 0) + self.slots.held_on(host, model)

    def snapshot(self) -> list[PairSnapshot]:
        return [
            PairSnapshot(host, model, parallel, queue_max, self.in_flight(host, model),
                         self.queued(host, model))  # fmt: skip
            for (host, model), (parallel, queue_max) in sorted(self._limits.items())
        ]

    def leases_held(self, host: str, model: str | None = None) -> int:
        # Redis counts leases per host only; per model this over-counts, which makes a
        # router-mode host look busier (it then avoids unloading a model), never idler.
        return self._lease_counts.get(host, 0) + self._new_leases.get(host, 0)

    def leases_by_host(self) -> dict[str, int]:
        hosts = self._lease_counts.keys() | self._new_leases.keys()
        return {host: self.leases_held(host) for host in hosts}

    async def _refresh(self) -> None:
        new_leases = dict(self._new_leases)
        pairs = await self.slots.snapshot(others_only=True)
        leases = await self.leases.held_by_host()
        self._others = {(snap.host, snap.model): snap for snap in pairs}
        self._lease_counts = leases
        # The snapshot counts other processes' slots only (ours: `slots.held_on`, exact).
        # New leases made while it was read stay counted (it may or may not hold them).
        self._new_leases = _since(self._new_leases, new_leases)

    # -- internals ----------------------------------------------------------------------

    def _spawn(self, coroutine: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def _since(now: dict[Any, int], before: dict[Any, int]) -> dict[Any, int]:
    """The counts of `now` less those of `before`, without the zeros."""
    return {key: left for key, value in now.items() if (left := value - before.get(key, 0))}
