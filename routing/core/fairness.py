"""Who goes next in one (host, model) line: priority classes, aging, headroom, fair shares.

A `FairLine` holds the requests waiting in one pair's line and decides, each time a slot frees,
which of them gets it (`next`). It only orders; it counts no slots and holds no futures, so
the limiter (or a shared state's script) keeps every count and asks it whom to grant.

The rules, in the order `next` applies them:

1. **Headroom.** A class may be given headroom (``headroom[priority] = h``): a waiter of a
   lower class may take a slot only if, after it does, at least ``h`` slots are still free or
   running a request of that class or a higher one. It is the one exception to work
   conservation: with no headroom configured, `next` grants someone whenever anyone waits and
   a slot is free. Headroom is capped at ``parallel - 1`` (the free slots plus those running),
   so a lower class can always run on one slot and its wait stays bounded.
2. **Aging.** A waiter that has waited `starvation_bound` seconds or longer puts its class
   before every other, the class of the oldest such first, so no request waits past the bound
   because of classes (only because every slot runs something and, with headroom, the higher
   class keeps its own). Within that class the shares still decide (rule 4): aging is between
   classes, and a flooded class's keys keep their weights however long they all wait.
3. **Classes.** Otherwise the highest class waiting goes first.
4. **Fair shares within a class.** Among the class's backlogged keys, the one with the least
   virtual work goes first (ties: the one whose oldest waiter came first). A key's virtual work
   grows by the work its requests actually did divided by its weight (a virtual token
   counter): over a backlogged stretch, keys get slot work in proportion to their weights. A
   key that becomes backlogged starts at the class's current virtual time, not where it was
   left, so an idle key cannot bank credit.
5. **FIFO within a key** (and class): first come, first served.

A full line also says whom to refuse for a newcomer (`to_shed`: load shedding): of a lower
class, the lowest class's most recently queued waiter; else, of the newcomer's own class, the
most recently queued waiter of the key furthest ahead of its share once its waiters are
counted, when it is still at least as far ahead as the newcomer's key with the newcomer: so a
full line holds each key's requests in proportion to its weight, not to its arrivals. The
limiter does the refusing.

Work is known only after an answer, so a grant charges the key an advance (a moving average of
the line's recent costs) and `charge` settles it with what the host reports: every entry that
`next` returned is charged exactly once (``Work()`` when nothing was done).

Pure: standard library only, no I/O, no clock of its own (times are the caller's). Not
thread-safe; every method is one synchronous step.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from enum import StrEnum

__all__ = [
    "ANONYMOUS",
    "DEFAULT_CACHED_WEIGHT",
    "DEFAULT_DECODE_WEIGHT",
    "DEFAULT_ESTIMATE",
    "DEFAULT_STARVATION_BOUND",
    "Entry",
    "FairLine",
    "Priority",
    "Share",
    "Work",
]

# A lower-class request waits at most this long before it goes first (seconds).
DEFAULT_STARVATION_BOUND = 30.0
# A prompt token found in the host's cache costs this share of one it evaluates: it holds the
# slot's KV but costs no compute.
DEFAULT_CACHED_WEIGHT = 0.1
# A generated token costs this many evaluated prompt tokens: a slot decodes one token a step
# where it evaluates a batch of prompt tokens (the virtual token counter's usual 2).
DEFAULT_DECODE_WEIGHT = 2.0
# The advance charged at a grant before any answer was charged: a modest request's cost.
DEFAULT_ESTIMATE = 512.0
# The moving average's share of each new cost in the advance.
_ESTIMATE_SHARE = 0.125
# Weights below this count as this, so a key's work stays finite.
_MIN_WEIGHT = 0.001
# Virtual work compared for equality at the door: sums of floats.
_EPSILON = 1e-9


def _weight(weight: float) -> float:
    return max(weight, _MIN_WEIGHT)


class Priority(StrEnum):
    """A request's class; a higher one goes first. The value is how config and headers name it."""

    INTERACTIVE = "interactive"
    STANDARD = "standard"
    BATCH = "batch"

    @property
    def rank(self) -> int:
        """Higher goes first: interactive 2, standard 1, batch 0."""
        return _RANKS[self]


_RANKS: dict[Priority, int] = {Priority.INTERACTIVE: 2, Priority.STANDARD: 1, Priority.BATCH: 0}
_HIGHEST_FIRST: tuple[Priority, ...] = tuple(sorted(Priority, key=lambda p: -_RANKS[p]))


@dataclass(slots=True, frozen=True)
class Share:
    """Whose share a request counts against: its client key's name ("" for a request with
    no key, all of them one key), the key's class and its weight (> 0)."""

    key: str = ""
    priority: Priority = Priority.STANDARD
    weight: float = 1.0


ANONYMOUS = Share()


