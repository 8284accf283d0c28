"""The values the shared slot modules hand each other: a slot held (`Grant`), a place in a
line (`Queued`), a wait under way (`Wait`), and the id of a (host, model) pair in Redis."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from routing.core.pairs import Pair

__all__ = ["Grant", "Queued", "Wait", "pair_id", "split_pair"]


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
class Wait:
    """A placing script under way, or a place in a line: what a grant for `id` resolves."""

    id: str
    pairs: list[str]  # every pair it may be granted on: the ones placed on, then the watched
    future: asyncio.Future[Grant]
    since: float
    queued: Queued | None = None  # None while the place script is under way


def pair_id(host: str, model: str) -> str:
    """The pair's name in Redis's keys and scripts (a host name holds no '/')."""
    return f"{host}/{model}"


def split_pair(pair: str) -> Pair:
    """`pair_id`'s inverse: (host, model)."""
    host, _, model = pair.partition("/")
    return Pair(host, model)
