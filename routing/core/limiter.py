"""Per-(host, model) concurrency slots with a bounded FIFO queue.

A llama-server with ``parallel = 4`` must never see a fifth concurrent request: the fifth waits
here, in arrival order, and once ``queue_max`` requests already wait the next one is refused at
once (``QueueFull``) so the client can go elsewhere.

Everything here runs on one asyncio event loop and is not thread-safe. No method awaits except
``Limiter.acquire`` while it waits in the queue, so every state change is atomic with respect to
the other tasks on the loop.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field
from types import TracebackType

__all__ = ["Limiter", "PairSnapshot", "QueueFull", "Slot", "Ticket"]


class QueueFull(Exception):
    """Raised by ``Limiter.acquire`` when the pair's queue already holds ``queue_max`` waiters."""

    def __init__(self, host: str, model: str) -> None:
        super().__init__(f"queue full for {model} on {host}")
        self.host = host
        self.model = model


@dataclass(slots=True, frozen=True)
class PairSnapshot:
    """The state of one (host, model) pair at one instant, for the dashboard."""

    host: str
    model: str
    parallel: int
    queue_max: int
    in_flight: int
    queued: int


@dataclass(slots=True, eq=False)
class _Pair:
    parallel: int = 1
    queue_max: int = 0
    configured: bool = False
    in_flight: int = 0
    # Futures of tasks waiting for a slot, oldest first. A cancelled future may linger here
    # until its task runs again; grants skip it and the queue-full check purges it.
    waiters: deque[asyncio.Future[None]] = field(default_factory=deque)

    def live_waiters(self) -> int:
        return sum(1 for waiter in self.waiters if not waiter.done())

    def idle(self) -> bool:
        return self.in_flight == 0 and not self.waiters


class Slot:
    """One held slot of a (host, model) pair, returned by ``Limiter.acquire``.

    ``waited`` is the time in seconds the caller spent in the queue (0.0 when a slot was free).
    ``release`` gives the slot back; it is idempotent and safe after the pair was reconfigured
    or removed. Use it directly or as ``async with await limiter.acquire(host, model) as slot``.
    """

    __slots__ = ("host", "model", "waited", "_limiter", "_pair", "_released")

    def __init__(self, limiter: Limiter, pair: _Pair, host: str, model: str, waited: float) -> None:
        self.host = host
        self.model = model
        self.waited = waited
        self._limiter = limiter
        self._pair = pair
        self._released = False

    def release(self) -> None:
        """Give the slot back (to the head waiter, if any). A second call is a no-op."""
        if self._released:
            return
        self._released = True
        self._limiter._release(self.host, self.model, self._pair)

    async def __aenter__(self) -> Slot:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "released" if self._released else "held"
        return f"<Slot {self.host}/{self.model} {state} waited={self.waited:.3f}s>"


class Ticket:
    """Where one waiting ``acquire`` stands in its queue, for a client watching its wait.

    Pass a fresh ticket to ``Limiter.acquire``; while that call waits, ``position`` is its
    1-based place among the live waiters of its pair, and 0 otherwise (not queued yet, granted,
    or gone); `queued` is set once the call joined the queue. Reading `position` costs a walk
    of the queue ahead: meant for status updates, not loops.
    """

    __slots__ = ("_pair", "_waiter", "queued")

    def __init__(self) -> None:
        self._pair: _Pair | None = None
        self._waiter: asyncio.Future[None] | None = None
        self.queued = asyncio.Event()

    @property
    def position(self) -> int:
        waiter, pair = self._waiter, self._pair
        if waiter is None or pair is None or waiter.done():
            return 0
        ahead = 0
        for queued in pair.waiters:
            if queued is waiter:
                return ahead + 1
            if not queued.done():
                ahead += 1
        return 0


