"""Conversation leases: keep a (route, fingerprint, model) on the host holding its KV cache."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

__all__ = ["LeaseKey", "LeaseOutcome", "LeaseTable"]


class LeaseOutcome(StrEnum):
    """How the host was found; the value goes into the ``X-Crossbar-Lease`` header."""

    NEW = "new"
    REUSED = "reused"
    MOVED = "moved"
    SPILLED = "spilled"  # served elsewhere for now; the lease stays with its host
    NONE = ""  # the request has no fingerprint: nothing stored


@dataclass(slots=True, frozen=True)
class LeaseKey:
    route: str
    fingerprint: str
    model: str


# Stored as tuples of strings and a float, not as objects of classes of our own: CPython's
# cycle collector stops tracking such tuples, so its passes no longer walk every live
# conversation (with 100k leases: 210k tracked objects and 100 ms a full pass as LeaseKey and
# _Lease objects, 10k and 51 ms as tuples; a loaded gateway makes a full pass every few seconds).
_Key = tuple[str, str, str]  # route, fingerprint, model
_Lease = tuple[str, float]  # host, expires


def _key(key: LeaseKey) -> _Key:
    return (key.route, key.fingerprint, key.model)


class LeaseTable:
    """A bounded LRU of leases with a sliding TTL, and the count of leases each host holds.

    Expiry is lazy: an expired lease is found out when it is next looked up, or when it reaches
    the least recently used end (trimmed on every `keep`), or evicted once the table is full.
    Loop safety: call every method from one event loop; nothing here suspends.
    """

    __slots__ = ("_clock", "_leases", "_max_entries", "_held", "_held_models", "_changed")

    def __init__(
        self,
        max_entries: int = 100_000,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[str], None] | None = None,
    ) -> None:
        self._max_entries = max(1, max_entries)
        self._clock = clock
        # Told the host whenever the count of leases it holds changes (synchronously).
        self._changed = on_change
        self._leases: OrderedDict[_Key, _Lease] = OrderedDict()
        self._held: dict[str, int] = {}  # stored leases per host
        self._held_models: dict[tuple[str, str], int] = {}  # ... per (host, model)

    def find(self, key: LeaseKey) -> str | None:
        """The host holding an unexpired lease for ``key``, without refreshing it."""
        stored = _key(key)
        current = self._leases.get(stored)
        if current is None:
            return None
        if current[1] <= self._clock():
            self._delete(stored, current)
            return None
        return current[0]

    def keep(self, key: LeaseKey, host: str, ttl: float) -> None:
        """Lease ``key`` to ``host`` for ``ttl`` seconds from now (new, moved or slid)."""
        if not key.fingerprint:
            return
        now = self._clock()
        stored = _key(key)
        current = self._leases.get(stored)
        if current is None:
            self._count(host, key.model, 1)
        else:
            if current[0] != host:
                self._count(current[0], key.model, -1)
                self._count(host, key.model, 1)
            self._leases.move_to_end(stored)
        self._leases[stored] = (host, now + ttl)
        self._trim(now)

    def drop_host(self, host: str) -> int:
        """Remove every lease held by ``host`` (a deleted host); return how many went."""
        doomed = [(key, lease) for key, lease in self._leases.items() if lease[0] == host]
        for key, lease in doomed:
            self._delete(key, lease)
        return len(doomed)

    def held(self, host: str, model: str | None = None) -> int:
        """Leases the host holds (of one model, if given); cheap. Expired leases are trimmed
        from the least recently used end first; one behind a live lease of a longer TTL may
        still count until it is looked up or reaches that end."""
        self._trim(self._clock())
        if model is not None:
            return self._held_models.get((host, model), 0)
        return self._held.get(host, 0)

    def expire(self) -> None:
        """Forget the leases that expired, from the least recently used end (as `held` does
        before it counts), so the counts are as of now."""
        self._trim(self._clock())

    def held_by_host(self) -> dict[str, int]:
        """Leases per host as `held` counts them, for the dashboard, the metrics and the
        history (sampled every second): O(hosts), never a walk of the table, which may hold
        a million conversations."""
        self._trim(self._clock())
        return dict(self._held)

    def __len__(self) -> int:
        """Stored leases, including expired ones not yet found out."""
        return len(self._leases)

    def _trim(self, now: float) -> None:
        leases = self._leases
        while leases:
            key, oldest = next(iter(leases.items()))
            if oldest[1] > now and len(leases) <= self._max_entries:
                return
            self._delete(key, oldest)

    def _delete(self, key: _Key, lease: _Lease) -> None:
        del self._leases[key]
        self._count(lease[0], key[2], -1)

    def _count(self, host: str, model: str, change: int) -> None:
        _add(self._held, host, change)
        _add(self._held_models, (host, model), change)
        if self._changed is not None:
            self._changed(host)


def _add(counts: dict[Any, int], key: object, change: int) -> None:
    count = counts.get(key, 0) + change
    if count > 0:
        counts[key] = count
    else:
        counts.pop(key, None)