@dataclass(slots=True, frozen=True)
class Work:
    """What one request made a host do, from the host's own counts: prompt tokens it evaluated,
    prompt tokens it found cached, tokens it generated."""

    evaluated: int = 0
    cached: int = 0
    generated: int = 0

    def cost(
        self,
        cached_weight: float = DEFAULT_CACHED_WEIGHT,
        decode_weight: float = DEFAULT_DECODE_WEIGHT,
    ) -> float:
        """The work in evaluated-prompt-token units; never negative."""
        return max(
            0.0, self.evaluated + self.cached * cached_weight + self.generated * decode_weight
        )


@dataclass(slots=True, eq=False)
class Entry:
    """One waiting request: its client key ("" for none), class, the key's weight and when it
    arrived (on the caller's clock). `seq` (arrival order) and `advance` (the work charged at
    its grant, until `charge` settles it) belong to the line. Compared by identity."""

    key: str
    priority: Priority = Priority.STANDARD
    weight: float = 1.0
    arrived: float = 0.0
    seq: int = field(default=-1, init=False)
    advance: float | None = field(default=None, init=False)


@dataclass(slots=True, eq=False)
class _Key:
    """One key's state within one class: its virtual work, its waiters, its grants unsettled."""

    work: float = 0.0
    waiting: deque[Entry] = field(default_factory=deque)
    unsettled: int = 0


