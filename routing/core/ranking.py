"""A route's hosts for one model in the chooser's order, kept as their state changes.

`routing.core.choose.ranked` orders a route's candidates from scratch: a candidate per host
and a sort, O(n log n) for a route of n hosts, which a request would pay two or three times.
A `Ranking` holds the same order (the same `rank_key`) and keeps it: whatever changes a
host's key (a slot taken or freed, a line moving, a lease kept or expired, its health or the
models it has loaded) calls `Rankings.touch(host)`, which only marks the host in the rankings
it belongs to; the next read of a ranking computes the marked hosts' keys again and moves each
to its place (a binary search, and a move of the list's tail in C). So a read costs O(1) plus
O(log n) per host changed since the last, and a request changes one or two.

The facts behind a key come from a `Facts` function (the runtime's: configuration, health,
the fleet state's counts). A configuration change builds new rankings (`Rankings.clear`): a
host's route position, weight, drain and models are configuration.

Pure: standard library only. Not thread-safe; call from one event loop.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable, Mapping, Sequence, Set

from routing.core.choose import Candidate, RankKey, rank_key
from routing.core.limiter import Pair

__all__ = ["Facts", "Ranking", "Rankings"]

# (host, model) -> what the chooser knows about that host for the model, None when the host is
# not part of the fleet now (unknown, disabled). `model` None: a request that names no model.
Facts = Callable[[str, str | None], Candidate | None]


class Ranking:
    """The eligible hosts of one route for one model, best first, as `choose.ranked` orders
    them. Read `hosts()` or `pairs()`; the sequences they return are the ranking's own and
    change at the next read, so copy what must outlive an `await`."""

    __slots__ = ("model", "listed", "_listed", "_facts", "_index", "_keys", "_hosts", "_pairs",
                 "_key_of", "_dirty", "_out")  # fmt: skip

    def __init__(self, hosts: Iterable[str], model: str | None, facts: Facts) -> None:
        self.model = model
        self._facts = facts
        self._index = {host: index for index, host in enumerate(dict.fromkeys(hosts))}
        self._keys: list[RankKey] = []
        self._hosts: list[str] = []
        self._pairs: list[Pair] = []
        self._key_of: dict[str, RankKey] = {}
        self._dirty: set[str] = set()
        known = [(host, facts(host, model)) for host in self._index]
        # The hosts that list the model, usable now or not (configuration: fixed until a
        # reload builds a new ranking).
        self.listed: tuple[str, ...] = tuple(
            host for host, candidate in known if candidate is not None and candidate.can_serve
        )
        self._listed = frozenset(self.listed)
        keyed = sorted(
            (rank_key(candidate, self._index[host]), host)
            for host, candidate in known
            if candidate is not None and candidate.eligible
        )
        for key, host in keyed:
            self._keys.append(key)
            self._hosts.append(host)
            self._pairs.append(Pair(host, model or ""))
            self._key_of[host] = key
        self._out = {host for host in self.listed if host not in self._key_of}

    def lists(self, host: str) -> bool:
        """Whether `host` lists the model (usable now or not)."""
        return host in self._listed

    def hosts(self) -> Sequence[str]:
        """The eligible hosts, best first."""
        self._settle()
        return self._hosts

    def pairs(self) -> Sequence[Pair]:
        """`hosts()` as (host, model) pairs."""
        self._settle()
        return self._pairs

    def places(self) -> Mapping[str, RankKey]:
        """Each eligible host's key, which sorts as `hosts()` is ordered: a host's place in
        the order without a walk of it (the ranking's own mapping)."""
        self._settle()
        return self._key_of

    def unusable(self) -> Set[str]:
        """The hosts that list the model but are not eligible now (down, draining), as a set
        of the ranking's own."""
        self._settle()
        return self._out

    def touch(self, host: str) -> None:
        """Something behind `host`'s key changed: its place is found again at the next read."""
        if host in self._index:
            self._dirty.add(host)

    def _settle(self) -> None:
        # Reading a host's facts may change another's (a lease found expired): until none left.
        while self._dirty:
            self._move(self._dirty.pop())

    def _move(self, host: str) -> None:
        """Find `host`'s place again from its facts as they are now."""
        candidate = self._facts(host, self.model)
        new = None
        if candidate is not None and candidate.eligible:
            new = rank_key(candidate, self._index[host])
        old = self._key_of.get(host)
        if new == old:
            return
        if old is not None:
            at = bisect_left(self._keys, old)
            del self._keys[at], self._hosts[at], self._pairs[at]
            del self._key_of[host]
        if new is not None:
            at = bisect_left(self._keys, new)
            self._keys.insert(at, new)
            self._hosts.insert(at, host)
            self._pairs.insert(at, Pair(host, self.model or ""))
            self._key_of[host] = new
        if host in self._listed:
            if new is None:
                self._out.add(host)
            else:
                self._out.discard(host)


class Rankings:
    """Every ranking in use, by (route, model), built on first use; `touch` reaches each
    ranking a host belongs to."""

    __slots__ = ("_facts", "_rankings", "_of_host")

    def __init__(self, facts: Facts) -> None:
        self._facts = facts
        self._rankings: dict[tuple[str, str | None], Ranking] = {}
        self._of_host: dict[str, list[Ranking]] = {}

    def of(self, route: str, hosts: Sequence[str], model: str | None) -> Ranking:
        """Route `route`'s ranking for `model` (`hosts`: the route's, in its order). Call only
        with models the route serves (or None): each one asked for is kept until `clear`."""
        ranking = self._rankings.get((route, model))
        if ranking is None:
            ranking = self._rankings[(route, model)] = Ranking(hosts, model, self._facts)
            for host in dict.fromkeys(hosts):
                self._of_host.setdefault(host, []).append(ranking)
        return ranking

    def touch(self, host: str) -> None:
        for ranking in self._of_host.get(host, ()):
            ranking.touch(host)

    def clear(self) -> None:
        """Forget every ranking (the configuration changed): each is built again when read."""
        self._rankings.clear()
        self._of_host.clear()
