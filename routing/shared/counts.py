"""The counts a ranking, the dashboard and a refusal read, with state shared through Redis.

Placement never reads them to decide whether a place is free (only the scripts do); they rank
hosts and show the fleet. This process's own slots are counted exactly (`RedisSlots.held_on`,
no round trip); other processes' slots and every queue as the last tick read them
(`refresh`, one GET when nothing changed), or as the last refusal found them
(`count_refusal`); leases per host as the tick read them, plus this process's new ones until
a read surely holds them (`leased`). Use it on one event loop.
"""

from __future__ import annotations

from collections.abc import Callable

from routing.core.limiter import Pair, PairSnapshot
from routing.shared.leases import RedisLeases
from routing.shared.slots import RedisSlots

__all__ = ["SharedCounts"]


class SharedCounts:
    """Counts per (host, model) and per host; `on_change(host)` hears which moved."""

    def __init__(
        self, slots: RedisSlots, leases: RedisLeases, on_change: Callable[[str], None]
    ) -> None:
        self._slots = slots
        self._leases = leases
        self._changed = on_change
        self._limits: dict[Pair, tuple[int, int]] = {}  # as configured here
        self._others: dict[Pair, PairSnapshot] = {}  # other processes' slots, and the queues
        self._others_read: list[PairSnapshot] = []  # the snapshot `_others` was made from
        self._own_read: dict[Pair, int] = {}  # this process's slots as that snapshot came
        self._lease_counts: dict[str, int] = {}
        # This process's leases that the counts may not have yet, by host: (a number of this
        # process's, in order, the leases' version the write left) each.
        self._new_leases: dict[str, list[tuple[int, int | None]]] = {}
        self._leases_made = 0

    # -- what is configured here --------------------------------------------------------

    def configure(self, host: str, model: str, parallel: int, queue_max: int) -> None:
        """The pair's limits as this process configures them."""
        self._limits[Pair(host, model)] = (max(1, parallel), max(0, queue_max))

    def remove(self, host: str, model: str) -> None:
        """The pair is no longer configured here (its counts stay while requests run there)."""
        self._limits.pop(Pair(host, model), None)

    def models_of(self, host: str) -> list[str]:
        """The models configured here on `host`."""
        return [model for name, model in self._limits if name == host]

    def drop_host(self, host: str) -> None:
        """Forget the host's lease counts (it left the fleet)."""
        self._lease_counts.pop(host, None)
        self._new_leases.pop(host, None)

    # -- what changes them --------------------------------------------------------------

    def count_refusal(self) -> None:
        """Count the pairs a refusal was refused on as Redis counted them then, until the next
        tick: a refusal quotes these counts, and this process's view of other processes'
        requests may be a tick old (a host "up (0/2 running)" in a refusal for all full)."""
        for pair, (in_flight, queued) in self._slots.refused_on.items():
            limits = self._limits.get(pair)
            if limits is None:
                continue  # no longer configured here
            own = self._slots.held_on(*pair)
            others = PairSnapshot(*pair, *limits, max(0, in_flight - own), queued)
            if self._others.get(pair) != others:
                self._others[pair] = others
                self._own_read[pair] = own
                self._changed(pair.host)

    def leased(self, host: str, version: int | None) -> None:
        """A lease to `host` was written here (its write left the leases at `version`):
        counted at once, so conversations arriving within a tick spread over hosts, until a
        tick's read surely counts it (`refresh`)."""
        self._leases_made += 1
        self._new_leases.setdefault(host, []).append((self._leases_made, version))
        self._changed(host)

    async def refresh(self) -> None:
        """Read other processes' counts and the leases' (the tick); tell `on_change` the
        hosts whose counts moved. Raises StateUnavailable."""
        made_before = self._leases_made
        pairs = await self._slots.snapshot(others_only=True)
        fresh = pairs is not self._others_read  # the same list: nothing changed in Redis
        own = {pair: self._slots.held_on(*pair) for pair in self._limits} if fresh else {}
        leases = await self._leases.held_by_host()
        changed: set[str] = set()
        if fresh:
            others = {Pair(snap.host, snap.model): snap for snap in pairs}
            changed.update(pair.host for pair in others.keys() ^ self._others.keys())
            changed.update(p.host for p, snap in others.items() if self._others.get(p) != snap)
            self._others, self._others_read, self._own_read = others, pairs, own
        if leases is not self._lease_counts or self._new_leases:
            hosts = leases.keys() | self._new_leases.keys() | self._lease_counts.keys()
            held_before = {host: self.leases_held(host) for host in hosts}
            self._lease_counts = leases
            self._new_leases = _uncounted(self._new_leases, made_before, self._leases.counted_up_to)
            changed.update(h for h, held in held_before.items() if self.leases_held(h) != held)
        for host in changed:  # the rankings hear of these hosts only
            self._changed(host)

    # -- the counts ---------------------------------------------------------------------

    def free_for(self, host: str, model: str) -> int:
        parallel, _ = self._limits.get(Pair(host, model), (1, 0))
        return max(0, parallel - self.in_flight(host, model))

    def free_slots(self, host: str) -> int:
        return sum(self.free_for(*pair) for pair in self._limits if pair.host == host)

    def queued(self, host: str, model: str) -> int:
        others = self._others.get(Pair(host, model))
        return others.queued if others is not None else 0

    def in_flight(self, host: str, model: str) -> int:
        pair = Pair(host, model)
        snapshot = self._others.get(pair)
        others = snapshot.in_flight if snapshot is not None else 0
        counted = others + self._slots.held_on(host, model)
        # Other processes' counts are a tick old: a slot one of them gave back since, that
        # this process then took, is counted twice (busy hosts read "6/4 running"). Redis
        # grants none past `parallel`, so the pair holds at most that, or what it held as the
        # tick read it if more (`parallel` lowered under running requests).
        limits = self._limits.get(pair)
        if limits is None:  # no longer configured here: whatever still runs there counts
            return counted
        return min(counted, max(limits[0], others + self._own_read.get(pair, 0)))

    def snapshot(self) -> list[PairSnapshot]:
        """The configured pairs, and those no longer configured where requests still run or
        wait (in this process, or in others as the last tick read them)."""
        pairs = {*self._limits, *self._others, *self._slots.held_pairs()}
        snapshots = []
        for host, model in sorted(pairs):
            others = self._others.get(Pair(host, model))
            limits = (others.parallel, others.queue_max) if others is not None else (1, 0)
            parallel, queue_max = self._limits.get(Pair(host, model), limits)
            in_flight, queued = self.in_flight(host, model), self.queued(host, model)
            if Pair(host, model) in self._limits or in_flight or queued:
                snapshots.append(PairSnapshot(host, model, parallel, queue_max, in_flight, queued))
        return snapshots

    def leases_held(self, host: str, model: str | None = None) -> int:
        # Redis counts leases per host only; per model this over-counts, which makes a
        # router-mode host look busier (it then avoids unloading a model), never idler.
        return self._lease_counts.get(host, 0) + len(self._new_leases.get(host, ()))

    def leases_by_host(self) -> dict[str, int]:
        hosts = self._lease_counts.keys() | self._new_leases.keys()
        return {host: self.leases_held(host) for host in hosts}


def _uncounted(
    new: dict[str, list[tuple[int, int | None]]], made_before: int, counted: int | None
) -> dict[str, list[tuple[int, int | None]]]:
    """The leases of `new` a read of the counts may not hold: made after the read began
    (`made_before` made until then: those it holds, or they expired), and whose write left a
    later version than the read's (`counted`). One made during the read may or may not be in
    it; the versions tell, so it is counted once, not twice for a tick."""

    def uncounted(number: int, version: int | None) -> bool:
        if number <= made_before:
            return False
        return counted is None or version is None or version > counted

    left = {host: [made for made in leases if uncounted(*made)] for host, leases in new.items()}
    return {host: leases for host, leases in left.items() if leases}