class FairLine:
    """The order of one (host, model) line. See the module docstring for the rules.

    `headroom` maps a class to the slots a lower class may not take while that class could
    come (absent: none). `starvation_bound` is in the caller's time unit (seconds).
    """

    __slots__ = (
        "headroom", "starvation_bound", "cached_weight", "decode_weight",
        "_keys", "_virtual", "_estimate", "_seq", "_count",
    )  # fmt: skip

    def __init__(
        self,
        headroom: Mapping[Priority, int] | None = None,
        starvation_bound: float = DEFAULT_STARVATION_BOUND,
        cached_weight: float = DEFAULT_CACHED_WEIGHT,
        decode_weight: float = DEFAULT_DECODE_WEIGHT,
        estimate: float = DEFAULT_ESTIMATE,
    ) -> None:
        self.headroom: dict[Priority, int] = dict(headroom or {})
        self.starvation_bound = starvation_bound
        self.cached_weight = cached_weight
        self.decode_weight = decode_weight
        # class -> key -> state; a key is kept while it waits, has unsettled grants, or is
        # ahead of its class's virtual time (it would be lifted to it anyway when it returns).
        self._keys: dict[Priority, dict[str, _Key]] = {p: {} for p in Priority}
        self._virtual: dict[Priority, float] = dict.fromkeys(Priority, 0.0)
        self._estimate = estimate
        self._seq = 0
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[Entry]:
        """The waiting entries, class by class (highest first), each key's in arrival order."""
        for priority in _HIGHEST_FIRST:
            for state in self._keys[priority].values():
                yield from state.waiting

    def join(self, entry: Entry) -> None:
        """Put `entry` at the end of its key's line. A key that had nobody waiting in the class
        starts at the class's current virtual time if it was behind it."""
        entry.seq = self._seq
        self._seq += 1
        state = self._key(entry)
        if not state.waiting:
            state.work = max(state.work, self._floor(entry.priority))
        state.waiting.append(entry)
        self._count += 1

    def leave(self, entry: Entry) -> bool:
        """Take `entry` out of the line (its client left, its wait timed out). False when it
        was not waiting here (granted already, or never joined)."""
        state = self._keys[entry.priority].get(entry.key)
        if state is None or entry not in state.waiting:
            return False
        state.waiting.remove(entry)
        self._count -= 1
        self._forget_if_idle(entry.priority, entry.key)
        return True

    def next(
        self, now: float, free_slots: int, running_by_class: Mapping[Priority, int]
    ) -> Entry | None:
        """The waiter a freed slot goes to, taken out of the line and charged its advance; None
        when nobody waits, no slot is free, or headroom keeps the free slots from everyone
        waiting. `running_by_class`: the line's slots held now, per class (absent: 0)."""
        if free_slots <= 0 or not self._count:
            return None
        allowed = [p for p in _HIGHEST_FIRST if self.allows(p, free_slots, running_by_class)]
        entry = self._aged(now, allowed) or self._fairest(allowed)
        if entry is not None:
            self._grant(entry)
        return entry

    def last_below(self, priority: Priority) -> Entry | None:
        """The waiter a full line refuses to make room for a newcomer of `priority` (load
        shedding): of the lowest class waiting below `priority`, the one queued last; None
        when nobody below it waits. It stays in the line: the caller takes it out."""
        for lower in reversed(_HIGHEST_FIRST):
            if lower.rank >= priority.rank:
                return None
            lasts = [state.waiting[-1] for state in self._keys[lower].values() if state.waiting]
            if lasts:
                return max(lasts, key=lambda entry: entry.seq)
        return None

    def to_shed(self, key: str, priority: Priority, weight: float) -> Entry | None:
        """The waiter a full line refuses to make room for a newcomer of `key` (`priority`,
        `weight`): of a lower class (`last_below`), else of the newcomer's own class, the last
        of the key most ahead of its share (`_claim`: its virtual work with its waiters served)
        if, without that waiter, it is still at least as far ahead as the newcomer's key with
        the newcomer. None when nobody is to be refused. It stays in the line."""
        lower = self.last_below(priority)
        if lower is not None:
            return lower
        keys, per_request = self._keys[priority], self._estimate
        mine = keys.get(key)
        if mine is not None and mine.waiting:
            before = self._claim(mine)
        else:  # where `join` would start it
            floor = self._virtual_now(priority)
            before = max(mine.work, floor) if mine is not None else floor
        newcomer = before + per_request / _weight(weight)
        ahead = [(self._claim(s), s) for k, s in keys.items() if k != key and s.waiting]
        if not ahead:
            return None
        claim, state = max(ahead, key=lambda pair: (pair[0], pair[1].waiting[-1].seq))
        last = state.waiting[-1]
        if claim - per_request / _weight(last.weight) >= newcomer - _EPSILON:
            return last
        return None

    def _claim(self, state: _Key) -> float:
        """The key's virtual work once its waiters are served (each at the advance)."""
        return state.work + sum(self._estimate / _weight(e.weight) for e in state.waiting)

    def _virtual_now(self, priority: Priority) -> float:
        """The class's virtual time (`_floor`) as it is now, without moving it there."""
        works = [s.work for s in self._keys[priority].values() if s.waiting]
        return max(self._virtual[priority], min(works)) if works else self._virtual[priority]

    def charge(self, entry: Entry, work: Work) -> None:
        """Charge `entry`'s key with the work its request did, settling the advance charged
        at its grant. Also for a request that took a free slot without waiting. Call once."""
        weight = _weight(entry.weight)
        state = self._key(entry)
        cost = work.cost(self.cached_weight, self.decode_weight)
        if entry.advance is not None:
            state.work -= entry.advance / weight
            state.unsettled -= 1
            entry.advance = None
        state.work += cost / weight
        self._estimate += _ESTIMATE_SHARE * (cost - self._estimate)
        if not self._backlogged(entry.priority):
            # Nobody of the class waited while this ran, so it owes nobody: the class's time
            # moves on with it, and a key that joins later cannot claim that work as credit.
            self._virtual[entry.priority] = max(self._virtual[entry.priority], state.work)
        self._forget_if_idle(entry.priority, entry.key)

    def virtual_work(self, key: str, priority: Priority) -> float:
        """The key's virtual work in the class (0 for a key the line keeps nothing of)."""
        state = self._keys[priority].get(key)
        return state.work if state is not None else 0.0

    def _key(self, entry: Entry) -> _Key:
        keys = self._keys[entry.priority]
        state = keys.get(entry.key)
        if state is None:
            state = keys[entry.key] = _Key(work=self._virtual[entry.priority])
        return state

    def _floor(self, priority: Priority) -> float:
        """The class's virtual time: the least work of its backlogged keys, else where the
        class last was. Never goes back."""
        self._virtual[priority] = self._virtual_now(priority)
        return self._virtual[priority]

    def _backlogged(self, priority: Priority) -> bool:
        return any(state.waiting for state in self._keys[priority].values())

    def allows(self, priority: Priority, free: int, running: Mapping[Priority, int]) -> bool:
        """Whether a waiter of `priority` may take one of `free` slots under every higher
        class's headroom (capped at the line's slots less one)."""
        slots = free + sum(running.values())
        above = 0
        for higher in _HIGHEST_FIRST:
            if higher.rank <= priority.rank:
                return True
            above += running.get(higher, 0)
            kept = min(self.headroom.get(higher, 0), slots - 1)
            if free - 1 + above < kept:
                return False
        return True

    def _aged(self, now: float, allowed: list[Priority]) -> Entry | None:
        """When a waiter of an allowed class has waited the bound or longer: the fairest
        waiter of the class of the oldest such (`_fairest`)."""
        heads = [
            state.waiting[0]
            for priority in allowed
            for state in self._keys[priority].values()
            if state.waiting
        ]
        if not heads:
            return None
        oldest = min(heads, key=lambda entry: (entry.arrived, entry.seq))
        if now - oldest.arrived < self.starvation_bound:
            return None
        return self._fairest([oldest.priority])

    def _fairest(self, allowed: list[Priority]) -> Entry | None:
        """The first waiter of the highest allowed class's key with the least virtual work."""
        for priority in allowed:
            backlogged = [s for s in self._keys[priority].values() if s.waiting]
            if backlogged:
                state = min(backlogged, key=lambda s: (s.work, s.waiting[0].seq))
                return state.waiting[0]
        return None

    def _grant(self, entry: Entry) -> None:
        self._floor(entry.priority)  # the class's time, before this key moves ahead
        state = self._keys[entry.priority][entry.key]
        state.waiting.remove(entry)
        self._count -= 1
        entry.advance = self._estimate
        state.work += self._estimate / _weight(entry.weight)
        state.unsettled += 1

    def _forget_if_idle(self, priority: Priority, key: str) -> None:
        state = self._keys[priority].get(key)
        if state is None or state.waiting or state.unsettled:
            return
        if state.work <= self._virtual[priority]:
            del self._keys[priority][key]
