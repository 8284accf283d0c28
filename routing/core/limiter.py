"""Per-(host, model) concurrency slots with a bounded FIFO queue, and waits on several hosts.

A llama-server with ``parallel = 4`` must never see a fifth concurrent request: the fifth waits
here, in arrival order, and once ``queue_max`` requests already wait the next one is refused at
once so the client can go elsewhere.

Placement is one synchronous step: ``Limiter.place`` takes a free slot on the first pair of an
ordered list that has one, or else a place in the queue of the first pair with room, and
nothing can happen in between. A queued request holds a ``Waiter``: its place in one pair's line,
and optionally a watch on other pairs (``Limiter.watch``): it may also be handed a free slot of
those when their own queues are empty (a spill to another host after the route's patience, or
a fallback route). A waiter is granted exactly once, by whichever pair frees a slot first; its
``granted`` future then holds the ``Slot``. Nothing polls: a release hands its slot on at once.

A release runs no waiting request's code. Its line's head is granted the slot outright; a
watcher is *offered* it: the slot is held for it (counted in flight, so no newcomer takes it
meanwhile) and its ``offered`` future is set. The watcher's own task then decides
(``Waiter.settle``, which asks the ``accept`` its watch was given): it takes the slot, or
declines it, and a declined slot is offered at once to the pair's line, then to the watchers
after it. A wait that ends with offers undecided gives them back the same way.

Everything here runs on one asyncio event loop and is not thread-safe; no method awaits, so
every state change is atomic with respect to the other tasks on the loop.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Iterable
from typing import Final

from routing.core.errors import HostRemoved
from routing.core.pairs import Pair, PairSnapshot, PairState, Slot

__all__ = ["Limiter", "Pair", "PairSnapshot", "Slot", "Waiter"]


def _accept_any(pair: Pair) -> bool:
    return True


def _ignore(host: str) -> None:
    pass


class Waiter:
    """A request waiting for a slot: its place in one pair's line, and its watches on others.

    ``granted`` resolves to the ``Slot`` it was handed, or to the exception given to ``fail``.
    A task that awaits it and is cancelled must call ``cancel()`` and release the slot it
    returns: a slot handed over in the same loop turn as the cancellation is the caller's.
    """

    __slots__ = (
        "granted", "offered", "_limiter", "_home", "_watching", "_accept", "_changed",
        "_attached", "_offers",
    )  # fmt: skip

    held: Final = False  # `routing.core.state.InLine`: a place in line, not a slot

    def __init__(self, limiter: Limiter, home: PairState | None) -> None:
        loop = asyncio.get_running_loop()
        self.granted: asyncio.Future[Slot] = loop.create_future()
        # Set when a slot freed on a watched pair is held for this waiter (`settle` decides).
        self.offered: asyncio.Future[None] = loop.create_future()
        self._offers: list[PairState] = []  # the pairs whose held slot this waiter has to decide
        self._limiter = limiter
        self._home = home
        self._watching: list[PairState] = []
        self._accept: Callable[[Pair], bool] = _accept_any
        self._changed: asyncio.Event | None = None
        self._attached = True
        # A task cancelled while awaiting the future cancels the future itself: leave at once.
        self.granted.add_done_callback(self._on_done)

    @property
    def host(self) -> str:
        """The host whose queue holds this waiter's place; "" when it only watches."""
        return self._home.host if self._home is not None else ""

    @property
    def position(self) -> int:
        """The 1-based place among the live waiters of its line; 0 when not in one."""
        home = self._home
        if home is None or not self._attached:
            return 0
        ahead = 0
        for waiter in home.queue:
            if waiter is self:
                return ahead + 1
            if waiter._attached:
                ahead += 1
        return 0

    def changes(self) -> asyncio.Event:
        """An event set whenever this waiter's place in line changes or its wait ends."""
        if self._changed is None:
            self._changed = asyncio.Event()
            if self._home is not None and self._attached:
                self._home.listeners += 1
            elif not self._attached:
                self._changed.set()  # the wait is over already: nothing would ever set it
        return self._changed

    def cancel(self) -> Slot | None:
        """Leave the line and every watch; the slot, when one was handed over already."""
        if self.granted.done():
            if self.granted.cancelled() or self.granted.exception() is not None:
                return None
            return self.granted.result()
        self._leave()
        self.granted.cancel()
        return None

    def fail(self, error: BaseException) -> None:
        """End the wait with `error` (e.g. a deadline), unless a slot was handed over."""
        if not self.granted.done():
            self._leave()
            self.granted.set_exception(error)

    def settle(self) -> None:
        """Decide the slots offered to this wait, in the waiting task: the first its watch's
        `accept` agrees to is granted; each declined one goes at once to the pair's line,
        then to the watchers after this one. Call it whenever `offered` is done. If `accept`
        raises, the undecided offers stay this waiter's, given back when its wait ends."""
        if self.offered.done():
            self.offered = asyncio.get_running_loop().create_future()
        offers = self._offers
        while offers and self._live():  # ended: `_on_done` gives the offers back
            pair = offers[0]
            takes = self._accept(Pair(pair.host, pair.model))
            offers.pop(0)
            if takes:
                self._leave()  # gives back the other offers
                self.granted.set_result(Slot(self._limiter, pair))
                return
            self._limiter._declined(pair, self)

    def _offer(self, pair: PairState) -> None:
        pair.in_flight += 1  # held for this waiter, so a newcomer cannot take the slot
        self._limiter._changed(pair.host)
        self._offers.append(pair)
        if not self.offered.done():
            self.offered.set_result(None)

    def _live(self) -> bool:
        # A future cancelled with its task is done before `_on_done` detaches it.
        return self._attached and not self.granted.done()

    def _grant(self, pair: PairState) -> None:
        pair.in_flight += 1  # counted now, so a newcomer cannot take the slot meanwhile
        self._limiter._changed(pair.host)
        self._leave()
        self.granted.set_result(Slot(self._limiter, pair))

    def _leave(self) -> None:
        if not self._attached:
            return
        self._attached = False
        home = self._home
        if home is not None:
            home.queued -= 1
            if self._changed is not None:
                home.listeners -= 1
            self._limiter._line_moved(home)
        for pair in self._watching:
            pair.watchers.remove(self)
            self._limiter._forget_if_idle(pair)
        self._watching.clear()
        offers, self._offers = self._offers, []
        for pair in offers:
            self._limiter._declined(pair, self)
        if self._changed is not None:
            self._changed.set()

    def _on_done(self, future: asyncio.Future[Slot]) -> None:
        self._leave()


