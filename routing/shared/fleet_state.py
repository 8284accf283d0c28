"""`FleetState` in Redis: what placement uses, shared by every gateway process.

`SharedState` puts `RedisSlots`, `RedisLeases` and `RedisClients` behind the same shape as the
in-process `LocalState` (routing/core/state.py), so placement and the proxy are the same code
with one process or many. What differs, and why:

- `place` is one atomic script (one round trip): the host order comes from this process's
  ranking, and the script takes the first pair in that order with a free slot, else the
  first line with room. So `parallel` holds and lines are FIFO across processes; only the
  ranking's counts of other processes may be up to a tick old (refreshed every tick; this
  process's own slots are counted exactly, by RedisSlots).
- `open`, a conversation's first step, is one script too (lease read, place, lease write:
  routing/core/opening.py's choice). Health and drain are this process's own: the script is
  given the hosts it may not use, and a home it offers that this process refuses after all is
  given back and the choice made again here.
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
- A slot can be lost while held: this process was away from Redis past its hold TTL and
  another took the slot back, or Redis restarted and the pair filled up before this process
  put its slots back. It is never counted again; `SharedSlot.on_lost` tells its holder.

Redis unreachable: `place`, `open`, `find_lease` and `admit` raise `StateUnavailable` (503
`state_unavailable` with Retry-After); a lease write that fails is logged and the request
goes on, since it holds its slot already and a lease is only where its cache is warm.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Iterable
from typing import Any

from routing.core.errors import HostRemoved
from routing.core.leases import LeaseKey
from routing.core.limiter import Pair, PairSnapshot
from routing.core.opening import Opened, Opening, give_back, open_with
from routing.core.state import InLine
from routing.shared.clients import RedisClients
from routing.shared.leases import RedisLeases, lease_id, lease_ms, parse_version
from routing.shared.slots import Grant, Queued, RedisSlots
from routing.shared.state import Shared, StateUnavailable

__all__ = ["SharedPlace", "SharedSlot", "SharedState", "SharedWatcher"]

log = logging.getLogger("crossbar.shared")

HEAD = 8  # the hosts a placement asks first for a free slot (`SharedState.place`)


class SharedSlot:
    """One slot held in Redis. `release()` is idempotent and returns at once."""

    __slots__ = ("host", "model", "released", "_state", "_grant")

    def __init__(self, state: SharedState, grant: Grant) -> None:
        self.host = grant.host
        self.model = grant.model
        self.released = False
        self._state = state
        self._grant = grant

    def release(self) -> None:
        self.released = True
        self._state.slots.release_soon(self._grant)

    def on_lost(self, callback: Callable[[], None]) -> None:
        """Have `callback` called once, soon, if Redis stops counting this slot before its
        release (routing.core.state.on_lost says when)."""
        self._state.slots.on_lost(self._grant, callback)

    def __repr__(self) -> str:
        return f"<SharedSlot {self.host}/{self.model} {self._grant.id}>"


class SharedPlace:
    """A request's place in one pair's line in Redis (`InLine`); `granted` resolves when a
    release hands it a slot.

    One coroutine, in a task the state holds, owns the place from the start: it awaits the
    grant or the end of `granted` (a cancel, `fail`: a deadline, StateUnavailable), whichever
    comes first, then hands the slot over through `granted`, or gives back the place and a
    slot that landed meanwhile. `position` is the place it was given when it joined (later
    moves are not followed: that would cost a round trip per change per waiter).
    """

    __slots__ = ("granted", "queued", "_state", "_changed")

    def __init__(self, state: SharedState, queued: Queued | None) -> None:
        self.granted: asyncio.Future[SharedSlot] = asyncio.get_running_loop().create_future()
        self.queued = queued
        self._state = state
        self._changed: asyncio.Event | None = None
        state._spawn(self._run())

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
        """Let the place also take a free slot of those of `pairs` usable now, when no one
        waits there (one round trip, in a task of its own; a grant reaches the wait)."""
        usable = [pair for pair in pairs if accept(pair)]
        if usable and self.queued is not None and not self.granted.done():
            self._state._spawn(self._watch(self.queued, usable))

    async def _watch(self, queued: Queued, pairs: list[Pair]) -> None:
        try:
            await self._state.slots.watch(queued, pairs)
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
            await self._state.slots.release(grant)
        else:
            self.granted.set_result(SharedSlot(self._state, grant))

    async def _take(self) -> Grant | None:
        """The grant this wait is handed, or None when `granted` ended first."""
        assert self.queued is not None
        return await self._in_line(self.queued)

    async def _in_line(self, queued: Queued) -> Grant | None:
        """Wait in `queued`'s line for a grant. On every way out without one (`granted`
        ended, the place lost, the task cancelled), leave the line, releasing a slot that
        landed meanwhile."""
        slots = self._state.slots
        try:
            grant = await slots.wait_unless(queued, self.granted)
        except BaseException:
            await self._leave(queued)
            raise
        if grant is None:
            await self._leave(queued)
        return grant

    async def _leave(self, queued: Queued) -> None:
        slots = self._state.slots
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

    __slots__ = ("_pairs", "_accept", "_poked")

    def __init__(self, state: SharedState) -> None:
        self._pairs: list[Pair] = []
        self._accept: Callable[[Pair], bool] = lambda pair: True
        self._poked: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        super().__init__(state, None)

    def watches(self, host: str) -> bool:
        """Whether a `wake` of `host` is for this watcher: it waits in no line, and for it."""
        if self.granted.done() or self.queued is not None:
            return False
        return any(pair[0] == host for pair in self._pairs)

    def watch(self, pairs: Iterable[Pair], accept: Callable[[Pair], bool]) -> None:
        pairs = list(pairs)
        self._accept = accept
        self._pairs.extend(pair for pair in pairs if pair not in self._pairs)
        if self.queued is not None:
            super().watch(pairs, accept)
        else:
            self.try_now()

    def try_now(self) -> None:
        """Try the usable watched pairs again: now, or once the attempt under way is over."""
        if not self._poked.done():
            self._poked.set_result(None)

    async def _take(self) -> Grant | None:
        got = await self._attempts()
        if not isinstance(got, Queued):
            return got
        self.queued = got
        self._state._in_line(self)
        if self._poked.done():  # watched more during the attempt: the place watches those
            super().watch(self._pairs, self._accept)
        return await self._in_line(got)

    async def _attempts(self) -> Grant | Queued | None:
        """Place this request on the usable watched pairs each time it is poked, until it
        takes a slot or a place in a line (then the caller's), or `granted` ends (None)."""
        slots = self._state.slots
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
            self._state._watchers.discard(self)


class SharedState:
    """Slots, lines, leases and client counts in Redis, for one process and event loop."""

    def __init__(
        self,
        url: str,
        *,
        hold_ttl: float,
        on_change: Callable[[str], None] | None = None,
    ) -> None:
        """`on_change(host)`: a count of the host changed (this process's slots, its new
        leases, a configuration; other processes' counts as a tick reads them)."""
        self._changed = on_change or _ignore
        self.shared = Shared(url, hold_ttl=hold_ttl)
        self.slots = RedisSlots(self.shared, on_change=self._changed)
        self.leases = RedisLeases(self.shared)
        self.clients = RedisClients(self.shared)
        self._limits: dict[Pair, tuple[int, int]] = {}  # as configured here
        self._others: dict[Pair, PairSnapshot] = {}  # other processes' slots, and the queues
        self._others_read: list[PairSnapshot] = []  # the snapshot `_others` was made from
        self._own_read: dict[Pair, int] = {}  # this process's slots as that snapshot came
        self._lease_counts: dict[str, int] = {}
        # This process's leases that the counts may not have yet, by host: (a number of this
        # process's, in order, the leases' version the write left) each.
        self._new_leases: dict[str, list[tuple[int, int | None]]] = {}
        self._leases_made = 0
        self._watchers: set[SharedWatcher] = set()
        self._places: set[SharedPlace] = set()  # those waiting in a line
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

    async def place(self, pairs: Iterable[Pair]) -> SharedSlot | SharedPlace | None:
        pairs = list(pairs)  # read now: a ranking's own sequence changes at its next read
        if not pairs:
            return None
        got: Grant | Queued | None = None
        if len(pairs) > HEAD:
            # This process's ranking puts the hosts with free slots first (other processes'
            # counts are up to a tick old): asking its head for a slot is one short walk,
            # both in the round trip and in Redis; only when the head had none (the counts
            # moved, or every host is busy) does the whole order go, for a slot or a line.
            got = await self.slots.place(pairs[:HEAD], queue=False)
        if got is None:
            got = await self.slots.place(pairs)
            if got is None:
                self._counted_refusal()
        return self._wrap(got)

    async def open(self, opening: Opening) -> Opened:
        """`routing.core.opening`'s choice in one round trip (the OPEN script) where it can:
        what the script leaves (a big route whose head is full, a home this process may not
        use after all) goes on through `open_with`, with the lease as the script found it."""
        key = opening.key
        pairs = list(opening.pairs)  # read now: a ranking's own sequence changes at its next read
        head = pairs[:HEAD]
        short = len(pairs) > HEAD  # the head asked for a slot only, as `place` does
        lease = (lease_id(key), lease_ms(opening.ttl), self.leases.max_entries)
        got, (found, leased, at_home, version) = await self.slots.open(
            lease, key.model, head, queue=not short, unusable=opening.unusable,
            strict=opening.strict, patient=opening.patient,
        )  # fmt: skip
        home = found or None
        if got is None:
            self._counted_refusal()
        if leased:
            self._leased(leased, parse_version(version))
        if got == "pinned":
            return Opened(home, False, None, pinned=True)
        assert not isinstance(got, str)
        taken = self._wrap(got)
        if at_home == "1" and home is not None and not opening.usable(home):
            # Redis saw home as usable, this process does not (it left the route, or its
            # state changed during the round trip): give it back and choose again.
            if taken is not None:
                give_back(taken)
            taken = None
        elif taken is not None or not short:
            return Opened(home, at_home == "1", taken)
        return await open_with(self, opening, home)

    def _counted_refusal(self) -> None:
        """Count the pairs a refusal was refused on as Redis counted them then, until the next
        tick: a refusal quotes these counts, and this process's view of other processes'
        requests may be a tick old (a host "up (0/2 running)" in a refusal for all full)."""
        for pair, (in_flight, queued) in self.slots.refused_on.items():
            limits = self._limits.get(pair)
            if limits is None:
                continue  # no longer configured here
            own = self.slots.held_on(*pair)
            others = PairSnapshot(*pair, *limits, max(0, in_flight - own), queued)
            if self._others.get(pair) != others:
                self._others[pair] = others
                self._own_read[pair] = own
                self._changed(pair[0])

    def _wrap(self, got: Grant | Queued | None) -> SharedSlot | SharedPlace | None:
        if got is None:
            return None
        if isinstance(got, Grant):
            return SharedSlot(self, got)
        place = SharedPlace(self, got)
        self._in_line(place)
        return place

    def _in_line(self, place: SharedPlace) -> None:
        """Keep `place`, which waits in a line, until its wait ends (`_end_waits`)."""
        self._places.add(place)
        place.granted.add_done_callback(lambda _: self._places.discard(place))

    def _end_waits(self, host: str, model: str) -> None:
        """End this process's waits in the line of a pair no longer configured with
        `HostRemoved`: placement places them again. (Every process ends its own as it
        reloads: Redis cannot tell which of them still configure the pair.)"""
        for place in list(self._places):
            queued = place.queued
            if queued is not None and (queued.host, queued.model) == (host, model):
                place.fail(HostRemoved(host, model))

    def watcher(self) -> SharedWatcher:
        watcher = SharedWatcher(self)
        self._watchers.add(watcher)
        return watcher

    def watch(self, waiter: InLine, pairs: Iterable[Pair], accept: Callable[[Pair], bool]) -> None:
        assert isinstance(waiter, SharedPlace), "a shared watch needs a shared place"
        waiter.watch(pairs, accept)

    def wake(self, host: str) -> None:
        """The host became usable here: requests waiting in no line for it try it now. (A
        line's waiters need nothing: every slot of that host comes back by a release.)"""
        for watcher in list(self._watchers):
            if watcher.watches(host):
                watcher.try_now()

    # -- leases -------------------------------------------------------------------------

    async def find_lease(self, key: LeaseKey, ttl: float) -> str | None:
        return await self.leases.slide(key, ttl)  # the read slides it

    async def keep_lease(self, key: LeaseKey, host: str, ttl: float, found: str | None) -> None:
        if found == host:
            return  # `find_lease` slid it just now: no second round trip
        try:
            version = await self.leases.keep(key, host, ttl)
        except StateUnavailable as exc:
            log.warning("lease not kept (%s): the conversation may move next turn", exc)
            return
        self._leased(host, version)

    def _leased(self, host: str, version: int | None) -> None:
        # Counted at once, so conversations arriving within a tick spread over hosts, until a
        # tick's read surely counts it (`_refresh`).
        self._leases_made += 1
        self._new_leases.setdefault(host, []).append((self._leases_made, version))
        self._changed(host)

    # -- configuration ------------------------------------------------------------------

    def configure(self, host: str, model: str, parallel: int, queue_max: int) -> None:
        self._limits[(host, model)] = (max(1, parallel), max(0, queue_max))
        self.slots.configure_soon(host, model, parallel, queue_max)
        self._changed(host)

    def remove(self, host: str, model: str) -> None:
        self._limits.pop((host, model), None)
        self.slots.remove_soon(host, model)
        self._end_waits(host, model)
        self._changed(host)

    def rename(self, old: str, new: str) -> None:
        """The slots held on `old`'s pairs count under `new` (`RedisSlots.rename_soon`); this
        process's waits in their lines are placed again, at the end of `new`'s lines."""
        models = [model for host, model in self._limits if host == old]
        self.slots.rename_soon(old, new)
        for model in models:
            self._limits.pop((old, model), None)
            self._end_waits(old, model)
        self._changed(old)
        self._changed(new)

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
        pair = (host, model)
        snapshot = self._others.get(pair)
        others = snapshot.in_flight if snapshot is not None else 0
        counted = others + self.slots.held_on(host, model)
        # Other processes' counts are a tick old: a slot one of them gave back since, that
        # this process then took, is counted twice (busy hosts read "6/4 running"). Redis
        # grants none past `parallel`, so the pair holds at most that, or what it held as the
        # tick read it if more (`parallel` lowered under running requests).
        limits = self._limits.get(pair)
        if limits is None:  # no longer configured here: whatever still runs there counts
            return counted
        return min(counted, max(limits[0], others + self._own_read.get(pair, 0)))

    def snapshot(self) -> list[PairSnapshot]:
        """The configured pairs, and those no longer configured where requests still run or
        wait (in this process, or in others as the last tick read them)."""
        pairs = {*self._limits, *self._others, *self.slots.held_pairs()}
        snapshots = []
        for host, model in sorted(pairs):
            others = self._others.get((host, model))
            limits = (others.parallel, others.queue_max) if others is not None else (1, 0)
            parallel, queue_max = self._limits.get((host, model), limits)
            in_flight, queued = self.in_flight(host, model), self.queued(host, model)
            if (host, model) in self._limits or in_flight or queued:
                snapshots.append(PairSnapshot(host, model, parallel, queue_max, in_flight, queued))
        return snapshots

    def leases_held(self, host: str, model: str | None = None) -> int:
        # Redis counts leases per host only; per model this over-counts, which makes a
        # router-mode host look busier (it then avoids unloading a model), never idler.
        return self._lease_counts.get(host, 0) + len(self._new_leases.get(host, ()))

    def leases_by_host(self) -> dict[str, int]:
        hosts = self._lease_counts.keys() | self._new_leases.keys()
        return {host: self.leases_held(host) for host in hosts}

    def expire_leases(self) -> None:
        pass  # Redis expires them; the counts are read every tick

    async def slot_number(self, key: LeaseKey, host: str, slots: int) -> int | None:
        # Kept in Redis beside the lease: numbered by one process alone, one slot could go to
        # two conversations, and one conversation to two slots.
        try:
            return await self.leases.number(key, host, slots)
        except StateUnavailable as exc:
            log.warning("slot not named (%s): the host chooses it", exc)
            return None

    async def _refresh(self) -> None:
        made_before = self._leases_made
        pairs = await self.slots.snapshot(others_only=True)
        fresh = pairs is not self._others_read  # the same list: nothing changed in Redis
        own = {pair: self.slots.held_on(*pair) for pair in self._limits} if fresh else {}
        leases = await self.leases.held_by_host()
        changed: set[str] = set()
        if fresh:
            others = {(snap.host, snap.model): snap for snap in pairs}
            changed.update(pair[0] for pair in others.keys() ^ self._others.keys())
            changed.update(p[0] for p, snap in others.items() if self._others.get(p) != snap)
            self._others, self._others_read, self._own_read = others, pairs, own
        if leases is not self._lease_counts or self._new_leases:
            hosts = leases.keys() | self._new_leases.keys() | self._lease_counts.keys()
            held_before = {host: self.leases_held(host) for host in hosts}
            self._lease_counts = leases
            self._new_leases = _uncounted(self._new_leases, made_before, self.leases.counted_up_to)
            changed.update(h for h, held in held_before.items() if self.leases_held(h) != held)
        for host in changed:  # the rankings hear of these hosts only
            self._changed(host)

    # -- internals ----------------------------------------------------------------------

    def _spawn(self, coroutine: Coroutine[Any, Any, None]) -> None:
        """Run `coroutine` in a task held here until it is done (or the state closes)."""
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def _ignore(host: str) -> None:
    pass


def _uncounted(
    new: dict[str, list[tuple[int, int | None]]], made_before: int, counted: int | None
) -> dict[str, list[tuple[int, int | None]]]:
    """The leases of `new` a read of the counts may not hold: made after the read began
    (`made_before` made until then: those it holds, or they expired), and whose write left a
    later version than the read's (`counted`). One made during the read may or may not be in
    it; the versions tell, so it is counted once, not twice for a tick."""

    def uncounted(number: int, version: int | None) -> bool:
        if number <= made_before:
            return False
        return counted is None or version is None or version > counted

    left = {host: [made for made in leases if uncounted(*made)] for host, leases in new.items()}
    return {host: leases for host, leases in left.items() if leases}
