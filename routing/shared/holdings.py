"""What one process holds in the shared limiter, as it knows it: its book.

Redis counts every process's slots and places; `Holdings` is this process's own record of
them, which the slot operations (routing/shared/slots.py), the grant listener
(routing/shared/wakes.py) and the restore path (routing/shared/slot_recovery.py) all write:

- the grants it holds (`hold`, `unhold`), counted per pair exactly and at no round trip
  (`held_on`), under their hosts' current names (`rename`, `counted_as`);
- the waits under way (`add_wait`, `grant_reached`, `fail_waits`): a grant that reaches one
  resolves its future, once;
- the grants Redis stopped counting while they are still held here (`lose`, `on_lost`);
- whether Redis may hold something for this process that the book no longer knows of (a call
  cut off, or sent while Redis was away: `unsure`), which the next tick reconciles.

The book never talks to Redis and no method awaits, so each change is atomic with respect to
the other tasks on the loop. Use it on one event loop; it is not thread-safe.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable

from routing.core.pairs import Pair
from routing.shared.grants import Grant, Wait, pair_id, split_pair
from routing.shared.state import StateUnavailable

__all__ = ["Holdings"]

log = logging.getLogger("crossbar.shared.slots")


class Holdings:
    """The grants and waits of one process, with ids unique to it (`<proc>.<n>`).

    `on_change(host)` is told whenever the count of grants held on the host changes.
    """

    def __init__(self, proc: str, on_change: Callable[[str], None] | None = None) -> None:
        self._proc = proc
        self._changed = on_change
        self._ids = itertools.count(1)
        self._last_id = 0
        self._held: dict[str, Grant] = {}
        self._held_per_pair: dict[Pair, int] = {}  # the same grants, counted
        # Grants held on a host renamed since they were taken: grant id -> the pair they count
        # on now (`rename`). Per grant, not per name: a host given the old name later is
        # another host, and its grants count under that name.
        self._moved: dict[str, Pair] = {}
        # Grants Redis stopped counting (this process was away) that their holders still hold,
        # and the callbacks of held grants whose holders want to hear of that.
        self._lost: set[str] = set()
        self._on_lost: dict[str, Callable[[], None]] = {}
        self._waits: dict[str, Wait] = {}
        self._unsure = False

    # -- ids ----------------------------------------------------------------------------

    def new_id(self) -> str:
        """A new id for a waiter (and the grant it may become)."""
        self._last_id = next(self._ids)
        return f"{self._proc}.{self._last_id}"

    @property
    def last_id(self) -> int:
        """The number of the last id handed out: Redis may know of none after it."""
        return self._last_id

    def ids(self) -> list[str]:
        """Every id the book knows of: the waits', then the held grants'."""
        return [*self._waits, *self._held]

    # -- grants -------------------------------------------------------------------------

    def hold(self, gid: str, pair: str, waited: float) -> Grant:
        """Count the slot Redis granted `gid` on `pair` as held here; the grant."""
        host, model = split_pair(pair)
        grant = self._held[gid] = Grant(host, model, gid, waited)
        counted, key = self._held_per_pair, Pair(host, model)
        counted[key] = counted.get(key, 0) + 1
        if self._changed is not None:
            self._changed(host)
        return grant

    def unhold(self, grant: Grant) -> bool:
        """Forget a held grant; whether it was held (False for a lost one, or a second call)."""
        self._on_lost.pop(grant.id, None)
        key = self.counted_as(grant)
        self._moved.pop(grant.id, None)
        if self._held.pop(grant.id, None) is None:
            self._lost.discard(grant.id)
            return False
        left = self._held_per_pair.pop(key) - 1
        if left:
            self._held_per_pair[key] = left
        if self._changed is not None:
            self._changed(grant.host)
        return True

    def get(self, gid: str) -> Grant | None:
        """The grant `gid` if it is held here."""
        return self._held.get(gid)

    def grants(self) -> list[Grant]:
        """The grants held here, oldest first."""
        return list(self._held.values())

    def held(self) -> int:
        """The number of grants held here."""
        return len(self._held)

    def held_pairs(self) -> list[Pair]:
        """The pairs grants are held on (under their hosts' names now)."""
        return list(self._held_per_pair)

    def held_on(self, host: str, model: str) -> int:
        """The grants held on one pair: exact, no round trip."""
        return self._held_per_pair.get(Pair(host, model), 0)

    def counted_as(self, grant: Grant) -> Pair:
        """The pair `grant` counts in now: where it was taken, or under its host's new name
        once that host was renamed while the grant was held."""
        return self._moved.get(grant.id) or Pair(grant.host, grant.model)

    def counted_pair(self, grant: Grant) -> str:
        """`counted_as` for a grant, as Redis names the pair."""
        return pair_id(*self.counted_as(grant))

    def rename(self, old: str, new: str) -> None:
        """The host `old` is named `new` now: the grants held there count under `new`."""
        for grant in self._held.values():
            pair = self.counted_as(grant)
            if pair.host == old:
                self._moved[grant.id] = Pair(new, pair.model)
        for pair, count in list(self._held_per_pair.items()):
            if pair.host == old:
                del self._held_per_pair[pair]
                key = Pair(new, pair.model)
                self._held_per_pair[key] = self._held_per_pair.get(key, 0) + count

    def on_lost(self, grant: Grant, callback: Callable[[], None]) -> None:
        """Have `callback` called once, soon, if `lose(grant)` comes before its release; soon
        if it is lost already; never after its release. One callback per grant."""
        if grant.id in self._lost:
            asyncio.get_running_loop().call_soon(callback)
        elif grant.id in self._held:
            self._on_lost[grant.id] = callback

    def lose(self, grant: Grant) -> None:
        """Redis no longer counts `grant`, which is held here: it is no longer held, and its
        holder's `on_lost` callback runs soon (its request must end)."""
        log.warning(
            "shared slots: a slot of %s/%s is lost: Redis stopped counting it while this "
            "process was away (or Redis restarted) and it went to another request",
            grant.host, grant.model,
        )  # fmt: skip
        callback = self._on_lost.get(grant.id)
        self.unhold(grant)
        self._lost.add(grant.id)
        if callback is not None:
            asyncio.get_running_loop().call_soon(callback)

    # -- waits --------------------------------------------------------------------------

    def add_wait(self, wait: Wait) -> None:
        """Keep `wait` until it is dropped: from now on a grant for its id resolves it."""
        self._waits[wait.id] = wait

    def wait_for(self, wid: str) -> Wait | None:
        return self._waits.get(wid)

    def drop_wait(self, wid: str) -> Wait | None:
        """Forget the wait `wid` (the one dropped, or None)."""
        return self._waits.pop(wid, None)

    def pending(self) -> list[Wait]:
        """The waits not resolved yet."""
        return [wait for wait in self._waits.values() if not wait.future.done()]

    def landed(self, wait: Wait, pair: str) -> Grant:
        """A grant on `pair` reached `wait`: count it held and resolve the wait's future with
        it (once: a wait resolved already keeps its result, which is returned)."""
        if wait.future.done():
            return wait.future.result()
        grant = self.hold(wait.id, pair, time.monotonic() - wait.since)
        wait.future.set_result(grant)
        return grant

    def grant_reached(self, wid: str, pair: str) -> None:
        """A grant's message for `wid` came: the wait lands it, if it still waits. (Not
        waiting: it was cancelled here, and the cancel script finds the grant and returns it.)"""
        wait = self._waits.get(wid)
        if wait is not None and not wait.future.done():
            self.landed(wait, pair)

    def fail_waits(self, why: str) -> None:
        """Fail every place in a line still waiting with StateUnavailable (`why`)."""
        for wait in self._waits.values():
            if wait.queued is not None and not wait.future.done():
                wait.future.set_exception(StateUnavailable(f"shared state unavailable: {why}"))

    # -- what Redis may hold that the book does not -------------------------------------

    def unsure(self) -> None:
        """A call's outcome in Redis is unknown (Redis away, the call cancelled)."""
        self._unsure = True

    def take_unsure(self) -> bool:
        """Whether `unsure` was called since the last `take_unsure`; clears it."""
        unsure, self._unsure = self._unsure, False
        return unsure
