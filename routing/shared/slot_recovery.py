"""Bringing Redis and this process's book back into agreement, after whatever came between.

The slot operations (routing/shared/slots.py) count on one thing: what Redis records for this
process and what its book (routing/shared/holdings.py) says agree. Four things part them, and
this module mends each:

- A call whose reply never came (Redis away, the call cancelled half way): `settle_soon`
  undoes it in a task of its own, and when Redis is away the book is marked unsure, so the
  next tick's RECONCILE drops whatever Redis holds for this process that the book no longer
  knows of. An outage, or a call cancelled half way, leaks nothing.
- A grant's message lost (pub/sub drops messages while its connection is down): `recheck`
  asks Redis about every pending wait; grants land, places Redis no longer has fail with
  StateUnavailable. The listener asks for one at each (re)subscription (`recheck_soon`).
- This process's liveness key gone (routing/shared/state.py: Redis restarted empty, or the
  process was away past `hold_ttl` and others took its slots and places back): `restore`
  puts its configuration back and re-counts the slots it still holds (their requests still
  run) while their pairs have room. A slot another process took meanwhile is never counted
  again, even for an instant: the book loses it and its holder hears (`Holdings.on_lost`).
- A process that died: every `tick` runs the SWEEP, which takes back the slots and places of
  processes whose liveness expired and hands them on, as the next script to find a pair full
  does. A process killed with SIGKILL costs the others at most `hold_ttl` plus a tick.

`tick` also sends the configurations Redis did not get. Use it on one event loop.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Sequence

from routing.shared import slots_lua as lua
from routing.shared.holdings import Holdings
from routing.shared.slot_limits import SlotLimits
from routing.shared.state import Shared, StateUnavailable
from routing.shared.tasks import Tasks

__all__ = ["SlotRecovery"]


class SlotRecovery:
    """The restore, reconcile, recheck and sweep of one process's slots.

    It registers itself on `shared`: `restore` runs when a tick finds the liveness key gone,
    `tick` every tick that reaches Redis.
    """

    def __init__(self, shared: Shared, book: Holdings, limits: SlotLimits, tasks: Tasks) -> None:
        self._shared = shared
        self._book = book
        self._limits = limits
        self._tasks = tasks
        self._check = shared.script(lua.CHECK)
        self._restore = shared.script(lua.RESTORE)
        self._sweep = shared.script(lua.SWEEP)
        self._reconcile = shared.script(lua.RECONCILE)
        self._cancel = shared.script(lua.CANCEL)
        self._release = shared.script(lua.RELEASE)
        self._epoch = ""  # Redis's epoch when this process last put its slots back
        self._restoring = asyncio.Lock()
        self._recheck_needed = False
        shared.on_restore(self.restore)
        shared.on_tick(self.tick)

    async def tick(self) -> None:
        """Send unsent configurations, reconcile when the book is unsure, recheck the waits
        when a message may have been lost, sweep. Raises StateUnavailable (then what it did
        not do is done at the next tick)."""
        await self._limits.send_unsent()
        if self._book.take_unsure():
            try:
                await self._reconcile(self._shared.proc, self._book.last_id, *self._book.ids())
            except StateUnavailable:
                self._book.unsure()
                raise
        if self._recheck_needed:
            await self.recheck()
        await self._sweep(max(100, int(self._shared.tick * 900)))

    async def restore(self) -> None:
        """Redis lost this process's state (restart, or liveness lapsed): put back what it may
        still hold, and lose the grants it may not. Raises StateUnavailable. Calls at once
        run one after the other (a tick and a place may both find the key gone)."""
        async with self._restoring:
            configs = self._limits.flat()
            grants = self._book.grants()
            held = [part for g in grants for part in (g.id, self._book.counted_pair(g))]
            reply = await self._restore(
                self._shared.proc, int(self._shared.hold_ttl * 1000), self._epoch,
                secrets.token_hex(8), len(configs) // 3, *configs, *held,
            )  # fmt: skip
            self._epoch = reply[0]
            self._limits.all_sent()
            self._recheck_needed = True
            if any(self._book.get(grant.id) is None for grant in grants):
                # Released while the script ran: the script may have counted it again.
                self._book.unsure()
            for gid in reply[1:]:
                grant = self._book.get(gid)
                if grant is not None:
                    self._book.lose(grant)

    async def recheck(self) -> None:
        """Ask Redis about every pending wait: grants whose message was lost land now, and
        places Redis no longer has fail with StateUnavailable. Raises StateUnavailable (then
        the next tick asks again)."""
        self._recheck_needed = False
        waits = self._book.pending()
        if not waits:
            return
        args: list[object] = [len(waits)]
        for wait in waits:
            args += [wait.id, len(wait.pairs), *wait.pairs]
        try:
            statuses = await self._check(*args)
        except StateUnavailable:
            self._recheck_needed = True
            raise
        for wait, status in zip(waits, statuses, strict=True):
            if wait.future.done() or status == "waiting":
                continue
            if status != "gone":
                self._book.landed(wait, status)
            elif wait.queued is not None:  # a place still being made is not gone
                wait.future.set_exception(
                    StateUnavailable("the queue place was lost (Redis restarted or unreachable)")
                )

    def recheck_soon(self) -> None:
        """`recheck` in a task of its own, and again at the next tick if Redis is away. Never
        raises. For the listener: messages published while it was not subscribed are lost."""
        self._recheck_needed = True
        self._tasks.spawn(self._recheck_quietly())

    def settle_soon(self, wid: str, pairs: Sequence[str]) -> None:
        """Undo, in a task of its own, a call for `wid` whose outcome is unknown: leave every
        queue of `pairs` and release a slot found held. Left to the next tick's reconcile
        if Redis is away. Never raises."""
        self._tasks.spawn(self._settle(wid, tuple(pairs)))

    async def _settle(self, wid: str, pairs: tuple[str, ...]) -> None:
        try:
            reply = await self._cancel(wid, *pairs)
            if reply[0] == "grant":
                await self._release(wid, reply[1])
        except StateUnavailable:
            self._book.unsure()

    async def _recheck_quietly(self) -> None:
        try:
            await self.recheck()
        except StateUnavailable:
            pass  # retried at the next tick
