"""A request's hold on the shared limiter: a slot, a place in a line, a watch.

`SharedState.place` (routing/shared/fleet_state.py) hands a request one of these, the shapes
placement expects of any state (`Held`, `InLine` in routing/core/state.py):

- `SharedSlot`: a slot held in Redis; `release()` runs the release script in a task of its own
  and returns at once, and `on_lost` tells the holder that Redis no longer counts it.
- `SharedPlace`: a place in one pair's line. One coroutine, in a task `Places` holds, owns the
  place from the start: it awaits the grant (routing/shared/wakes.py hears it) or the end of
  `granted` (the client gone, `queue_timeout`, an error), whichever comes first, then either
  hands the slot over through `granted` or leaves the line and releases a grant that landed
  meanwhile. That is what keeps a place or a slot from leaking, on every way out.
- `SharedWatcher`: a request of a route with a fallback that finds none of its hosts usable
  waits in no line: a host of it becoming usable here (`Places.wake`), or the fallback's hosts
  once `fallback_after` has passed (`watch`), make it try to place itself there; it then takes
  a free slot, or else a place in that line, waited in as a `SharedPlace` waits.

Redis cannot ask this process whether a freed slot may go to a request: a pair is watched in
Redis only once `accept` says it may. A watched pair whose host is not usable when the watch
begins is remembered, and reaches Redis when its host is usable again (`Places.wake`): a
request moved into another host's line while its host restarted then takes a slot of that
host come back, rather than waiting behind the other host's line while it idles. A slot
granted on a host that went down meanwhile is found out by the request itself, which is then
placed again (routing/proxy/lifecycle.py).

`Places` keeps this process's places and watchers, for the calls that reach them all: a host
usable again (`wake`), a pair no longer configured (`end_waits`). Use it on one event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Iterable
from typing import Any, Final

from routing.core.errors import HostRemoved
from routing.core.limiter import Pair
from routing.shared.grants import Grant, Queued
from routing.shared.slots import RedisSlots
from routing.shared.state import StateUnavailable
from routing.shared.tasks import Tasks

__all__ = ["Places", "SharedPlace", "SharedSlot", "SharedWatcher"]


class SharedSlot:
    """One slot held in Redis. `release()` is idempotent and returns at once."""

    __slots__ = ("host", "model", "released", "_slots", "_grant")

    held: Final = True  # `routing.core.state.Held`

    def __init__(self, slots: RedisSlots, grant: Grant) -> None:
        self.host = grant.host
        self.model = grant.model
        self.released = False
        self._slots = slots
        self._grant = grant

    def release(self) -> None:
        self.released = True
        self._slots.release_soon(self._grant)

    def on_lost(self, callback: Callable[[], None]) -> None:
        """Have `callback` called once, soon, if Redis stops counting this slot before its
        release (routing.core.state.on_lost says when)."""
        self._slots.on_lost(self._grant, callback)

    def __repr__(self) -> str:
        return f"<SharedSlot {self.host}/{self.model} {self._grant.id}>"


class SharedPlace:
    """A request's place in one pair's line in Redis (`InLine`); `granted` resolves when a
    release hands it a slot.

    One coroutine, in a task `Places` holds, owns the place from the start: it awaits the
    grant or the end of `granted` (a cancel, `fail`: a deadline, StateUnavailable), whichever
    comes first, then hands the slot over through `granted`, or gives back the place and a
    slot that landed meanwhile. `position` is the place it was given when it joined (later
    moves are not followed: that would cost a round trip per change per waiter).
    """

    __slots__ = ("granted", "queued", "_places", "_changed", "_pairs", "_accept", "_sent")

    held: Final = False  # `routing.core.state.InLine`

    def __init__(self, places: Places, queued: Queued | None) -> None:
        self.granted: asyncio.Future[SharedSlot] = asyncio.get_running_loop().create_future()
        self.queued = queued
        self._places = places
        self._changed: asyncio.Event | None = None
        self._pairs: list[Pair] = []  # every pair watched, usable or not
        self._accept: Callable[[Pair], bool] = lambda pair: True
        self._sent: set[Pair] = set()  # the pairs watched in Redis (`_send`)
        places.spawn(self._run())

    @property
    def host(self) -> str:
        return self.queued.host if self.queued is not None else ""

    @property
    def position(self) -> int:
        return 0 if self.queued is None or self.granted.done() else self.queued.position

    def changes(self) -> asyncio.Event:
        if self._changed is None:
            changed = self._changed = asyncio.Event()
            if self.granted.done():
                changed.set()
            else:  # a place's position never moves here: only its end is a change
                self.granted.add_done_callback(lambda granted: changed.set())
        return self._changed

    def cancel(self) -> SharedSlot | None:
        granted = self.granted
        if granted.done():
            if granted.cancelled() or granted.exception() is not None:
                return None
            return granted.result()
        granted.cancel()  # the wait sees it and gives back what it holds
        return None

    def fail(self, error: BaseException) -> None:
        if not self.granted.done():
            self.granted.set_exception(error)

    @property
    def offered(self) -> asyncio.Future[SharedSlot]:
        """`granted`: Redis hands over a watched slot only where `watch` accepted it, so no
        slot is ever held here for the wait to decide (`InLine.settle`)."""
        return self.granted

    def settle(self) -> None:
        """Nothing to decide (`offered`)."""

    def watch(self, pairs: Iterable[Pair], accept: Callable[[Pair], bool]) -> None:
        """Let the place also take a free slot of `pairs` when no one waits there: of those
        `accept` takes now at once (one round trip, in a task of its own; a grant reaches the
        wait), of the others once their host is usable again (`wake`)."""
        pairs = self._remember(pairs, accept)
        self._send([pair for pair in pairs if accept(pair)])

    def wake(self, host: str) -> None:
        """`host` became usable here: the pairs of it this place watches and Redis does not
        yet, if `accept` takes them now, are watched there now (a free slot taken at once)."""
        sent, accept = self._sent, self._accept
        self._send([pair for pair in self._pairs
                    if pair[0] == host and pair not in sent and accept(pair)])  # fmt: skip

    def _remember(self, pairs: Iterable[Pair], accept: Callable[[Pair], bool]) -> list[Pair]:
        pairs = list(pairs)
        self._accept = accept
        self._pairs.extend(pair for pair in pairs if pair not in self._pairs)
        return pairs

    def _send(self, pairs: list[Pair]) -> None:
        """Watch in Redis those of `pairs` it does not watch yet. A slot freed on a pair
        watched there comes to the place by its release (or to another in its line first),
        so a pair is sent once."""
        queued = self.queued
        if queued is None or self.granted.done():
            return
        own = (queued.host, queued.model)  # its own line serves it first anyway
        new = [pair for pair in pairs if pair != own and pair not in self._sent]
        if new:
            self._sent.update(new)
            self._places.spawn(self._watch(queued, new))

    async def _watch(self, queued: Queued, pairs: list[Pair]) -> None:
        try:
            await self._places.slots.watch(queued, pairs)
        except ValueError:
            pass  # granted or given back meanwhile
        except StateUnavailable as exc:
            self.fail(exc)

    async def _run(self) -> None:
        try:
            grant = await self._take()
        except Exception as exc:  # StateUnavailable: the place was lost or could not be had
            self.fail(exc)
            return
        if grant is None:
            return
        if self.granted.done():  # ended as the grant came: hand the slot on
            await self._places.slots.release(grant)
        else:
            self.granted.set_result(SharedSlot(self._places.slots, grant))

    async def _take(self) -> Grant | None:
        """The grant this wait is handed, or None when `granted` ended first."""
        assert self.queued is not None
        return await self._in_line(self.queued)

    async def _in_line(self, queued: Queued) -> Grant | None:
        """Wait in `queued`'s line for a grant. On every way out without one (`granted`
        ended, the place lost, the task cancelled), leave the line, releasing a slot that
        landed meanwhile."""
        slots = self._places.slots
        try:
            grant = await slots.wait_unless(queued, self.granted)
        except BaseException:
            await self._leave(queued)
            raise
        if grant is None:
            await self._leave(queued)
        return grant

    async def _leave(self, queued: Queued) -> None:
        slots = self._places.slots
        late = await slots.cancel(queued)
        if late is not None:
            await slots.release(late)


class SharedWatcher(SharedPlace):
    """A request waiting in no line for one of the pairs it watches to become usable.

    Its coroutine tries to place it on the watched pairs usable then (one round trip, one
    attempt at a time) at each `watch` and each `wake` of a watched host. A free slot found
    so is handed over; a place in a line is then waited in as a `SharedPlace` waits (and
    later watches go to that place).
    """

    __slots__ = ("_poked",)

    def __init__(self, places: Places) -> None:
        self._poked: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        super().__init__(places, None)

    def watches(self, host: str) -> bool:
        """Whether a `wake` of `host` is for this watcher: it waits in no line, and for it."""
        if self.granted.done() or self.queued is not None:
            return False
        return any(pair[0] == host for pair in self._pairs)

    def watch(self, pairs: Iterable[Pair], accept: Callable[[Pair], bool]) -> None:
        if self.queued is not None:
            super().watch(pairs, accept)
        else:
            self._remember(pairs, accept)
            self.try_now()

    def wake(self, host: str) -> None:
        if self.watches(host):
            self.try_now()
        else:
            super().wake(host)

    def try_now(self) -> None:
        """Try the usable watched pairs again: now, or once the attempt under way is over."""
        if not self._poked.done():
            self._poked.set_result(None)

    async def _take(self) -> Grant | None:
        got = await self._attempts()
        if not isinstance(got, Queued):
            return got
        self.queued = got
        self._places.in_line(self)
        if self._poked.done():  # watched more during the attempt: the place watches those
            self._send([pair for pair in self._pairs if self._accept(pair)])
        return await self._in_line(got)

    async def _attempts(self) -> Grant | Queued | None:
        """Place this request on the usable watched pairs each time it is poked, until it
        takes a slot or a place in a line (then the caller's), or `granted` ends (None)."""
        slots = self._places.slots
        try:
            while True:
                await asyncio.wait((self._poked, self.granted), return_when=asyncio.FIRST_COMPLETED)
                if self.granted.done():
                    return None
                self._poked = asyncio.get_running_loop().create_future()
                usable = [pair for pair in self._pairs if self._accept(pair)]
                got = await slots.place(usable) if usable else None
                if got is not None:
                    return got
        finally:
            self._places.forget(self)


class Places:
    """This process's requests waiting on the shared limiter, and the tasks their waits run in."""

    def __init__(self, slots: RedisSlots) -> None:
        self.slots = slots
        self._tasks = Tasks()
        self._places: set[SharedPlace] = set()  # those waiting in a line
        self._watchers: set[SharedWatcher] = set()

    def wrap(self, got: Grant | Queued | None) -> SharedSlot | SharedPlace | None:
        """What `RedisSlots.place` or `open` took, as placement holds it: a `SharedSlot`, or a
        `SharedPlace` whose wait begins now (kept here until it ends)."""
        if got is None:
            return None
        if isinstance(got, Grant):
            return SharedSlot(self.slots, got)
        place = SharedPlace(self, got)
        self.in_line(place)
        return place

    def watcher(self) -> SharedWatcher:
        """A new request waiting in no line (kept here until its attempts end)."""
        watcher = SharedWatcher(self)
        self._watchers.add(watcher)
        return watcher

    def in_line(self, place: SharedPlace) -> None:
        """Keep `place`, which waits in a line, until its wait ends (`end_waits`)."""
        self._places.add(place)
        place.granted.add_done_callback(lambda _: self._places.discard(place))

    def forget(self, watcher: SharedWatcher) -> None:
        """`watcher` waits in no line any more: `wake` no longer reaches it."""
        self._watchers.discard(watcher)

    def wake(self, host: str) -> None:
        """The host became usable here: requests waiting in no line for it try it now, and
        those waiting in a line that watch it watch it in Redis now (its free slots are
        theirs at once). Its own line's waiters need nothing: its slots come back by a
        release, and a release hands them over."""
        for place in [*self._watchers, *self._places]:
            place.wake(host)

    def end_waits(self, host: str, model: str) -> None:
        """End this process's waits in the line of a pair no longer configured with
        `HostRemoved`: placement places them again. (Every process ends its own as it
        reloads: Redis cannot tell which of them still configure the pair.)"""
        for place in list(self._places):
            queued = place.queued
            if queued is not None and (queued.host, queued.model) == (host, model):
                place.fail(HostRemoved(host, model))

    def spawn(self, coroutine: Coroutine[Any, Any, None]) -> None:
        """Run a wait's coroutine in a task held here until it is done (or `aclose`)."""
        self._tasks.spawn(coroutine)

    async def aclose(self) -> None:
        """Cancel the waits still running. Never raises."""
        await self._tasks.aclose()
