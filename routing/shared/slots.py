"""The limiter across processes: slots and FIFO queues per (host, model), held in Redis.

Several gateway processes behind one load balancer must together give a (host, model) at most
`parallel` requests, queue at most `queue_max` more in arrival order whichever process they
came through, and refuse the rest at once. `RedisSlots` does that with one Lua script per
operation (routing/shared/slots_lua.py), so each is atomic and costs one round trip. This
module holds the operations a request calls:

- `place(pairs)`: the first pair, in the order given, with a free slot is taken (`Grant`);
  else a place in the queue of the first pair with room (`Queued`); else None (all full).
  With `queue=False`, a free slot or None. The script reads only the pairs it walks.
- `open(...)`: a conversation's lease read, `place` and the lease written, in one script.
- `wait(queued)`: resolves with the `Grant` a release hands this waiter, oldest first.
- `watch(queued, pairs)`: the waiter may also take a free slot of these other pairs when no
  one waits there (a spill after a patience, a fallback route); grants at once if one is free.
- `cancel(queued)`: leaves every queue and watch; returns a grant that landed first, which the
  caller then uses or releases. Call it whenever a wait ends without a grant (cancelled task,
  timeout, error): that is what keeps a place or a slot from leaking.
- `release(grant)`: hands the slot to the pair's head waiter, else its oldest watcher. A
  second call is a no-op.
- `on_lost(grant, callback)`: hear that Redis stopped counting a slot still held here.

Its parts, each a module of its own: the book of what this process holds
(routing/shared/holdings.py), the pairs' limits (slot_limits.py), the listener through which
a waiter hears its grant (wakes.py), and the restore, reconcile, recheck and sweep that keep
Redis and the book in agreement after an outage, a stall or a cut-off call
(slot_recovery.py). Liveness (routing/shared/state.py): what a process holds carries its id;
a process killed costs the others at most `hold_ttl` plus a second, and one that was only
away never counts a slot taken back from it again (its holders hear through `on_lost`; its
places in line that were taken back fail with StateUnavailable).

While Redis cannot be reached, `place`, `open`, `watch`, `configure` and `snapshot` raise
`StateUnavailable` and waits fail with it once the pub/sub connection cannot be re-made;
`release` and `cancel` never raise for it: the next tick that reaches Redis reconciles.

Use one instance per process and event loop; ids of grants and waiters are this instance's.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from routing.core.limiter import PairSnapshot
from routing.core.pairs import Pair
from routing.shared import slots_lua as lua
from routing.shared.grants import Grant, Queued, Wait, pair_id, split_pair
from routing.shared.holdings import Holdings
from routing.shared.slot_limits import SlotLimits
from routing.shared.slot_recovery import SlotRecovery
from routing.shared.state import Script, Shared, StateUnavailable
from routing.shared.tasks import Tasks
from routing.shared.wakes import WakeListener

__all__ = ["RedisSlots"]

DEFAULT_MAX_WAIT = 3600.0


class RedisSlots:
    """At most `parallel` slots and `queue_max` waiters per (host, model), over all processes.

    `parallel` below 1 counts as 1 and a negative `queue_max` as 0, as in the in-process
    limiter. Only configured pairs can be placed on (ValueError otherwise).
    """

    def __init__(
        self,
        shared: Shared,
        *,
        max_wait: float = DEFAULT_MAX_WAIT,
        on_change: Callable[[str], None] | None = None,
    ) -> None:
        """`on_change(host)`: this instance's count of slots held on the host changed."""
        self._shared = shared
        # A queued request's record outlives any wait shorter than this; a longer wait loses
        # its place (the wait then fails with StateUnavailable at the next check).
        self._max_wait_ms = int(max_wait * 1000)
        self._place = shared.script(lua.PLACE)
        self._open = shared.script(lua.OPEN)
        self._watch = shared.script(lua.WATCH)
        self._cancel = shared.script(lua.CANCEL)
        self._release = shared.script(lua.RELEASE)
        self._snapshot = shared.script(lua.SNAPSHOT)
        self._tasks = Tasks()
        self._book = Holdings(shared.proc, on_change)
        self._limits = SlotLimits(shared, self._book, self._tasks)
        self._recovery = SlotRecovery(shared, self._book, self._limits, self._tasks)
        self._wakes = WakeListener(shared, self._book, self._recovery)
        # The last `place` or `open` refused: each pair asked, (in flight, queued) as Redis
        # counted them then, every process's ({} after one that was not refused).
        self.refused_on: dict[Pair, tuple[int, int]] = {}
        self._snapshots: dict[str, tuple[str, list[PairSnapshot]]] = {}  # by skip: version, list

    # -- life ---------------------------------------------------------------------------

    async def start(self, patience: float = 5.0) -> None:
        """Subscribe to this process's grants; returns once subscribed, or after `patience`
        seconds when Redis cannot be reached (the listener keeps trying)."""
        await self._wakes.start(patience)

    async def aclose(self) -> None:
        """Stop listening. Waits still pending fail with StateUnavailable."""
        await self._wakes.aclose()
        self._book.fail_waits("the gateway is stopping")
        await self._tasks.aclose()

    # -- configuration ------------------------------------------------------------------

    async def configure(self, host: str, model: str, parallel: int, queue_max: int) -> None:
        """Set the pair's limits for every process, keeping its slots held and its queue.

        Raising `parallel` grants waiters at once. Remembered locally first: when Redis is
        away the call raises StateUnavailable and is sent again at the next tick."""
        await self._limits.configure(host, model, parallel, queue_max)

    async def remove(self, host: str, model: str) -> None:
        """Stop configuring the pair: slots held release cleanly, waiters keep their place,
        and it takes no new place; it is forgotten in Redis once idle."""
        await self._limits.remove(host, model)

    def configure_soon(self, host: str, model: str, parallel: int, queue_max: int) -> None:
        """`configure` from synchronous code: the limits apply here at once (places may be
        asked for), and reach Redis in a task of their own, or at the next tick."""
        self._limits.configure_soon(host, model, parallel, queue_max)

    def remove_soon(self, host: str, model: str) -> None:
        """`remove` from synchronous code."""
        self._limits.remove_soon(host, model)

    def rename_soon(self, old: str, new: str) -> None:
        """The host `old` is the box `new` names now: the slots held on its pairs, this
        process's and every other's, count under `new` from now on (the RENAME script, in a
        task of its own; a process that has not reloaded yet releases into the new pair). Its
        lines are not moved: the caller ends their waits, which are placed again."""
        if not new or "/" in new or old == new:
            return
        self._book.rename(old, new)
        self._limits.rename_soon(old, new)

    # -- placing, waiting ---------------------------------------------------------------

    async def place(self, pairs: Iterable[Pair], *, queue: bool = True) -> Grant | Queued | None:
        """Take a slot of the first pair with one free, else (`queue`) a place in the queue of
        the first pair with room, else None. One round trip. Raises StateUnavailable, or
        ValueError for no pairs or a pair not configured here."""
        ids = self._limits.known(pairs)
        if not ids:
            raise ValueError("place() needs at least one (host, model) pair")
        got, reply = await self._placing(self._place, "queue" if queue else "slots", (), ids, ids)
        self.refused_on = _counts(reply[1:]) if reply[0] == "full" else {}
        return got

    async def open(
        self,
        lease: tuple[str, int, int],
        model: str,
        pairs: Sequence[Pair],
        *,
        queue: bool,
        unusable: Iterable[str],
        strict: bool,
        patient: bool,
    ) -> tuple[Grant | Queued | str | None, list[Any]]:
        """A conversation's lease read, the place that follows and the lease written, in one
        round trip (the OPEN script's choice; `lease`: its id, ttl ms and cap; `pairs` the
        ranking's, best first; `queue` as `place`'s, for `pairs`). Returns what was taken
        (None when full, "pinned" for a strict route's unusable home) and the reply's lease
        fields: the lease's host as found, the host leased now, whether home was usable, and
        the leases' version after the write (`RedisLeases.counted_up_to`).
        Raises StateUnavailable, or ValueError for a pair not configured here."""
        ids = self._limits.known(pairs)
        out = list(unusable)
        args = (*lease, model, "1" if strict else "0", "1" if patient else "0", len(out), *out)
        # Home's pair is read in Redis: a lost reply is settled over every pair of the model.
        cover = self._limits.of_model(model)
        got, reply = await self._placing(self._open, "queue" if queue else "slots", args, ids,
                                         cover)  # fmt: skip
        self.refused_on = _counts(reply[7:]) if reply[0] == "full" else {}
        if reply[0] == "pinned":
            return "pinned", reply[3:7]
        return got, reply[3:7]

    async def _placing(
        self, script: Script, mode: str, args: tuple[Any, ...], ids: list[str], cover: list[str]
    ) -> tuple[Grant | Queued | None, list[Any]]:
        """Run a placing script (PLACE, OPEN) for a new waiter id; what it took, and its reply.
        `cover`: every pair the script may take, to give back when its reply is lost."""
        wid = self._book.new_id()
        entry = Wait(wid, list(cover), asyncio.get_running_loop().create_future(),
                      time.monotonic())  # fmt: skip
        # Registered before the script runs: the grant's message may come before its reply.
        self._book.add_wait(entry)
        try:
            reply = await script(wid, self._max_wait_ms, mode, "0", *args, *ids)
            if reply[0] == "lapsed":  # Redis restarted, or this process was away: tick first
                await self._shared.revive()
                reply = await script(wid, self._max_wait_ms, mode, "1", *args, *ids)
            elif reply[0] == "unconfigured":  # another process removed the pair meanwhile
                await self._recovery.restore()
                reply = await script(wid, self._max_wait_ms, mode, "1", *args, *ids)
        except BaseException:
            # The script may have run without its reply reaching us: what it took must go.
            self._book.drop_wait(wid)
            if entry.future.done() and not entry.future.cancelled():
                self._book.unhold(entry.future.result())  # its grant's message came first
            self._recovery.settle_soon(wid, cover)
            raise
        kind = reply[0]
        if kind == "queued":
            if entry.future.done() and not entry.future.cancelled():
                self._book.drop_wait(wid)  # granted before the reply arrived
                return entry.future.result(), reply
            host, model = split_pair(reply[1])
            # A place in a line is granted there, or on what it watches later: no longer on
            # every pair `cover` named.
            entry.pairs = list(dict.fromkeys((reply[1], *ids)))
            entry.queued = Queued(wid, host, model, int(reply[2]), entry.since)
            return entry.queued, reply
        self._book.drop_wait(wid)
        if kind == "grant":
            return self._book.hold(wid, reply[1], 0.0), reply
        if kind in ("full", "pinned"):
            return None, reply
        raise StateUnavailable(f"shared state lost the configuration of {', '.join(ids)}")

    async def wait(self, queued: Queued) -> Grant:
        """The grant a release hands this waiter. Woken by its message, never by polling.

        Raises StateUnavailable when the place was lost (Redis restarted or unreachable). If
        this raises or is cancelled, call `cancel(queued)`."""
        entry = self._book.wait_for(queued.id)
        if entry is None:
            raise ValueError(f"{queued.id} is not waiting (granted or cancelled already)")
        grant = await entry.future
        self._book.drop_wait(queued.id)
        return grant

    async def wait_unless(self, queued: Queued, ended: asyncio.Future[Any]) -> Grant | None:
        """`wait`, or None as soon as `ended` is done first (the waiter keeps its place until
        `cancel(queued)`)."""
        entry = self._book.wait_for(queued.id)
        if entry is not None and not entry.future.done():
            await asyncio.wait((entry.future, ended), return_when=asyncio.FIRST_COMPLETED)
            if not entry.future.done():
                return None
        return await self.wait(queued)

    async def watch(self, queued: Queued, pairs: Sequence[Pair]) -> Grant | None:
        """Let this waiter also take a free slot of these pairs when no one waits there.

        Returns the grant when one is free now (then `wait` returns it too), else None and the
        waiter keeps its own place. Raises StateUnavailable."""
        entry = self._book.wait_for(queued.id)
        if entry is None:
            raise ValueError(f"{queued.id} is not waiting (granted or cancelled already)")
        ids = self._limits.known(pairs)
        entry.pairs.extend(pair for pair in ids if pair not in entry.pairs)  # cancel covers them
        if entry.future.done():
            return None if entry.future.cancelled() else entry.future.result()
        own = pair_id(queued.host, queued.model)
        reply = await self._watch(queued.id, own, *ids)
        if entry.future.done():
            return None if entry.future.cancelled() else entry.future.result()
        if reply[0] == "grant":
            return self._book.landed(entry, reply[1])
        if reply[0] == "gone":
            exc = StateUnavailable("the queue place was lost (Redis restarted or unreachable)")
            entry.future.set_exception(exc)
            raise exc
        return None

    async def cancel(self, queued: Queued) -> Grant | None:
        """Leave every queue and watch. Returns the grant that reached the waiter first (use
        or release it), else None. Never raises StateUnavailable: when Redis is away the
        clean-up waits for the next tick that reaches it, which releases any grant found."""
        entry = self._book.drop_wait(queued.id)
        if entry is None:
            return None
        future = entry.future
        if future.done() and not future.cancelled() and future.exception() is None:
            return future.result()
        future.cancel()
        try:
            reply = await self._cancel(queued.id, *entry.pairs)
        except StateUnavailable:
            self._book.unsure()
            return None
        except BaseException:
            self._recovery.settle_soon(queued.id, entry.pairs)
            raise
        if reply[0] == "grant":
            return self._book.hold(queued.id, reply[1], time.monotonic() - entry.since)
        return None

    def release_soon(self, grant: Grant) -> bool:
        """`release` from synchronous code, in a task of its own. Whether the grant was held
        (False for a second call)."""
        if not self._book.unhold(grant):
            return False
        self._tasks.spawn(self._give_back(grant))
        return True

    def cancel_soon(self, queued: Queued) -> None:
        """`cancel` from synchronous code: a grant that landed first is released."""

        async def cancel() -> None:
            grant = await self.cancel(queued)
            if grant is not None:
                await self.release(grant)

        self._tasks.spawn(cancel())

    async def release(self, grant: Grant) -> None:
        """Give the slot back; it goes to the head waiter (or a watcher) in the same step.

        Idempotent. Never raises StateUnavailable: an unreachable Redis gets it at the next
        tick that reaches it."""
        if self._book.unhold(grant):
            await self._give_back(grant)

    async def _give_back(self, grant: Grant) -> None:
        pair = self._book.counted_pair(grant)
        try:
            await self._release(grant.id, pair)
        except StateUnavailable:
            self._book.unsure()
        except BaseException:
            self._recovery.settle_soon(grant.id, [pair])
            raise

    def on_lost(self, grant: Grant, callback: Callable[[], None]) -> None:
        """Have `callback` called once, soon, if Redis stops counting `grant` while it is held
        here: this process was away from Redis past its hold TTL (stalled, cut off) and another
        took the slot back, or Redis restarted empty and the pair has no room for it any more.
        Never after the grant's release; soon if it is lost already. One callback per grant."""
        self._book.on_lost(grant, callback)

    async def snapshot(self, *, others_only: bool = False) -> list[PairSnapshot]:
        """In flight and queued per configured pair over every process (or, `others_only`,
        over every other process), sorted. When nothing changed since the last call, the
        list that call returned (do not change it)."""
        skip = self._shared.proc if others_only else ""
        version, last = self._snapshots.get(skip, ("", []))
        flat = await self._snapshot(skip, version)
        if not flat:
            return last  # the same list as the last time: nothing changed
        states = []
        for i in range(1, len(flat), 5):
            host, model = split_pair(flat[i])
            states.append(PairSnapshot(host, model, *(int(value) for value in flat[i + 1 : i + 5])))
        states.sort(key=lambda state: (state.host, state.model))
        self._snapshots[skip] = (flat[0], states)
        return states

    def held(self) -> int:
        """Grants of this instance not yet released (for tests and the shutdown log)."""
        return self._book.held()

    def held_pairs(self) -> list[Pair]:
        """The pairs this instance holds grants on (under their hosts' names now)."""
        return self._book.held_pairs()

    def held_on(self, host: str, model: str) -> int:
        """Grants of this instance on one pair not yet released: exact, no round trip."""
        return self._book.held_on(host, model)


def _counts(flat: list[Any]) -> dict[Pair, tuple[int, int]]:
    """A refusal's counts (pair, held, queued, ...) by (host, model): (in flight, queued)."""
    return {
        split_pair(flat[i]): (int(flat[i + 1]), int(flat[i + 2])) for i in range(0, len(flat), 3)
    }