class Limiter:
    """At most ``parallel`` slots in flight and ``queue_max`` waiters per (host, model).

    Unconfigured pairs behave as ``parallel = 1, queue_max = 0``. Waiters are granted strictly in
    arrival order and a release hands its slot straight to the head waiter, so a newcomer never
    overtakes the queue. A waiter that is cancelled gives back its place, or, if the slot reached
    it in the same instant, passes the slot on. No method raises on misuse.

    Loop safety: call every method from the same event loop; nothing here is thread-safe.
    """

    __slots__ = ("_pairs",)

    def __init__(self) -> None:
        # host -> model -> pair. Unconfigured pairs exist only while a slot is held or a task
        # waits, so clients naming arbitrary models cannot grow this without bound.
        self._pairs: dict[str, dict[str, _Pair]] = {}

    def configure(self, host: str, model: str, parallel: int, queue_max: int) -> None:
        """Set the pair's limits, keeping its in-flight slots and its queue.

        ``parallel`` below 1 counts as 1 and a negative ``queue_max`` as 0. Raising ``parallel``
        grants waiters at once; lowering it grants nothing until in-flight drops below it.
        Lowering ``queue_max`` keeps the waiters already queued and refuses newcomers meanwhile.
        """
        pair = self._pair(host, model)
        pair.parallel = max(1, parallel)
        pair.queue_max = max(0, queue_max)
        pair.configured = True
        self._grant(pair)

    def remove(self, host: str, model: str) -> None:
        """Forget the pair's configuration; it behaves as unconfigured afterwards.

        Slots still held release cleanly and waiters keep their place in line.
        """
        models = self._pairs.get(host)
        pair = models.get(model) if models is not None else None
        if pair is None:
            return
        pair.parallel = 1
        pair.queue_max = 0
        pair.configured = False
        self._forget_if_idle(host, model, pair)

    async def acquire(self, host: str, model: str, ticket: Ticket | None = None) -> Slot:
        """Return a held slot of the pair, waiting in line if none is free.

        Raises ``QueueFull`` at once when ``queue_max`` waiters already wait. Cancelling the
        waiting task removes it from the queue without leaking the slot or the place. A
        ``ticket`` shows the caller's place in line while it waits.
        """
        pair = self._pair(host, model)
        if pair.in_flight < pair.parallel:
            pair.in_flight += 1
            return Slot(self, pair, host, model, 0.0)
        if len(pair.waiters) >= pair.queue_max:
            # Only now pay for purging futures whose tasks were cancelled but not yet resumed.
            pair.waiters = deque(waiter for waiter in pair.waiters if not waiter.done())
            if len(pair.waiters) >= pair.queue_max:
                raise QueueFull(host, model)
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        pair.waiters.append(waiter)
        if ticket is not None:
            ticket._pair, ticket._waiter = pair, waiter
            ticket.queued.set()
        started = time.monotonic()
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                # The slot was handed over in the same instant as the cancellation: the slot
                # is counted as ours, so pass it on instead of leaking it.
                self._release(host, model, pair)
            else:
                try:
                    pair.waiters.remove(waiter)
                except ValueError:
                    pass
                self._forget_if_idle(host, model, pair)
            raise
        return Slot(self, pair, host, model, time.monotonic() - started)

    def in_flight(self, host: str, model: str) -> int:
        """Slots of the pair held right now."""
        pair = self._find(host, model)
        return pair.in_flight if pair is not None else 0

    def queued(self, host: str, model: str) -> int:
        """Tasks of the pair waiting for a slot right now."""
        pair = self._find(host, model)
        return pair.live_waiters() if pair is not None else 0

    def free_slots(self, host: str) -> int:
        """Free slots summed over the host's configured models; 0 for an unknown host."""
        models = self._pairs.get(host)
        if models is None:
            return 0
        return sum(
            max(0, pair.parallel - pair.in_flight) for pair in models.values() if pair.configured
        )

    def free_for(self, host: str, model: str) -> int:
        """Free slots of one pair (an unconfigured pair has one slot)."""
        pair = self._find(host, model)
        if pair is None:
            return 1
        return max(0, pair.parallel - pair.in_flight)

    def has_room(self, host: str, model: str) -> bool:
        """Whether an acquire right now would get a slot or a place in the queue."""
        pair = self._find(host, model)
        if pair is None:
            return True
        return pair.in_flight < pair.parallel or pair.live_waiters() < pair.queue_max

    def snapshot(self) -> list[PairSnapshot]:
        """Every configured or busy pair, sorted by (host, model)."""
        return sorted(
            (
                PairSnapshot(
                    host=host,
                    model=model,
                    parallel=pair.parallel,
                    queue_max=pair.queue_max,
                    in_flight=pair.in_flight,
                    queued=pair.live_waiters(),
                )
                for host, models in self._pairs.items()
                for model, pair in models.items()
            ),
            key=lambda snap: (snap.host, snap.model),
        )

    def _find(self, host: str, model: str) -> _Pair | None:
        models = self._pairs.get(host)
        return models.get(model) if models is not None else None

    def _pair(self, host: str, model: str) -> _Pair:
        models = self._pairs.get(host)
        if models is None:
            models = self._pairs[host] = {}
        pair = models.get(model)
        if pair is None:
            pair = models[model] = _Pair()
        return pair

    def _release(self, host: str, model: str, pair: _Pair) -> None:
        if pair.in_flight > 0:
            pair.in_flight -= 1
        self._grant(pair)
        self._forget_if_idle(host, model, pair)

    def _grant(self, pair: _Pair) -> None:
        waiters = pair.waiters
        while waiters and pair.in_flight < pair.parallel:
            waiter = waiters.popleft()
            if waiter.done():
                continue
            # Counted here, not when the waiter resumes, so that a newcomer arriving before the
            # waiter runs cannot take the slot.
            pair.in_flight += 1
            waiter.set_result(None)

    def _forget_if_idle(self, host: str, model: str, pair: _Pair) -> None:
        if pair.configured or not pair.idle():
            return
        models = self._pairs.get(host)
        if models is None or models.get(model) is not pair:
            return
        del models[model]
        if not models:
            del self._pairs[host]
