"""A request waiting for a slot: its place in one pair's line, and its watches on others.

The limiter (routing/core/limiter.py) creates every `Waiter` and hands it its slot; the
waiter's own task decides the slots offered to it (`settle`). Its module docstring tells the
whole protocol. One event loop, not thread-safe; nothing here awaits.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Final

from routing.core.fairness import Entry, Share
from routing.core.pairs import Pair, PairState, Slot

if TYPE_CHECKING:
    from routing.core.limiter import Limiter

__all__ = ["Waiter", "accept_any"]


def accept_any(pair: Pair) -> bool:
    return True


class Waiter:
    """A request waiting for a slot: its place in one pair's line, and its watches on others.

    ``granted`` resolves to the ``Slot`` it was handed, or to the exception given to ``fail``.
    A task that awaits it and is cancelled must call ``cancel()`` and release the slot it
    returns: a slot handed over in the same loop turn as the cancellation is the caller's.
    """

    __slots__ = (
        "granted", "offered", "share", "_limiter", "_home", "_entry", "_watching", "_accept",
        "_changed", "_attached", "_offers",
    )  # fmt: skip

    held: Final = False  # `routing.core.state.InLine`: a place in line, not a slot

    def __init__(self, limiter: Limiter, home: PairState | None, share: Share) -> None:
        loop = asyncio.get_running_loop()
        self.granted: asyncio.Future[Slot] = loop.create_future()
        # Set when a slot freed on a watched pair is held for this waiter (`settle` decides).
        self.offered: asyncio.Future[None] = loop.create_future()
        self._offers: list[PairState] = []  # the pairs whose held slot this waiter has to decide
        self.share = share  # whose share it counts against, in every line it may be granted by
        self._limiter = limiter
        self._home = home
        self._entry: Entry | None = None  # its place in home's line, once it joined
        # The pairs it watches, in the order it began to: a dict for the order and a lookup
        # by identity (`Limiter.watch` asks for each of a route's pairs at every repricing,
        # which on 2,000 hosts was a pass over 2,000 watched pairs for each).
        self._watching: dict[PairState, None] = {}
        self._accept: Callable[[Pair], bool] = accept_any
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
        """The 1-based place among the waiters of its line (in the order `Line` gives them);
        0 when not in one."""
        home = self._home
        if home is None or not self._attached:
            return 0
        for place, waiter in enumerate(home.line, 1):
            if waiter is self:
                return place
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
                self.granted.set_result(Slot(self._limiter, pair, self._limiter._entry(self.share)))
                return
            self._limiter._declined(pair, self)

    def _offer(self, pair: PairState) -> None:
        pair.in_flight += 1  # held for this waiter, so a newcomer cannot take the slot
        pair.line.took(self.share.priority)
        self._limiter._changed(pair.host)
        self._offers.append(pair)
        if not self.offered.done():
            self.offered.set_result(None)

    def _live(self) -> bool:
        # A future cancelled with its task is done before `_on_done` detaches it.
        return self._attached and not self.granted.done()

    def _grant(self, pair: PairState, entry: Entry | None = None) -> None:
        """Hand over a slot of `pair`: granted by its line (`entry`), or free on a watched one."""
        pair.in_flight += 1  # counted now, so a newcomer cannot take the slot meanwhile
        pair.line.took(self.share.priority)
        self._limiter._changed(pair.host)
        self._leave()
        entry = entry or self._limiter._entry(self.share)
        self.granted.set_result(Slot(self._limiter, pair, entry))

    def _leave(self) -> None:
        if not self._attached:
            return
        self._attached = False
        home = self._home
        if home is not None:
            if self._entry is not None:
                home.line.leave(self._entry)  # nothing when its line granted it
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
