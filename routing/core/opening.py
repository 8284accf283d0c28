"""A conversation's opening: its lease looked up, the place that follows, the lease kept.

This is the first step of a placement with a conversation (`routing.core.placement`), as the
fleet state runs it: `open_with` is the choice written once over any `FleetState`'s
operations (a lease read, a place, a lease write); the in-process state runs it as it is
(nothing suspends in between), and the shared state runs the same choice as one script in
Redis (one round trip instead of three: routing/shared/slots_lua.py `OPEN`), falling back to
`open_with` for what the script leaves to it.

The choice, with `home` the lease's host:

- home usable: home's slot, else (`patient`) a place in home's line, else the others' in the
  ranking's order (a slot, then a line); not `patient`: home first, then the others, for a
  slot and then for a line. The lease is only slid.
- home not usable and the route strict: nothing placed (`Opened.pinned`).
- otherwise (no lease, or home not usable): the ranking's order, and the lease goes to the
  host placed on (a line's host too: its cache starts there).

Pure: standard library and asyncio only.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Literal

from routing.core.fairness import ANONYMOUS, Share
from routing.core.leases import LeaseKey
from routing.core.limiter import Pair

if TYPE_CHECKING:
    from routing.core.state import FleetState, Held, InLine

__all__ = ["UNREAD", "Opened", "Opening", "give_back", "keep_or_give_back", "open_with"]


class _Unread(Enum):
    UNREAD = "unread"


UNREAD = _Unread.UNREAD  # `open_with`'s `found` when the lease was not read yet


@dataclass(slots=True, frozen=True)
class Opening:
    """What a conversation's first step needs to know."""

    key: LeaseKey
    ttl: float  # the lease's, in seconds
    pairs: Sequence[Pair]  # the usable hosts for the model, best first (a ranking's own)
    usable: Callable[[str], bool]  # whether the lease's host may take the request here
    unusable: Collection[str]  # the route's hosts for the model that `usable` refuses now
    strict: bool  # a host that may not be used refuses rather than moves the conversation
    patient: bool  # home's line before the other hosts' free slots (lease_patience > 0, or auto)
    share: Share = ANONYMOUS  # whose share the request counts against in a line


@dataclass(slots=True, frozen=True)
class Opened:
    """What the opening found and took."""

    home: str | None  # the lease's host, as found (usable or not)
    at_home: bool  # home was usable: the place was asked there first
    got: Held | InLine | None  # None: every line full, nothing usable, or `pinned`
    pinned: bool = False  # strict route, home not usable: nothing was placed


async def open_with(
    state: FleetState, opening: Opening, found: str | None | Literal[_Unread.UNREAD] = UNREAD
) -> Opened:
    """Run the opening through `state`'s lease and place operations (the choice above).

    `found`: the lease's host when it was read already (it slid then), so it is not read again.
    Cancel-safe: a cancellation while the lease is written gives back what was placed.
    """
    key, ttl = opening.key, opening.ttl
    home = await state.find_lease(key, ttl) if found is UNREAD else found
    if home is not None and opening.usable(home):
        own = Pair(home, key.model)
        if opening.patient:
            others = any(pair != own for pair in opening.pairs)
            # Nobody is shed at home while another line has room.
            got = await state.place([own], opening.share, shed=not others)
            # Home has neither a slot nor room in its line: the others, in order (home
            # again first, for a waiter of a lower class to shed when every line is full).
            if got is None and others:
                got = await state.place(_Order(own, opening.pairs), opening.share)
        else:
            got = await state.place(_Order(own, opening.pairs), opening.share)
        if got is not None:
            await keep_or_give_back(state, key, home, ttl, got, home)
        return Opened(home, True, got)
    if home is not None and opening.strict:
        return Opened(home, False, None, pinned=True)
    got = await state.place(opening.pairs, opening.share) if opening.pairs else None
    if got is not None:
        await keep_or_give_back(state, key, got.host, ttl, got, home)
    return Opened(home, False, got)


async def keep_or_give_back(
    state: FleetState,
    key: LeaseKey,
    host: str,
    ttl: float,
    got: Held | InLine,
    found: str | None,
) -> None:
    """Lease `key` to `host` (`found`: as `FleetState.keep_lease`); when that fails or is
    cancelled, give back `got`, the slot or place the request took, and raise."""
    try:
        await state.keep_lease(key, host, ttl, found)
    except BaseException:
        give_back(got)
        raise


def give_back(got: Held | InLine) -> None:
    """Release a held slot, or leave a line (releasing a slot handed over meanwhile)."""
    if got.held:
        got.release()
        return
    granted = got.cancel()
    if granted is not None:
        granted.release()


class _Order:
    """`first`, then `rest` without it: read as often as it is iterated (a place may read its
    pairs several times), and lazily (a place stops at the first free slot)."""

    __slots__ = ("first", "rest")

    def __init__(self, first: Pair, rest: Sequence[Pair]) -> None:
        self.first = first
        self.rest = rest

    def __iter__(self) -> Iterator[Pair]:
        yield self.first
        for pair in self.rest:
            if pair != self.first:
                yield pair
