"""Conversation leases: keep a (route, fingerprint, model) on the host holding its KV cache."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

__all__ = ["LeaseKey", "LeaseOutcome", "LeaseTable", "NoHealthyHost", "PinnedHostDown"]


class NoHealthyHost(Exception):
    """No host of the route is eligible for the request."""


class PinnedHostDown(Exception):
    """A strict route's lease points at a host that cannot take the request."""

    def __init__(self, host: str) -> None:
        super().__init__(f"pinned host down: {host}")
        self.host = host


class LeaseOutcome(StrEnum):
    """How the host was found; the value goes into the ``X-Crossbar-Lease`` header."""

    NEW = "new"
    REUSED = "reused"
    MOVED = "moved"
    NONE = ""  # the request has no fingerprint: nothing stored


@dataclass(slots=True, frozen=True)
class LeaseKey:
    route: str
    fingerprint: str
    model: str


@dataclass(slots=True)
class _Lease:
    host: str
    expires: float


class LeaseTable:
    """A bounded LRU of leases with a sliding TTL.

    Expiry is lazy: an expired lease is found out when it is next looked up, or evicted as the
    least recently used once the table is full. Loop safety: call every method from one event
    loop; ``lease`` does not suspend, so each call is atomic with respect to other tasks.
    """

    __slots__ = ("_clock", "_leases", "_max_entries")

    def __init__(
        self, max_entries: int = 100_000, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._max_entries = max(1, max_entries)
        self._clock = clock
        self._leases: OrderedDict[LeaseKey, _Lease] = OrderedDict()

    async def lease(
        self,
        key: LeaseKey,
        *,
        ttl: float,
        strict: bool,
        usable: Callable[[str], bool],
        choose: Callable[[], str | None],
    ) -> tuple[str, LeaseOutcome]:
        """Return the host for ``key`` and how it was found.

        A live lease on a host ``usable`` accepts is reused and its TTL slides to ``ttl`` from
        now. A live lease on an unusable host (down, draining, gone from the route) raises
        ``PinnedHostDown`` when ``strict``, and otherwise moves to the host ``choose`` returns.
        Without a live lease, ``choose`` picks and the lease is new. An empty fingerprint is
        never stored (outcome ``NONE``). Raises ``NoHealthyHost`` when ``choose`` returns None;
        nothing is stored then.
        """
        if not key.fingerprint:
            return _chosen(choose), LeaseOutcome.NONE
        now = self._clock()
        current = self._leases.get(key)
        outcome = LeaseOutcome.NEW
        if current is not None:
            if current.expires <= now:
                del self._leases[key]
            elif usable(current.host):
                current.expires = now + ttl
                self._leases.move_to_end(key)
                return current.host, LeaseOutcome.REUSED
            elif strict:
                raise PinnedHostDown(current.host)
            else:
                outcome = LeaseOutcome.MOVED
        host = _chosen(choose)
        self._leases[key] = _Lease(host, now + ttl)
        self._leases.move_to_end(key)
        while len(self._leases) > self._max_entries:
            self._leases.popitem(last=False)
        return host, outcome

    def host_of(self, key: LeaseKey) -> str | None:
        """The host holding an unexpired lease for ``key``, without refreshing it."""
        current = self._leases.get(key)
        if current is None or current.expires <= self._clock():
            return None
        return current.host

    def drop_host(self, host: str) -> int:
        """Remove every lease held by ``host`` (a deleted host); return how many went."""
        doomed = [key for key, current in self._leases.items() if current.host == host]
        for key in doomed:
            del self._leases[key]
        return len(doomed)

    def held_by_host(self) -> dict[str, int]:
        """Unexpired leases per host, for the dashboard."""
        now = self._clock()
        held: dict[str, int] = {}
        for current in self._leases.values():
            if current.expires > now:
                held[current.host] = held.get(current.host, 0) + 1
        return held

    def __len__(self) -> int:
        """Stored leases, including expired ones not yet found out."""
        return len(self._leases)


def _chosen(choose: Callable[[], str | None]) -> str:
    host = choose()
    if host is None:
        raise NoHealthyHost()
    return host
