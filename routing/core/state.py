"""The fleet's state as placement uses it: slots, places in line, leases, and their counts.

Two backings share this shape. `LocalState` (here) is one process's `Limiter` and
`LeaseTable`: its coroutines never suspend, so a placement made through it stays one step that
no other request can interleave with. `routing.shared.fleet_state.SharedState` keeps the same
things in Redis for several gateway processes; there each operation is one atomic server-side
script (one round trip), which is what keeps `parallel` and the FIFO order across processes.

The counts (`free_for`, `queued`, `leases_held`, ...) rank hosts and feed the dashboard; they
never decide whether a place is free, which only `place` does.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Any, Literal, Protocol

from routing.core.fairness import ANONYMOUS, Share, Work
from routing.core.leases import LeaseKey, LeaseTable
from routing.core.limiter import Limiter, Pair, PairSnapshot, Slot, Waiter
from routing.core.opening import Opened, Opening, open_with

__all__ = ["FleetState", "Held", "InLine", "LocalState", "charge", "charge_later", "on_lost"]


class Held(Protocol):
    """One held slot of a (host, model) pair; `release()` is idempotent and never raises.

    `held` is True, where an `InLine`'s is False: what a place's result (`Held | InLine`) is
    told apart by, an attribute read (an `isinstance` against a runtime-checkable protocol
    walks its members on every call)."""

    @property
    def held(self) -> Literal[True]: ...
    @property
    def host(self) -> str: ...
    @property
    def model(self) -> str: ...
    @property
    def released(self) -> bool:
        """Whether `release()` was called."""
        ...

    def release(self) -> None: ...


def on_lost(slot: Held, callback: Callable[[], None]) -> None:
    """Have `callback` called once, from the event loop (never inside this call), if the
    backing stops counting `slot` while it is still held: the request must then end, since
    its host may be running more than `parallel`. That happens to a shared state's process
    that was stalled or cut off from Redis past its hold TTL, or that finds Redis restarted,
    and learns that another process took the slot. Never called after `slot.release()`.
    A slot its backing can lose has an `on_lost(callback)` method (the shared state's); nothing
    happens for one that cannot (the local limiter's)."""
    # Asked by the method, not by `isinstance` with a runtime-checkable protocol: that check
    # walks the protocol's members on every call, about 1% of a streamed request's CPU.
    watch: Callable[[Callable[[], None]], None] | None = getattr(slot, "on_lost", None)
    if watch is not None:
        watch(callback)


def charge_later(slot: Held) -> None:
    """`slot`'s release charges its client key nothing: `charge` will, with the work its
    request did once that is known (the answer's end). A slot of a backing whose lines are
    first come, first served (the shared state's) has nothing to charge."""
    later: Callable[[], None] | None = getattr(slot, "charge_later", None)
    if later is not None:
        later()


def charge(slot: Held, work: Work) -> None:
    """Charge `slot`'s client key, in its pair's line, the work its request did (once)."""
    settle: Callable[[Work], None] | None = getattr(slot, "charge", None)
    if settle is not None:
        settle(work)


class InLine(Protocol):
    """A request's place in one pair's line (or its watches only, when `host` is "").

    `granted` resolves to the `Held` slot it was handed. A wait that ends without using it
    calls `cancel()` and releases what that returns. The waiting task also waits for
    `offered` and then calls `settle()`: a slot freed on a pair it watches is held for it,
    and its own `accept` decides there, not in the code that freed the slot.
    """

    @property
    def held(self) -> Literal[False]:
        """False: a place, not a slot (`Held.held`)."""
        ...

    @property
    def granted(self) -> asyncio.Future[Any]: ...
    @property
    def offered(self) -> asyncio.Future[Any]:
        """Done when a slot is held for this wait, to take or decline (`settle`)."""
        ...

    def settle(self) -> None:
        """Decide the slots held for this wait: take the first its watch accepts, give the
        others back (they go on to the next in line or watching at once)."""
        ...

    @property
    def host(self) -> str: ...
    @property
    def position(self) -> int: ...
    def changes(self) -> asyncio.Event: ...
    def cancel(self) -> Held | None: ...
    def fail(self, error: BaseException) -> None: ...


class FleetState(Protocol):
    """Slots, lines and leases of the whole fleet, and counts of them for ranking."""

    async def place(
        self, pairs: Iterable[Pair], share: Share = ANONYMOUS, *, shed: bool = True
    ) -> Held | InLine | None:
        """A free slot on the first pair with one; else a place in the first line with room;
        else, when `shed`, the place of a lower class's waiter refused for it in one of their
        full lines (`Limiter.place`); else None (all full). `pairs` is read before the first
        suspension (it may be a ranking's own sequence, which changes at the ranking's next
        read). `share`: whose share the request counts against in a line (its client key's;
        the shared backing's lines are first come, first served, and shed nobody)."""
        ...

    async def open(self, opening: Opening) -> Opened:
        """A conversation's first step (routing.core.opening): its lease read, the place that
        follows and the lease kept, as one step; raises as `place` does."""
        ...

    def watcher(self, share: Share = ANONYMOUS) -> InLine | None:
        """A place in no line, that only watches; None where the backing has none."""
        ...

    def watch(self, waiter: InLine, pairs: Iterable[Pair], accept: Callable[[Pair], bool]) -> None:
        """Let `waiter` also take a slot freed on `pairs` whose lines are empty, when
        `accept(pair)` agrees: asked now (from the caller) for a free slot there, and later
        only from the waiting task (`InLine.settle`)."""
        ...

    def wake(self, host: str) -> None:
        """The host became usable: offer its free slots to the requests watching it."""
        ...

    async def find_lease(self, key: LeaseKey, ttl: float) -> str | None:
        """The lease's host, if live; a shared lease's TTL slides to `ttl` as it is read."""
        ...

    async def keep_lease(self, key: LeaseKey, host: str, ttl: float, found: str | None) -> None:
        """Lease the conversation to `host` for `ttl`; `found` is the host `find_lease` gave
        this request (a shared lease read there needs no second write)."""
        ...

    async def slot_number(self, key: LeaseKey, host: str, slots: int) -> int | None:
        """The slot number on `host`, the lease's host, that the conversation keeps there,
        shared with as few others as can be (`LeaseTable.slot_number`); None when it holds no
        live lease there, or the number cannot be read now (the request goes on unnumbered)."""
        ...

    async def leave_to_host(self, key: LeaseKey, host: str) -> None:
        """The conversation was served on `host`, its lease's host, before the host's slots
        were known: it keeps no slot number there from now on (`LeaseTable.leave_to_host`)."""
        ...

    def configure(self, host: str, model: str, parallel: int, queue_max: int) -> None: ...
    def remove(self, host: str, model: str) -> None:
        """Forget the pair's configuration: its slots held count until released, and the
        waits in its line end with `HostRemoved` (placement places them again)."""
        ...

    def rename(self, old: str, new: str) -> None:
        """The host `old` is the same box under the name `new`: its slots held (and, where
        the backing can, its lines) count under `new` from now on."""
        ...

    def drop_host(self, host: str) -> None: ...

    def free_for(self, host: str, model: str) -> int: ...
    def free_slots(self, host: str) -> int: ...
    def queued(self, host: str, model: str) -> int: ...
    def in_flight(self, host: str, model: str) -> int: ...
    def snapshot(self) -> list[PairSnapshot]: ...
    def leases_held(self, host: str, model: str | None = None) -> int: ...
    def leases_by_host(self) -> dict[str, int]: ...
    def expire_leases(self) -> None:
        """Count the leases that expired by now out of `leases_held` (before a ranking is
        read; a shared state's counts are a tick's)."""
        ...


class LocalState:
    """One process's limiter and lease table behind `FleetState`. Nothing here suspends."""

    __slots__ = ("limiter", "leases")

    def __init__(self, limiter: Limiter, leases: LeaseTable) -> None:
        self.limiter = limiter
        self.leases = leases

    async def place(
        self, pairs: Iterable[Pair], share: Share = ANONYMOUS, *, shed: bool = True
    ) -> Slot | Waiter | None:
        return self.limiter.place(pairs, share, shed=shed)

    async def open(self, opening: Opening) -> Opened:
        return await open_with(self, opening)

    def watcher(self, share: Share = ANONYMOUS) -> Waiter:
        return self.limiter.waiter(share)

    def watch(self, waiter: InLine, pairs: Iterable[Pair], accept: Callable[[Pair], bool]) -> None:
        assert isinstance(waiter, Waiter), "a local watch needs a local waiter"
        self.limiter.watch(waiter, pairs, accept)

    def wake(self, host: str) -> None:
        self.limiter.wake(host)

    async def find_lease(self, key: LeaseKey, ttl: float) -> str | None:
        return self.leases.find(key)  # `keep_lease` slides it once the request is placed

    async def keep_lease(self, key: LeaseKey, host: str, ttl: float, found: str | None) -> None:
        self.leases.keep(key, host, ttl)  # `find_lease` slid nothing here

    async def slot_number(self, key: LeaseKey, host: str, slots: int) -> int | None:
        return self.leases.slot_number(key, host, slots)

    async def leave_to_host(self, key: LeaseKey, host: str) -> None:
        self.leases.leave_to_host(key, host)

    def configure(self, host: str, model: str, parallel: int, queue_max: int) -> None:
        self.limiter.configure(host, model, parallel, queue_max)

    def remove(self, host: str, model: str) -> None:
        self.limiter.remove(host, model)

    def rename(self, old: str, new: str) -> None:
        self.limiter.rename(old, new)

    def drop_host(self, host: str) -> None:
        self.leases.drop_host(host)

    def free_for(self, host: str, model: str) -> int:
        return self.limiter.free_for(host, model)

    def free_slots(self, host: str) -> int:
        return self.limiter.free_slots(host)

    def queued(self, host: str, model: str) -> int:
        return self.limiter.queued(host, model)

    def in_flight(self, host: str, model: str) -> int:
        return self.limiter.in_flight(host, model)

    def snapshot(self) -> list[PairSnapshot]:
        return self.limiter.snapshot()

    def leases_held(self, host: str, model: str | None = None) -> int:
        return self.leases.held(host, model)

    def leases_by_host(self) -> dict[str, int]:
        return self.leases.held_by_host()

    def expire_leases(self) -> None:
        self.leases.expire()