class Limiter:
    """At most ``parallel`` slots in flight and ``queue_max`` waiters per (host, model).

    Unconfigured pairs behave as ``parallel = 1, queue_max = 0``. A release hands its slot to
    the head of the pair's line, else offers it to the first watcher (whose task decides:
    `Waiter.settle`), so a newcomer never overtakes a waiter. No method raises on misuse.

    Loop safety: call every method from the same event loop; nothing here is thread-safe.
    """

    __slots__ = ("_pairs", "_changed")

    def __init__(self, on_change: Callable[[str], None] | None = None) -> None:
        # host -> model -> pair. Unconfigured pairs exist only while they are in use, so
        # clients naming arbitrary models cannot grow this without bound.
        self._pairs: dict[str, dict[str, PairState]] = {}
        # Told the host whenever a pair's slots in flight, line or limits change (a ranking
        # of hosts then finds the host's place again). Called synchronously, never twice per
        # change; it must not call back into the limiter.
        self._changed: Callable[[str], None] = on_change or _ignore

    def configure(self, host: str, model: str, parallel: int, queue_max: int) -> None:
        """Set the pair's limits, keeping its in-flight slots and its line.

        ``parallel`` below 1 counts as 1 and a negative ``queue_max`` as 0. Raising ``parallel``
        grants waiters at once; lowering it grants nothing until in-flight drops below it.
        Lowering ``queue_max`` keeps the waiters already queued and refuses newcomers meanwhile.
        """
        pair = self._pair(host, model)
        pair.parallel = max(1, parallel)
        pair.queue_max = max(0, queue_max)
        pair.configured = True
        self._changed(host)
        self._hand_over(pair)

    def remove(self, host: str, model: str) -> None:
        """Forget the pair's configuration. Held slots release cleanly (the pair counts them
        until then); the waits in its line end with `HostRemoved`, so that placement places
        them again elsewhere: a slot of a pair no longer configured must go to no one."""
        pair = self._find(host, model)
        if pair is None:
            return
        pair.parallel, pair.queue_max, pair.configured = 1, 0, False
        self._changed(host)
        for waiter in list(pair.queue):
            waiter.fail(HostRemoved(host, model))
        self._forget_if_idle(pair)

    def rename(self, old: str, new: str) -> None:
        """The host `old` is called `new` from now on (the same box): its pairs keep their
        slots in flight, lines and watchers under the new name. Slots held keep the name they
        were taken under, and release into the renamed pair. No-op when `old` holds nothing
        or `new` has pairs of its own."""
        models = self._pairs.get(old)
        if models is None or new in self._pairs:
            return
        del self._pairs[old]
        self._pairs[new] = models
        for pair in models.values():
            pair.host = new
        self._changed(old)
        self._changed(new)

    def place(self, pairs: Iterable[Pair]) -> Slot | Waiter | None:
        """A free slot on the first of `pairs` that has one; else a place in the line of the
        first with room; else None (all full). One step: nothing else runs in between.

        `pairs` is read lazily, at most twice (a ranking's order: the first free slot is
        usually the first pair's), so it must not be an iterator."""
        for host, model in pairs:
            pair = self._find(host, model)
            if pair is None:  # unconfigured: one slot, no line (kept only while it is held)
                pair = self._pair(host, model)
            if pair.has_free_slot():
                pair.in_flight += 1
                self._changed(host)
                return Slot(self, pair)
        for host, model in pairs:
            pair = self._find(host, model)
            if pair is not None and self._has_room(pair):
                waiter = Waiter(self, pair)
                pair.queue.append(waiter)
                pair.queued += 1
                self._changed(host)
                return waiter
        return None

    def waiter(self) -> Waiter:
        """A waiter with no place in any line, for a request that can only watch (`watch`)."""
        return Waiter(self, None)

    def watch(
        self, waiter: Waiter, pairs: Iterable[Pair], accept: Callable[[Pair], bool] = _accept_any
    ) -> None:
        """Let `waiter` also be handed a free slot of `pairs` (in this order of preference)
        when their own lines are empty and `accept(pair)` agrees at that moment. A free slot
        there right now is handed over at once. No-op for a waiter whose wait has ended."""
        if not waiter._live():
            return
        waiter._accept = accept
        for host, model in pairs:
            pair = self._pair(host, model)
            if pair is waiter._home or pair in waiter._watching:
                continue
            pair.watchers.append(waiter)
            waiter._watching.append(pair)
        for pair in list(waiter._watching):
            if pair.has_free_slot() and pair.queued == 0 and accept(Pair(pair.host, pair.model)):
                waiter._grant(pair)
                return

    def wake(self, host: str) -> None:
        """Offer the host's free slots to its watchers again (it became usable: up, undrained)."""
        for pair in list(self._pairs.get(host, {}).values()):
            self._hand_over(pair)

    def in_flight(self, host: str, model: str) -> int:
        """Slots of the pair held right now."""
        pair = self._find(host, model)
        return pair.in_flight if pair is not None else 0

    def queued(self, host: str, model: str) -> int:
        """Requests in the pair's line right now."""
        pair = self._find(host, model)
        return pair.queued if pair is not None else 0

    def free_for(self, host: str, model: str) -> int:
        """Free slots of one pair (an unconfigured pair has one slot)."""
        pair = self._find(host, model)
        if pair is None:
            return 1
        return max(0, pair.parallel - pair.in_flight)

    def free_slots(self, host: str) -> int:
        """Free slots summed over the host's configured models; 0 for an unknown host."""
        return sum(
            max(0, pair.parallel - pair.in_flight)
            for pair in self._pairs.get(host, {}).values()
            if pair.configured
        )

    def snapshot(self) -> list[PairSnapshot]:
        """Every configured or busy pair, sorted by (host, model)."""
        return sorted(
            (
                PairSnapshot(
                    pair.host,
                    pair.model,
                    pair.parallel,
                    pair.queue_max,
                    pair.in_flight,
                    pair.queued,
                )  # fmt: skip
                for models in self._pairs.values()
                for pair in models.values()
            ),
            key=lambda snap: (snap.host, snap.model),
        )

    def _find(self, host: str, model: str) -> PairState | None:
        models = self._pairs.get(host)
        return models.get(model) if models is not None else None

    def _pair(self, host: str, model: str) -> PairState:
        models = self._pairs.setdefault(host, {})
        pair = models.get(model)
        if pair is None:
            pair = models[model] = PairState(host, model)
        return pair

    def _has_room(self, pair: PairState) -> bool:
        if len(pair.queue) > 2 * pair.queued + 8:
            # Compact the line now and then, so waiters that left cost nothing for long.
            pair.queue = deque(waiter for waiter in pair.queue if waiter._attached)
        return pair.has_queue_room()

    def _release(self, pair: PairState, after: Waiter | None = None) -> None:
        if pair.in_flight > 0:
            pair.in_flight -= 1
            self._changed(pair.host)
        self._hand_over(pair, after)
        self._forget_if_idle(pair)

    def _declined(self, pair: PairState, waiter: Waiter) -> None:
        """`waiter` gave back the slot held for it: to the line, then the watchers after it."""
        self._release(pair, after=waiter)

    def _hand_over(self, pair: PairState, after: Waiter | None = None) -> None:
        """Give the pair's free slots to its line, in order, then offer them to its watchers
        (those after `after`, when it still watches the pair)."""
        while pair.has_free_slot():
            waiter = self._next_in_line(pair)
            if waiter is not None:
                waiter._grant(pair)
                continue
            waiter = self._next_watcher(pair, after)
            if waiter is None:
                return
            waiter._offer(pair)

    @staticmethod
    def _next_in_line(pair: PairState) -> Waiter | None:
        queue = pair.queue
        while queue:
            waiter = queue.popleft()
            if waiter._live():
                return waiter
        return None

    @staticmethod
    def _next_watcher(pair: PairState, after: Waiter | None) -> Waiter | None:
        """The first live watcher (after `after`) not yet holding an offer of the pair."""
        watchers = pair.watchers
        start = watchers.index(after) + 1 if after is not None and after in watchers else 0
        for waiter in watchers[start:]:
            if waiter._live() and pair not in waiter._offers:
                return waiter
        return None

    def _line_moved(self, pair: PairState) -> None:
        self._changed(pair.host)
        if pair.listeners:
            for waiter in pair.queue:
                if waiter._attached and waiter._changed is not None:
                    waiter._changed.set()
        self._forget_if_idle(pair)

    def _forget_if_idle(self, pair: PairState) -> None:
        if pair.configured or not pair.idle():
            return
        models = self._pairs.get(pair.host)
        if models is None or models.get(pair.model) is not pair:
            return
        del models[pair.model]
        if not models:
            del self._pairs[pair.host]
