"""Conversation leases: keep a (route, fingerprint, model) on the host holding its KV cache,
and on one slot there, shared with as few of the host's other conversations as can be."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from routing.core.clock import loop_time
from routing.core.pairs import Pair

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
_Lease = tuple[str, float, int]  # host, expires, the slot number kept there (-1: none yet)
# The number of a lease served on its host before the host's slots were known (`leave_to_host`).
_HOSTS_CHOICE = -2


def _key(key: LeaseKey) -> _Key:
    return (key.route, key.fingerprint, key.model)


class LeaseTable:
    """A bounded LRU of leases with a sliding TTL, and the count of leases each host holds.

    Expiry is lazy: an expired lease is found out when it is next looked up, or when it reaches
    the least recently used end (trimmed on every `keep`), or evicted once the table is full.
    Loop safety: call every method from one event loop; nothing here suspends.
    """

    __slots__ = (
        "_clock", "_leases", "_max_entries", "_held", "_held_models", "_numbered", "_changed"
    )  # fmt: skip

    def __init__(
        self,
        max_entries: int = 100_000,
        clock: Callable[[], float] = loop_time,
        on_change: Callable[[str], None] | None = None,
    ) -> None:
        self._max_entries = max(1, max_entries)
        self._clock = clock
        # Told the host whenever the count of leases it holds changes (synchronously).
        self._changed = on_change
        self._leases: OrderedDict[_Key, _Lease] = OrderedDict()
        self._held: dict[str, int] = {}  # stored leases per host
        self._held_models: dict[Pair, int] = {}  # ... per (host, model)
        # The slot numbers kept by leases, per (host, model): number -> the leases keeping it.
        self._numbered: dict[Pair, dict[int, set[_Key]]] = {}

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
        number = -1
        if current is None:
            self._count(host, key.model, 1)
        else:
            if current[0] != host:
                self._unnumber(stored, current)
                self._count(current[0], key.model, -1)
                self._count(host, key.model, 1)
            else:
                number = current[2]
            self._leases.move_to_end(stored)
        self._leases[stored] = (host, now + ttl, number)
        self._trim(now)

    def slot_number(self, key: LeaseKey, host: str, slots: int) -> int | None:
        """The slot number (0 to `slots` - 1) the conversation keeps on `host`, its lease's
        host: the one it kept before, else the one the fewest other leases of the (host,
        model) keep (the lowest of those); None when it holds no live lease there.

        With a slot for each conversation, each number goes to one conversation, so one sent
        to its number (llama-server's `id_slot`) finds its own history there, not another's;
        with more, they share the numbers as evenly as they can. None too for a conversation
        left in the slot the host chose (`leave_to_host`)."""
        now = self._clock()
        self._trim(now)  # numbers kept by expired leases go back first (as lazily as `held`)
        stored = _key(key)
        current = self._leases.get(stored)
        if current is None or current[0] != host or current[1] <= now:
            return None
        if current[2] == _HOSTS_CHOICE:
            return None
        if 0 <= current[2] < slots:
            return current[2]
        self._unnumber(stored, current)  # a number beyond `slots` (fewer since) is given up
        kept = self._numbered.setdefault(Pair(host, key.model), {})
        number = min(range(slots), key=lambda n: len(kept.get(n, ())))  # the lowest of ties
        self._leases[stored] = (host, current[1], number)
        kept.setdefault(number, set()).add(stored)
        return number

    def leave_to_host(self, key: LeaseKey, host: str) -> None:
        """The conversation `key` was served on `host`, its lease's host, naming no slot
        because the host's slots were not known yet: llama-server put it in a slot of its
        choosing, which no number says. Naming its number on a later turn would send it to
        another slot, away from its history (to an empty one, or to another conversation's);
        naming none lets llama-server find the slot that holds the most of its prompt. So it
        keeps no number (`slot_number`) while its lease lives on that host."""
        stored = _key(key)
        current = self._leases.get(stored)
        if current is None or current[0] != host or current[2] == _HOSTS_CHOICE:
            return
        self._unnumber(stored, current)
        self._leases[stored] = (host, current[1], _HOSTS_CHOICE)  # its place in the LRU kept

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
            return self._held_models.get(Pair(host, model), 0)
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
        self._unnumber(key, lease)
        self._count(lease[0], key[2], -1)

    def _unnumber(self, key: _Key, lease: _Lease) -> None:
        """Free the slot number `lease` keeps, if any (the lease itself is left as it is)."""
        if lease[2] < 0:
            return
        pair = Pair(lease[0], key[2])
        kept = self._numbered.get(pair, {})
        holders = kept.get(lease[2], set())
        if key in holders:
            holders.discard(key)
            if not holders:
                del kept[lease[2]]
            if not kept:
                del self._numbered[pair]

    def _count(self, host: str, model: str, change: int) -> None:
        _add(self._held, host, change)
        _add(self._held_models, Pair(host, model), change)
        if self._changed is not None:
            self._changed(host)


def _add(counts: dict[Any, int], key: object, change: int) -> None:
    count = counts.get(key, 0) + change
    if count > 0:
        counts[key] = count
    else:
        counts.pop(key, None)
