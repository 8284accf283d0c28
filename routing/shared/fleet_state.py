"""`FleetState` in Redis: what placement uses, shared by every gateway process.

`SharedState` puts `RedisSlots`, `RedisLeases` and `RedisClients` behind the same shape as the
in-process `LocalState` (routing/core/state.py), so placement and the proxy are the same code
with one process or many. It composes its parts and adds what is placement's:

- `place` is one atomic script (one round trip): the host order comes from this process's
  ranking, and the script takes the first pair in that order with a free slot, else the
  first line with room. So `parallel` holds and lines are FIFO across processes; only the
  ranking's counts of other processes may be up to a tick old (routing/shared/counts.py).
- `open`, a conversation's first step, is one script too (lease read, place, lease write:
  routing/core/opening.py's choice). Health and drain are this process's own: the script is
  given the hosts it may not use, and a home it offers that this process refuses after all is
  given back and the choice made again here.
- What a placement takes is a `SharedSlot`, a `SharedPlace` or a `SharedWatcher`
  (routing/shared/places.py), which gives back what it holds on every way out.
- `release` and the clean-up of a wait run in tasks of their own: they are called from
  synchronous code (a relay's end, a cancelled wait) and never raise; an unreachable Redis
  gets them at its next tick (routing/shared/slot_recovery.py), so nothing leaks.
- A slot can be lost while held: this process was away from Redis past its hold TTL and
  another took the slot back, or Redis restarted and the pair filled up before this process
  put its slots back. It is never counted again; `SharedSlot.on_lost` tells its holder.

Redis unreachable: `place`, `open`, `find_lease` and `admit` raise `StateUnavailable` (503
`state_unavailable` with Retry-After); a lease write that fails is logged and the request
goes on, since it holds its slot already and a lease is only where its cache is warm.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from routing.core.fairness import ANONYMOUS, Share
from routing.core.leases import LeaseKey
from routing.core.limiter import Pair, PairSnapshot
from routing.core.opening import Opened, Opening, give_back, open_with
from routing.core.state import InLine
from routing.shared.clients import RedisClients
from routing.shared.counts import SharedCounts
from routing.shared.grants import Grant, Queued
from routing.shared.leases import RedisLeases, lease_id, lease_ms, parse_version
from routing.shared.places import Places, SharedPlace, SharedSlot, SharedWatcher
from routing.shared.slots import RedisSlots
from routing.shared.state import Shared, StateUnavailable
from routing.shared.tasks import Tasks

__all__ = ["SharedState"]

log = logging.getLogger("crossbar.shared")

HEAD = 8  # the hosts a placement asks first for a free slot (`SharedState.place`)


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
        self.places = Places(self.slots)
        self.counts = SharedCounts(self.slots, self.leases, self._changed)
        self._tasks = Tasks()
        self.shared.on_tick(self.counts.refresh)

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
        await self.places.aclose()
        await self._tasks.aclose()
        await self.shared.aclose()

    # -- placing ------------------------------------------------------------------------

    async def place(
        self, pairs: Iterable[Pair], share: Share = ANONYMOUS, *, shed: bool = True
    ) -> SharedSlot | SharedPlace | None:
        # `share` and `shed` are not read: the lines kept in Redis are first come, first
        # served, and a full one refuses the newcomer.
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
                self.counts.count_refusal()
        return self.places.wrap(got)

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
            self.counts.count_refusal()
        if leased:
            self.counts.leased(leased, parse_version(version))
        if got == "pinned":
            return Opened(home, False, None, pinned=True)
        assert not isinstance(got, str)
        taken = self.places.wrap(got)
        if at_home == "1" and home is not None and not opening.usable(home):
            # Redis saw home as usable, this process does not (it left the route, or its
            # state changed during the round trip): give it back and choose again.
            if taken is not None:
                give_back(taken)
            taken = None
        elif taken is not None or not short:
            return Opened(home, at_home == "1", taken)
        return await open_with(self, opening, home)

    def watcher(self, share: Share = ANONYMOUS) -> SharedWatcher:
        return self.places.watcher()

    def watch(self, waiter: InLine, pairs: Iterable[Pair], accept: Callable[[Pair], bool]) -> None:
        assert isinstance(waiter, SharedPlace), "a shared watch needs a shared place"
        waiter.watch(pairs, accept)

    def wake(self, host: str) -> None:
        """The host became usable here: requests waiting in no line for it try it now."""
        self.places.wake(host)

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
        self.counts.leased(host, version)

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

    async def leave_to_host(self, key: LeaseKey, host: str) -> None:
        try:
            await self.leases.leave_to_host(key, host)
        except StateUnavailable as exc:
            log.warning("slot left unmarked (%s): the next turn may name another", exc)

    # -- configuration ------------------------------------------------------------------

    def configure(self, host: str, model: str, parallel: int, queue_max: int) -> None:
        self.counts.configure(host, model, parallel, queue_max)
        self.slots.configure_soon(host, model, parallel, queue_max)
        self._changed(host)

    def remove(self, host: str, model: str) -> None:
        self.counts.remove(host, model)
        self.slots.remove_soon(host, model)
        self.places.end_waits(host, model)
        self._changed(host)

    def rename(self, old: str, new: str) -> None:
        """The slots held on `old`'s pairs count under `new` (`RedisSlots.rename_soon`); this
        process's waits in their lines are placed again, at the end of `new`'s lines."""
        models = self.counts.models_of(old)
        self.slots.rename_soon(old, new)
        for model in models:
            self.counts.remove(old, model)
            self.places.end_waits(old, model)
        self._changed(old)
        self._changed(new)

    def drop_host(self, host: str) -> None:
        self.counts.drop_host(host)

        async def drop() -> None:
            try:
                await self.leases.drop_host(host)
            except StateUnavailable:
                pass  # its leases expire by themselves

        self._tasks.spawn(drop())

    # -- counts (ranking, dashboard): routing/shared/counts.py ----------------------------

    def free_for(self, host: str, model: str) -> int:
        return self.counts.free_for(host, model)

    def free_slots(self, host: str) -> int:
        return self.counts.free_slots(host)

    def queued(self, host: str, model: str) -> int:
        return self.counts.queued(host, model)

    def in_flight(self, host: str, model: str) -> int:
        return self.counts.in_flight(host, model)

    def snapshot(self) -> list[PairSnapshot]:
        return self.counts.snapshot()

    def leases_held(self, host: str, model: str | None = None) -> int:
        return self.counts.leases_held(host, model)

    def leases_by_host(self) -> dict[str, int]:
        return self.counts.leases_by_host()


def _ignore(host: str) -> None:
    pass
