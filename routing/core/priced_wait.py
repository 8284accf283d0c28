"""Priced patience over one wait: whether a request waiting in its home's line takes a free
slot elsewhere, and the choice its row keeps.

A `PricedWait` is made when a request of a route whose `lease_patience` is auto begins to
wait in a line (`routing.core.placement.Placer.wait`) and lives as long as that wait. It
prices staying against the free slots on the route's other hosts with the request's
`Pricing` (routing/core/patience.py, the arithmetic): when the wait begins and each time its
place in line moves (`reprice`), and for one host's slot at the moment it frees (`takes`).
Until the fixed default has passed (`spend`), a price missing a figure keeps the request in
line. When home gives the request its slot, the wait it had is compared with the wait it was
priced at when it joined the line (`waited`, which teaches `Figures.lateness`).

Pure: standard library only; no I/O, no event loop. Not thread-safe: call from one loop.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Protocol

from routing.core.patience import Choice, Priced, Pricing, decide

__all__ = ["PricedWait"]


class Place(Protocol):
    """A place in a line, as priced patience reads it (`routing.core.state.InLine` is one)."""

    @property
    def host(self) -> str: ...
    @property
    def position(self) -> int:
        """1-based, among the live waiters of its line."""
        ...


class PricedWait:
    """One request's priced patience while `waiter` waits in its home's line for `model`.

    `pricing`: the request's prices (None: every price is missing, the fixed default decides);
    `free_elsewhere(*besides)`: the route's usable hosts, but `besides`, with a free slot and
    an empty line now.
    """

    __slots__ = (
        "_pricing", "_waiter", "_model", "_free", "_spent", "_choices", "_last", "_line", "_now",
        "_free_listed", "_stay_now",
    )  # fmt: skip

    def __init__(
        self,
        pricing: Pricing | None,
        waiter: Place,
        model: str,
        free_elsewhere: Callable[..., Iterable[str]],
    ) -> None:
        self._pricing = pricing
        self._waiter = waiter
        self._model = model
        self._free = free_elsewhere
        self._spent = False  # the fixed default has passed
        self._choices: dict[str, Priced] = {}  # the last choice about each host's free slot
        self._last: Priced | None = None  # the last choice of the wait
        # When the wait in line began and what it was priced then, for `waited`.
        self._line: tuple[float, float] | None = None
        # The free slots' prices, and those hosts, while `repriced` holds them.
        self._now: dict[str, float | None] | None = None
        self._free_listed: list[str] | None = None
        # The price of staying while `repriced` holds it: [] until it is first asked for.
        self._stay_now: list[float | None] | None = None

    @property
    def home(self) -> str:
        """The host whose line the request waits in."""
        return self._waiter.host

    def begin(self, now: float) -> None:
        """The wait in line begins at loop time `now`: keep its price for `waited`."""
        pricing = self._pricing
        line = pricing.line(self.home, self._waiter.position) if pricing is not None else None
        if line is not None:
            self._line = (now, line)

    def spend(self) -> None:
        """The fixed default has passed: a price missing a figure no longer keeps it in line."""
        self._spent = True

    def reprice(self) -> None:
        """Price staying against the soonest free slot elsewhere: the choice the row keeps if
        the request stays."""
        self._reprice(self._spills())

    @contextmanager
    def repriced(self) -> Iterator[None]:
        """`reprice`, then, until the block ends, `takes` finds the free slots elsewhere once,
        as the first is offered, and prices each host, and staying, once. For the slots
        offered at once, one after another in one step (nothing changes between them):
        pricing every free host again for each was F x F spill prices a reprice on a fleet
        with F free hosts. Not before the first offer: what the caller reads in between (a
        ranking, which may expire leases) can change a price."""
        self.reprice()
        self._now, self._stay_now = {}, []
        try:
            yield
        finally:
            self._now = self._free_listed = self._stay_now = None

    def takes(self, host: str) -> bool:
        """Whether a free slot on `host` is priced lower than the wait in line (and than the
        other hosts' free slots). Its own line's host always (a slot there goes to its line
        first). The choice is kept for the row."""
        if host == self.home:
            return True
        stay, spill = self._stay(), self._price(host)
        rivals: Iterable[float | None] = ()
        if stay is not None and spill is not None and spill < stay:
            # Only a slot priced sooner than the line needs its rivals, and only until one is
            # priced sooner still: a slot freed to a waiter used to price every free host.
            rivals = (self._price(other) for other in self._free_now() if other != host)
        priced = self._choices[host] = decide(stay, spill, rivals, self._spent)
        if not priced.takes:
            self._last = priced  # the row of a request that stays says what it turned down
        return priced.takes

    def waited(self, now: float) -> None:
        """Home gave the request its slot at loop time `now`: compare the wait it had been
        priced at when it joined the line with the wait it had (`Figures.waited`). Only the
        requests that stayed are compared: a spilled one's wait at home is never known."""
        if self._line is not None and self._pricing is not None:
            began, priced = self._line
            self._pricing.figures.waited(self.home, self._model, priced, now - began)

    def choice(self, host: str) -> Priced | None:
        """The choice the row keeps for a request served on `host`: the one about that host's
        free slot, else the last of the wait."""
        return self._choices.get(host, self._last)

    def _spills(self) -> dict[str, float | None]:
        """The spill price of each host with a free slot elsewhere."""
        return {host: self._price(host) for host in self._free(self.home)}

    def _price(self, host: str) -> float | None:
        """The spill price of `host`'s free slot; in a `repriced` block, priced once."""
        now, pricing = self._now, self._pricing
        if now is not None and host in now:
            return now[host]
        price = pricing.spill(host) if pricing is not None else None
        if now is not None:
            now[host] = price
        return price

    def _free_now(self) -> Iterable[str]:
        """The hosts with a free slot elsewhere; in a `repriced` block, found once."""
        if self._now is None:
            return self._free(self.home)
        if self._free_listed is None:
            self._free_listed = list(self._free(self.home))
        return self._free_listed

    def _reprice(self, spills: dict[str, float | None]) -> None:
        stay = self._stay()
        if not spills:
            self._last = Priced(Choice.DEFAULT if stay is None else Choice.STAY, stay, None)
            return
        known = [price for price in spills.values() if price is not None]
        self._last = decide(stay, min(known, default=None), (), self._spent)

    def _stay(self) -> float | None:
        """The price of staying; in a `repriced` block, priced once: each free slot offered
        there asked for it again (the line's place and waits) though none of it changes."""
        if self._stay_now:
            return self._stay_now[0]
        pricing, waiter = self._pricing, self._waiter
        stay = pricing.stay(waiter.host, waiter.position) if pricing is not None else None
        if self._stay_now is not None:
            self._stay_now.append(stay)
        return stay
