"""How a waiter in this process hears its grant: one pub/sub listener per process.

The script that frees a slot counts it as the head waiter's and publishes "<waiter>\\n<pair>"
on the waiter's process channel (`<prefix>wake:<proc>`). Each process keeps one pub/sub
connection, whatever the number of its waiters (a blocking pop per waiter would hold a Redis
connection per queued request), and resolves the waiting future (`Holdings.grant_reached`).

Pub/sub drops messages while its connection is down, so every (re)subscription, including
one redis-py re-made by itself, is followed by one check of this process's waiters against
Redis, where the grant is recorded (`SlotRecovery.recheck_soon`). When the connection cannot
be re-made at once, Redis is taken to be away: the places waiting fail with StateUnavailable.
"""

from __future__ import annotations

import asyncio
import logging

from routing.shared.holdings import Holdings
from routing.shared.slot_recovery import SlotRecovery
from routing.shared.state import UNREACHABLE, Shared

__all__ = ["WakeListener"]

log = logging.getLogger("crossbar.shared.slots")


class WakeListener:
    """This process's subscription to its grants, in a task of its own. Use it on one loop."""

    def __init__(self, shared: Shared, book: Holdings, recovery: SlotRecovery) -> None:
        self._shared = shared
        self._book = book
        self._recovery = recovery
        self._channel = f"{shared.prefix}wake:{shared.proc}"
        self._task: asyncio.Task[None] | None = None
        self._stopping = False  # as in Shared.aclose: a cancellation may be swallowed
        self._subscribed = asyncio.Event()

    async def start(self, patience: float) -> None:
        """Begin listening; returns once subscribed, or after `patience` seconds when Redis
        cannot be reached (the listener keeps trying). Never raises."""
        if self._task is None:
            self._task = asyncio.create_task(self._listen_forever(), name="crossbar-wakes")
        try:
            async with asyncio.timeout(patience):
                await self._subscribed.wait()
        except TimeoutError:
            log.warning("shared slots: not subscribed to grants yet; still trying")

    async def aclose(self) -> None:
        """Stop listening and wait until the task has ended. Never raises."""
        if self._task is not None:
            self._stopping = True
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

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
                        wid, _, pair = message["data"].partition("\n")
                        self._book.grant_reached(wid, pair)
                    elif message["type"] == "subscribe":
                        # Also after redis-py re-made a dropped connection by itself: messages
                        # published meanwhile are lost, the grants they carried are not.
                        self._subscribed.set()
                        self._recovery.recheck_soon()
            except UNREACHABLE as exc:
                failures += 1
                self._shared.mark_down(exc)
                if failures >= 2:  # the immediate second try failed too: Redis is away
                    self._book.fail_waits(f"Redis at {self._shared.where} cannot be reached")
                    await asyncio.sleep(min(2.0, 0.1 * 2**failures))
            finally:
                try:
                    await pubsub.aclose()
                except UNREACHABLE:
                    pass
