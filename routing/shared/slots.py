"""The limiter across processes: slots and FIFO queues per (host, model), held in Redis.

Several gateway processes behind one load balancer must together give a (host, model) at most
`parallel` requests, queue at most `queue_max` more in arrival order whichever process they
came through, and refuse the rest at once. `RedisSlots` does that with one Lua script per
operation (routing/shared/slots_lua.py), so each is atomic and costs one round trip:

- `place(pairs)`: the first pair, in the order given, with a free slot is taken (`Grant`);
  else a place in the queue of the first pair with room (`Queued`); else None (all full).
  With `queue=False`, a free slot or None. The script reads only the pairs it walks.
- `wait(queued)`: resolves with the `Grant` a release hands this waiter, oldest first.
- `watch(queued, pairs)`: the waiter may also take a free slot of these other pairs when no
  one waits there (a spill after a patience, a fallback route); grants at once if one is free.
- `cancel(queued)`: leaves every queue and watch; returns a grant that landed first, which the
  caller then uses or releases. Call it whenever a wait ends without a grant (cancelled task,
  timeout, error): that is what keeps a place or a slot from leaking.
- `release(grant)`: hands the slot to the pair's head waiter, else its oldest watcher. A
  second call is a no-op.
- `on_lost(grant, callback)`: hear that Redis stopped counting a slot still held here (below).

How a waiter hears its grant: the script that frees a slot counts it as the waiter's and
publishes "<waiter>\\n<pair>" on the waiter's process channel; each process keeps one pub/sub
connection and resolves the waiting future. That is one connection per process whatever the
number of waiters (a blocking pop per waiter would hold a Redis connection per queued
request). Pub/sub drops messages while its connection is down, so every (re)subscription is
followed by one check of this process's waiters against Redis, where the grant is recorded.

Liveness (routing/shared/state.py): what a process holds carries its id; once its liveness key
expired (`hold_ttl`, default 5 s), the next script that finds the pair full, and the sweep one
process runs each second, take its slots and places back and hand them on. So a process killed
with SIGKILL costs the others at most `hold_ttl` plus a second. A process that was only away
(stalled, cut off from Redis) and comes back never counts such a slot again, even for an
instant: it learns which of its slots are gone and tells their holders (`on_lost`), whose
requests must end. Its places in line that were taken back fail with StateUnavailable.

While Redis cannot be reached, `place`, `watch`, `configure` and `snapshot` raise
`StateUnavailable` and waits fail with it once the pub/sub connection cannot be re-made;
`release` and `cancel` never raise for it: at the next tick that reaches Redis, one script
drops whatever Redis still holds for this process that it no longer knows of, so an outage
(or a call cancelled half way) leaks nothing. After Redis restarted empty, each process
restores its configuration and re-counts the slots it still holds (their requests still run)
while their pairs have room; a slot another process took meanwhile is lost, as above.

Use one instance per process and event loop; ids of grants and waiters are this instance's.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import time
from collections.abc import Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from routing.core.limiter import PairSnapshot
from routing.shared import slots_lua as lua
from routing.shared.state import UNREACHABLE, Script, Shared, StateUnavailable

__all__ = ["Grant", "Queued", "RedisSlots", "StateUnavailable"]

log = logging.getLogger("crossbar.shared.slots")

DEFAULT_MAX_WAIT = 3600.0


@dataclass(slots=True, frozen=True)
class Grant:
    """One held slot. `waited` is the seconds spent queued (0.0 when a slot was free)."""

    host: str
    model: str
    id: str
    waited: float = 0.0


@dataclass(slots=True, eq=False)
class Queued:
    """A place in the queue of (host, model); `position` is its 1-based place when it joined."""

    id: str
    host: str
    model: str
    position: int
    since: float = field(default_factory=time.monotonic)


@dataclass(slots=True, eq=False)
class _Wait:
    id: str
    pairs: list[str]  # every pair it may be granted on: the ones placed on, then the watched
    future: asyncio.Future[Grant]
    since: float
    queued: Queued | None = None  # None while the place script is under way


def pair_id(host: str, model: str) -> str:
    return f"{host}/{model}"


def split_pair(pair: str) -> tuple[str, str]:
    host, _, model = pair.partition("/")
    return host, model


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
        self._shared = shared
        # Told the host whenever this instance's count of slots held there changes.
        self._changed = on_change
        # A queued request's record outlives any wait shorter than this; a longer wait loses
        # its place (the wait then fails with StateUnavailable at the next check).
        self._max_wait_ms = int(max_wait * 1000)
        self._configure = shared.script(lua.CONFIGURE)
        self._remove = shared.script(lua.REMOVE)
        self._rename = shared.script(lua.RENAME)
        self._place = shared.script(lua.PLACE)
        self._open = shared.script(lua.OPEN)
        self._watch = shared.script(lua.WATCH)
        self._cancel = shared.script(lua.CANCEL)
        self._release = shared.script(lua.RELEASE)
        self._check = shared.script(lua.CHECK)
        self._restore_script = shared.script(lua.RESTORE)
        self._sweep = shared.script(lua.SWEEP)
        self._snapshot = shared.script(lua.SNAPSHOT)
        self._reconcile = shared.script(lua.RECONCILE)
        self._channel = f"{shared.prefix}wake:{shared.proc}"
        self._ids = itertools.count(1)
        self._last_id = 0
        self._configs: dict[str, tuple[int, int]] = {}
        self._unsent: set[str] = set()  # configure/remove calls Redis did not get
        self._held: dict[str, Grant] = {}
        self._held_per_pair: dict[tuple[str, str], int] = {}  # the same grants, counted
        # Hosts renamed since grants were taken under their old names: old -> new (`rename`).
        self._renamed: dict[str, str] = {}
        # The last `place` or `open` refused: each pair asked, (in flight, queued) as Redis
        # counted them then, every process's ({} after one that was not refused).
        self.refused_on: dict[tuple[str, str], tuple[int, int]] = {}
        # Grants Redis stopped counting (this process was away) that their holders still hold,
        # and the callbacks of held grants whose holders want to hear of that.
        self._lost: set[str] = set()
        self._on_lost: dict[str, Callable[[], None]] = {}
        self._epoch = ""  # Redis's epoch when this process last put its slots back
        self._restoring = asyncio.Lock()
        self._waits: dict[str, _Wait] = {}
        self._snapshots: dict[str, tuple[str, list[PairSnapshot]]] = {}  # by skip: version, list
        # Set when a call's outcome in Redis is unknown (Redis away, the call cancelled): the
        # next tick drops whatever Redis holds for this process that it no longer knows of.
        self._reconcile_needed = False
        self._recheck_needed = False
        self._tasks: set[asyncio.Task[Any]] = set()
        self._listener: asyncio.Task[None] | None = None
        self._stopping = False  # as in Shared.aclose: a cancellation may be swallowed
        self._subscribed = asyncio.Event()
        shared.on_restore(self._restore)
        shared.on_tick(self._tick)

    # -- life ---------------------------------------------------------------------------

    async def start(self, patience: float = 5.0) -> None:
        """Subscribe to this process's grants; returns once subscribed, or after `patience`
        seconds when Redis cannot be reached (the listener keeps trying)."""
        if self._listener is None:
            self._listener = asyncio.create_task(self._listen_forever(), name="crossbar-wakes")
        try:
            async with asyncio.timeout(patience):
                await self._subscribed.wait()
        except TimeoutError:
            log.warning("shared slots: not subscribed to grants yet; still trying")

    async def aclose(self) -> None:
        """Stop listening. Waits still pending fail with StateUnavailable."""
        if self._listener is not None:
            self._stopping = True
            self._listener.cancel()
            await asyncio.gather(self._listener, return_exceptions=True)
            self._listener = None
        self._fail_waits("the gateway is stopping")
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # -- configuration ------------------------------------------------------------------

    async def configure(self, host: str, model: str, parallel: int, queue_max: int) -> None:
        """Set the pair's limits for every process, keeping its slots held and its queue.

        Raising `parallel` grants waiters at once. Remembered locally first: when Redis is
        away the call raises StateUnavailable and is sent again at the next tick."""
        await self._send_config(self._remember(host, model, parallel, queue_max))

    async def remove(self, host: str, model: str) -> None:
        """Stop configuring the pair: slots held release cleanly, waiters keep their place,
        and it takes no new place; it is forgotten in Redis once idle."""
        await self._send_config(self._forget(host, model))

    def configure_soon(self, host: str, model: str, parallel: int, queue_max: int) -> None:
        """`configure` from synchronous code: the limits apply here at once (places may be
        asked for), and reach Redis in a task of their own, or at the next tick."""
        self._send_soon(self._remember(host, model, parallel, queue_max))

    def remove_soon(self, host: str, model: str) -> None:
        """`remove` from synchronous code."""
        self._send_soon(self._forget(host, model))

    def _remember(self, host: str, model: str, parallel: int, queue_max: int) -> str:
        if not host or "/" in host:
            raise ValueError(f"a host name must be non-empty and without '/': {host!r}")
        pair = pair_id(host, model)
        self._configs[pair] = (max(1, parallel), max(0, queue_max))
        return pair

    def _forget(self, host: str, model: str) -> str:
        pair = pair_id(host, model)
        self._configs.pop(pair, None)
        return pair

    def rename_soon(self, old: str, new: str) -> None:
        """The host `old` is the box `new` names now: the slots held on its pairs, this
        process's and every other's, count under `new` from now on (the RENAME script, in a
        task of its own; a process that has not reloaded yet releases into the new pair). Its
        lines are not moved: the caller ends their waits, which are placed again."""
        if not new or "/" in new or old == new:
            return
        self._renamed = {was: (new if now == old else now) for was, now in self._renamed.items()}
        self._renamed.pop(new, None)  # a name back in use is its own again
        self._renamed[old] = new
        for (host, model), count in list(self._held_per_pair.items()):
            if host == old:
                del self._held_per_pair[(host, model)]
                key = (new, model)
                self._held_per_pair[key] = self._held_per_pair.get(key, 0) + count
        for pair in [pair for pair in self._configs if split_pair(pair)[0] == old]:
            del self._configs[pair]
            target = pair_id(new, split_pair(pair)[1])

            async def send(pair: str = pair, target: str = target) -> None:
                try:
                    await self._rename(pair, target)
                except StateUnavailable:
                    self._reconcile_needed = True  # the releases find the slots either way

            self._spawn(send())

    def _pair_of(self, host: str, model: str) -> tuple[str, str]:
        """The pair a slot taken on (host, model) counts in now: under the host's new name
        once renamed."""
        return self._renamed.get(host, host), model

    def _send_soon(self, pair: str) -> None:
        self._unsent.add(pair)

        async def send() -> None:
            try:
                await self._send_config(pair)
            except StateUnavailable:
                pass  # still in _unsent: the next tick that reaches Redis sends it

        self._spawn(send())

    async def _send_config(self, pair: str) -> None:
        self._unsent.add(pair)
        limits = self._configs.get(pair)
        if limits is None:
            await self._remove(pair)
        else:
            await self._configure(pair, *limits)
        self._unsent.discard(pair)

    # -- placing, waiting ---------------------------------------------------------------

    async def place(
        self, pairs: Iterable[tuple[str, str]], *, queue: bool = True
    ) -> Grant | Queued | None:
        """Take a slot of the first pair with one free, else (`queue`) a place in the queue of
        the first pair with room, else None. One round trip. Raises StateUnavailable, or
        ValueError for no pairs or a pair not configured here."""
        ids = self._known(pairs)
        if not ids:
            raise ValueError("place() needs at least one (host, model) pair")
        got, reply = await self._placing(self._place, "queue" if queue else "slots", (), ids, ids)
        self.refused_on = _counts(reply[1:]) if reply[0] == "full" else {}
        return got

    async def open(
        self,
        lease: tuple[str, int, int],
        model: str,
        pairs: Sequence[tuple[str, str]],
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
        ids = self._known(pairs)
        out = list(unusable)
        args = (*lease, model, "1" if strict else "0", "1" if patient else "0", len(out), *out)
        # Home's pair is read in Redis: a lost reply is settled over every pair of the model.
        cover = [pair for pair in self._configs if split_pair(pair)[1] == model]
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
        wid = self._new_id()
        entry = _Wait(wid, list(cover), asyncio.get_running_loop().create_future(),
                      time.monotonic())  # fmt: skip
        # Registered before the script runs: the grant's message may come before its reply.
        self._waits[wid] = entry
        try:
            reply = await script(wid, self._max_wait_ms, mode, "0", *args, *ids)
            if reply[0] == "lapsed":  # Redis restarted, or this process was away: tick first
                await self._shared.revive()
                reply = await script(wid, self._max_wait_ms, mode, "1", *args, *ids)
            elif reply[0] == "unconfigured":  # another process removed the pair meanwhile
                await self._restore()
                reply = await script(wid, self._max_wait_ms, mode, "1", *args, *ids)
        except BaseException:
            # The script may have run without its reply reaching us: what it took must go.
            del self._waits[wid]
            if entry.future.done() and not entry.future.cancelled():
                self._unhold(entry.future.result())  # its grant's message came first
            self._settle_soon(wid, cover)
            raise
        kind = reply[0]
        if kind == "queued":
            if entry.future.done() and not entry.future.cancelled():
                del self._waits[wid]  # granted before the reply arrived
                return entry.future.result(), reply
            host, model = split_pair(reply[1])
            # A place in a line is granted there, or on what it watches later: no longer on
            # every pair `cover` named.
            entry.pairs = list(dict.fromkeys((reply[1], *ids)))
            entry.queued = Queued(wid, host, model, int(reply[2]), entry.since)
            return entry.queued, reply
        del self._waits[wid]
        if kind == "grant":
            return self._hold(wid, reply[1], 0.0), reply
        if kind in ("full", "pinned"):
            return None, reply
        raise StateUnavailable(f"shared state lost the configuration of {', '.join(ids)}")

    async def wait(self, queued: Queued) -> Grant:
        """The grant a release hands this waiter. Woken by its message, never by polling.

        Raises StateUnavailable when the place was lost (Redis restarted or unreachable). If
        this raises or is cancelled, call `cancel(queued)`."""
        entry = self._waits.get(queued.id)
        if entry is None:
            raise ValueError(f"{queued.id} is not waiting (granted or cancelled already)")
        grant = await entry.future
        self._waits.pop(queued.id, None)
        return grant

    async def wait_unless(self, queued: Queued, ended: asyncio.Future[Any]) -> Grant | None:
        """`wait`, or None as soon as `ended` is done first (the waiter keeps its place until
        `cancel(queued)`)."""
        entry = self._waits.get(queued.id)
        if entry is not None and not entry.future.done():
            await asyncio.wait((entry.future, ended), return_when=asyncio.FIRST_COMPLETED)
            if not entry.future.done():
                return None
        return await self.wait(queued)

    async def watch(self, queued: Queued, pairs: Sequence[tuple[str, str]]) -> Grant | None:
        """Let this waiter also take a free slot of these pairs when no one waits there.

        Returns the grant when one is free now (then `wait` returns it too), else None and the
        waiter keeps its own place. Raises StateUnavailable."""
        entry = self._waits.get(queued.id)
        if entry is None:
            raise ValueError(f"{queued.id} is not waiting (granted or cancelled already)")
        ids = self._known(pairs)
        entry.pairs.extend(pair for pair in ids if pair not in entry.pairs)  # cancel covers them
        if entry.future.done():
            return None if entry.future.cancelled() else entry.future.result()
        own = pair_id(queued.host, queued.model)
        reply = await self._watch(queued.id, own, *ids)
        if entry.future.done():
            return None if entry.future.cancelled() else entry.future.result()
        if reply[0] == "grant":
            return self._landed(entry, reply[1])
        if reply[0] == "gone":
            exc = StateUnavailable("the queue place was lost (Redis restarted or unreachable)")
            entry.future.set_exception(exc)
            raise exc
        return None

    async def cancel(self, queued: Queued) -> Grant | None:
        """Leave every queue and watch. Returns the grant that reached the waiter first (use
        or release it), else None. Never raises StateUnavailable: when Redis is away the
        clean-up waits for the next tick that reaches it, which releases any grant found."""
        entry = self._waits.pop(queued.id, None)
        if entry is None:
            return None
        future = entry.future
        if future.done() and not future.cancelled() and future.exception() is None:
            return future.result()
        future.cancel()
        try:
            reply = await self._cancel(queued.id, *entry.pairs)
        except StateUnavailable:
            self._reconcile_needed = True
            return None
        except BaseException:
            self._settle_soon(queued.id, entry.pairs)
            raise
        if reply[0] == "grant":
            return self._hold(queued.id, reply[1], time.monotonic() - entry.since)
        return None

    def release_soon(self, grant: Grant) -> bool:
        """`release` from synchronous code, in a task of its own. Whether the grant was held
        (False for a second call)."""
        if not self._unhold(grant):
            return False
        self._spawn(self._give_back(grant))
        return True

    def cancel_soon(self, queued: Queued) -> None:
        """`cancel` from synchronous code: a grant that landed first is released."""

        async def cancel() -> None:
            grant = await self.cancel(queued)
            if grant is not None:
                await self.release(grant)

        self._spawn(cancel())

    async def release(self, grant: Grant) -> None:
        """Give the slot back; it goes to the head waiter (or a watcher) in the same step.

        Idempotent. Never raises StateUnavailable: an unreachable Redis gets it at the next
        tick that reaches it."""
        if self._unhold(grant):
            await self._give_back(grant)

    async def _give_back(self, grant: Grant) -> None:
        pair = pair_id(*self._pair_of(grant.host, grant.model))
        try:
            await self._release(grant.id, pair)
        except StateUnavailable:
            self._reconcile_needed = True
        except BaseException:
            self._settle_soon(grant.id, [pair])
            raise

    def on_lost(self, grant: Grant, callback: Callable[[], None]) -> None:
        """Have `callback` called once, soon, if Redis stops counting `grant` while it is held
        here: this process was away from Redis past its hold TTL (stalled, cut off) and another
        took the slot back, or Redis restarted empty and the pair has no room for it any more.
        Never after the grant's release; soon if it is lost already. One callback per grant."""
        if grant.id in self._lost:
            asyncio.get_running_loop().call_soon(callback)
        elif grant.id in self._held:
            self._on_lost[grant.id] = callback

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
        return len(self._held)

    def held_pairs(self) -> list[tuple[str, str]]:
        """The pairs this instance holds grants on (under their hosts' names now)."""
        return list(self._held_per_pair)

    def held_on(self, host: str, model: str) -> int:
        """Grants of this instance on one pair not yet released: exact, no round trip."""
        return self._held_per_pair.get((host, model), 0)

    # -- internals ----------------------------------------------------------------------

    def _new_id(self) -> str:
        self._last_id = next(self._ids)
        return f"{self._shared.proc}.{self._last_id}"

    def _known(self, pairs: Iterable[tuple[str, str]]) -> list[str]:
        ids = []
        for host, model in pairs:
            pair = pair_id(host, model)
            if pair not in self._configs:
                raise ValueError(f"{pair} is not configured")
            if pair not in ids:
                ids.append(pair)
        return ids

    def _hold(self, gid: str, pair: str, waited: float) -> Grant:
        host, model = split_pair(pair)
        grant = self._held[gid] = Grant(host, model, gid, waited)
        counted, key = self._held_per_pair, self._pair_of(host, model)
        counted[key] = counted.get(key, 0) + 1
        if self._changed is not None:
            self._changed(host)
        return grant

    def _unhold(self, grant: Grant) -> bool:
        """Forget a held grant; whether it was held (not for a lost one)."""
        self._on_lost.pop(grant.id, None)
        if self._held.pop(grant.id, None) is None:
            self._lost.discard(grant.id)
            return False
        key = self._pair_of(grant.host, grant.model)
        left = self._held_per_pair.pop(key) - 1
        if left:
            self._held_per_pair[key] = left
        if self._changed is not None:
            self._changed(grant.host)
        return True

    def _landed(self, entry: _Wait, pair: str) -> Grant:
        """A grant reached a pending waiter: count it held, wake whoever waits for it."""
        if entry.future.done():
            return entry.future.result()
        grant = self._hold(entry.id, pair, time.monotonic() - entry.since)
        entry.future.set_result(grant)
        return grant

    def _on_wake(self, data: str) -> None:
        wid, _, pair = data.partition("\n")
        entry = self._waits.get(wid)
        # No entry: it was cancelled here, and the cancel script finds this grant and returns it.
        if entry is not None and not entry.future.done():
            self._landed(entry, pair)

    def _fail_waits(self, why: str) -> None:
        for entry in self._waits.values():
            if entry.queued is not None and not entry.future.done():
                entry.future.set_exception(StateUnavailable(f"shared state unavailable: {why}"))

    def _settle_soon(self, wid: str, pairs: Sequence[str]) -> None:
        """Undo, in a task of its own, a call whose outcome is unknown: leave every queue and
        release a slot found held. Left to the next tick's reconcile if Redis is away."""
        self._spawn(self._settle(wid, tuple(pairs)))

    async def _settle(self, wid: str, pairs: tuple[str, ...]) -> None:
        try:
            reply = await self._cancel(wid, *pairs)
            if reply[0] == "grant":
                await self._release(wid, reply[1])
        except StateUnavailable:
            self._reconcile_needed = True

    def _spawn(self, coroutine: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _tick(self) -> None:
        for pair in list(self._unsent):
            await self._send_config(pair)
        if self._reconcile_needed:
            self._reconcile_needed = False
            try:
                await self._reconcile(self._shared.proc, self._last_id, *self._waits, *self._held)
            except StateUnavailable:
                self._reconcile_needed = True
                raise
        if self._recheck_needed:
            await self._recheck()
        await self._sweep(max(100, int(self._shared.tick * 900)))

    async def _restore(self) -> None:
        """Redis lost this process's state (restart, or liveness lapsed): put back what it may
        still hold, and tell the holders of the slots it may not."""
        async with self._restoring:  # the tick and a place may both find the key gone
            configs = [value for pair, (p, q) in self._configs.items() for value in (pair, p, q)]
            grants = list(self._held.values())
            held = [
                part for g in grants for part in (g.id, pair_id(*self._pair_of(g.host, g.model)))
            ]
            reply = await self._restore_script(
                self._shared.proc, int(self._shared.hold_ttl * 1000), self._epoch,
                secrets.token_hex(8), len(configs) // 3, *configs, *held,
            )  # fmt: skip
            self._epoch = reply[0]
            self._unsent.clear()
            self._recheck_needed = True
            if any(grant.id not in self._held for grant in grants):
                # Released while the script ran: the script may have counted it again.
                self._reconcile_needed = True
            for gid in reply[1:]:
                grant = self._held.get(gid)
                if grant is not None:
                    self._lose(grant)

    def _lose(self, grant: Grant) -> None:
        log.warning(
            "shared slots: a slot of %s/%s is lost: Redis stopped counting it while this "
            "process was away (or Redis restarted) and it went to another request",
            grant.host, grant.model,
        )  # fmt: skip
        callback = self._on_lost.get(grant.id)
        self._unhold(grant)
        self._lost.add(grant.id)
        if callback is not None:
            asyncio.get_running_loop().call_soon(callback)

    async def _recheck(self) -> None:
        """Ask Redis about every pending waiter: grants whose message was lost land now, and
        places Redis no longer has fail with StateUnavailable."""
        self._recheck_needed = False
        entries = [entry for entry in self._waits.values() if not entry.future.done()]
        if not entries:
            return
        args: list[object] = [len(entries)]
        for entry in entries:
            args += [entry.id, len(entry.pairs), *entry.pairs]
        try:
            statuses = await self._check(*args)
        except StateUnavailable:
            self._recheck_needed = True
            raise
        for entry, status in zip(entries, statuses, strict=True):
            if entry.future.done() or status == "waiting":
                continue
            if status != "gone":
                self._landed(entry, status)
            elif entry.queued is not None:  # a place still being made is not gone
                entry.future.set_exception(
                    StateUnavailable("the queue place was lost (Redis restarted or unreachable)")
                )

    async def _listen_forever(self) -> None:
        failures = 0
        while not self._stopping:
            pubsub = self._shared.redis.pubsub()
            try:
                await pubsub.subscribe(self._channel)
                failures = 0
                while not self._stopping:
                    message = await pubsub.get_message(timeout=None)
                    if message is None:
                        continue
                    if message["type"] == "message":
                        self._on_wake(message["data"])
                    elif message["type"] == "subscribe":
                        # Also after redis-py re-made a dropped connection by itself: messages
                        # published meanwhile are lost, the grants they carried are not.
                        self._subscribed.set()
                        self._recheck_needed = True
                        self._spawn(self._recheck_quietly())
            except UNREACHABLE as exc:
                failures += 1
                self._shared.mark_down(exc)
                if failures >= 2:  # the immediate second try failed too: Redis is away
                    self._fail_waits(f"Redis at {self._shared.where} cannot be reached")
                    await asyncio.sleep(min(2.0, 0.1 * 2**failures))
            finally:
                try:
                    await pubsub.aclose()
                except UNREACHABLE:
                    pass

    async def _recheck_quietly(self) -> None:
        try:
            await self._recheck()
        except StateUnavailable:
            pass  # retried at the next tick


def _counts(flat: list[Any]) -> dict[tuple[str, str], tuple[int, int]]:
    """A refusal's counts (pair, held, queued, ...) by (host, model): (in flight, queued)."""
    return {
        split_pair(flat[i]): (int(flat[i + 1]), int(flat[i + 2])) for i in range(0, len(flat), 3)
    }
