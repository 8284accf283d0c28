"""Per-(host, model) concurrency slots with a bounded fair line, and waits on several hosts.

A llama-server with ``parallel = 4`` must never see a fifth concurrent request: the fifth waits
here, and once ``queue_max`` requests already wait the next one is refused at once so the
client can go elsewhere. A pair's line (routing/core/line.py) grants in `FairLine`'s order:
priority class, then fair shares between client keys, arrival order within a key; with one
key and one class, arrival order. A class's headroom may keep a free slot from a lower class
(`set_fairness`); otherwise a free slot never idles while anyone waits.

Placement is one synchronous step: ``Limiter.place`` takes a free slot on the first pair of an
ordered list that has one, or else a place in the queue of the first pair with room, and
nothing can happen in between. A queued request holds a ``Waiter``: its place in one pair's line,
and optionally a watch on other pairs (``Limiter.watch``): it may also be handed a free slot of
those when their own queues are empty (a spill to another host after the route's patience, or
a fallback route). A waiter is granted exactly once, by whichever pair frees a slot first; its
``granted`` future then holds the ``Slot``. Nothing polls: a release hands its slot on at once.

A release runs no waiting request's code. Its line's head is granted the slot outright; a
watcher is *offered* it: the slot is held for it (counted in flight, so no newcomer takes it
meanwhile) and its ``offered`` future is set. The watcher's own task then decides
(``Waiter.settle``, which asks the ``accept`` its watch was given): it takes the slot, or
declines it, and a declined slot is offered at once to the pair's line, then to the watchers
after it. A wait that ends with offers undecided gives them back the same way.

Everything here runs on one asyncio event loop and is not thread-safe; no method awaits, so
every state change is atomic with respect to the other tasks on the loop.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from routing.core.errors import HostRemoved, Shed
from routing.core.fairness import (
    ANONYMOUS,
    DEFAULT_STARVATION_BOUND,
    Entry,
    Priority,
    Share,
    Work,
)
from routing.core.line import Line
from routing.core.pairs import Pair, PairSnapshot, PairState, Slot
from routing.core.waiter import Waiter, accept_any

__all__ = ["Limiter", "Pair", "PairSnapshot", "Slot", "Waiter"]


def _ignore(host: str) -> None:
    pass


class Limiter:
    """At most ``parallel`` slots in flight and ``queue_max`` waiters per (host, model).

    Unconfigured pairs behave as ``parallel = 1, queue_max = 0``. A release hands its slot to
    the next of the pair's line (`Line`), else offers it to the first watcher (whose task
    decides: `Waiter.settle`), so a newcomer never overtakes a waiter. No method raises on
    misuse. `clock`: the time waits are aged by (default: the waiters' event loop's, also
    when a slot is released from outside it).

    Loop safety: call every method from the same event loop; nothing here is thread-safe.
    """

    __slots__ = ("_pairs", "_changed", "_clock", "_headroom", "_starvation_bound")

    def __init__(
        self,
        on_change: Callable[[str], None] | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self._clock = clock
        self._headroom: dict[Priority, int] = {}
        self._starvation_bound = DEFAULT_STARVATION_BOUND
        # host -> model -> pair. Unconfigured pairs exist only while they are in use, so
        # clients naming arbitrary models cannot grow this without bound.
        self._pairs: dict[str, dict[str, PairState]] = {}
        # Told the host whenever a pair's slots in flight, line or limits change (a ranking
        # of hosts then finds the host's place again). Called synchronously, never twice per
        # change; it must not call back into the limiter.
        self._changed: Callable[[str], None] = on_change or _ignore

    def configure(self, host: str, model: str, parallel: int, queue_max: int) -> None:
        """Set the pair's limits, keeping its in-flight slots and its line.

        ``parallel`` below 1 counts as 1 and a negative ``queue_max`` as 0. Raising ``parallel``
        grants waiters at once; lowering it grants nothing until in-flight drops below it.
        Lowering ``queue_max`` keeps the waiters already queued and refuses newcomers meanwhile.
        """
        pair = self._pair(host, model)
        pair.parallel = max(1, parallel)
        pair.queue_max = max(0, queue_max)
        pair.configured = True
        self._changed(host)
        self._hand_over(pair)

    def set_fairness(self, headroom: Mapping[Priority, int], starvation_bound: float) -> None:
        """Each line's headroom per class (slots a lower class may not take while that class
        could come; capped at a pair's slots less one) and the wait past which a request goes
        before every class (seconds). Slots a smaller headroom frees are granted at once."""
        self._headroom = dict(headroom)
        self._starvation_bound = starvation_bound
        for models in list(self._pairs.values()):
            for pair in list(models.values()):
                pair.line.order.headroom = dict(headroom)
                pair.line.order.starvation_bound = starvation_bound
                self._hand_over(pair)

    def remove(self, host: str, model: str) -> None:
        """Forget the pair's configuration. Held slots release cleanly (the pair counts them
        until then); the waits in its line end with `HostRemoved`, so that placement places
        them again elsewhere: a slot of a pair no longer configured must go to no one."""
        pair = self._find(host, model)
        if pair is None:
            return
        pair.parallel, pair.queue_max, pair.configured = 1, 0, False
        self._changed(host)
        for waiter in list(pair.line):
            waiter.fail(HostRemoved(host, model))
        self._forget_if_idle(pair)

    def rename(self, old: str, new: str) -> None:
        """The host `old` is called `new` from now on (the same box): its pairs keep their
        slots in flight, lines and watchers under the new name. Slots held keep the name they
        were taken under, and release into the renamed pair. No-op when `old` holds nothing
        or `new` has pairs of its own."""
        models = self._pairs.get(old)
        if models is None or new in self._pairs:
            return
        del self._pairs[old]
        self._pairs[new] = models
        for pair in models.values():
            pair.host = new
        self._changed(old)
        self._changed(new)

    def place(
        self, pairs: Iterable[Pair], share: Share = ANONYMOUS, *, shed: bool = True
    ) -> Slot | Waiter | None:
        """A free slot on the first of `pairs` that has one (that `share`'s class may take);
        else a place in the line of the first with room; else, when `shed` and a lower class
        waits in one of their full lines, the place of the waiter refused for it (`_shed_for`);
        else None (all full). One step: nothing else runs in between.

        `pairs` is read lazily, at most twice (a ranking's order: the first free slot is
        usually the first pair's), twice more when every line is full, so it must not be an
        iterator."""
        got = self._take(pairs, share)
        if got is None and shed and self._shed_for(pairs, share):
            got = self._take(pairs, share)
        return got

    def _take(self, pairs: Iterable[Pair], share: Share) -> Slot | Waiter | None:
        for host, model in pairs:
            pair = self._find(host, model)
            if pair is None:  # unconfigured: one slot, no line (kept only while it is held)
                pair = self._pair(host, model)
            if pair.line.allows(share.priority, pair.parallel - pair.in_flight):
                pair.in_flight += 1
                pair.line.took(share.priority)
                self._changed(host)
                return Slot(self, pair, self._entry(share))
        for host, model in pairs:
            pair = self._find(host, model)
            if pair is not None and pair.has_queue_room():
                waiter = Waiter(self, pair, share)
                waiter._entry = pair.line.join(waiter, share, self._now(waiter))
                self._changed(host)
                return waiter
        return None

    def _shed_for(self, pairs: Iterable[Pair], share: Share) -> bool:
        """Refuse (`Shed`) the waiter whose place a newcomer of `share` takes: of the full
        lines of `pairs`, the first whose waiter to shed (`Line.to_shed`) is of the lowest
        class, so no request is refused while one of a lower class waits where it could have
        waited; of the newcomer's class only when no lower one waits in any (a key further
        ahead of its share). False when nobody is to be shed."""
        victim: tuple[Waiter, PairState] | None = None
        for host, model in pairs:
            pair = self._find(host, model)
            last = pair.line.to_shed(share) if pair is not None else None
            if last is not None and pair is not None:
                if victim is None or last.share.priority.rank < victim[0].share.priority.rank:
                    victim = (last, pair)
        if victim is None:
            return False
        waiter, pair = victim
        waiter.fail(Shed(pair.host, pair.model, waiter.share.priority, share.priority))
        waiter._leave()  # a wait cancelled this turn ignores `fail`: its place is free all the same
        return True

    def waiter(self, share: Share = ANONYMOUS) -> Waiter:
        """A waiter with no place in any line, for a request that can only watch (`watch`)."""
        return Waiter(self, None, share)

    def watch(
        self, waiter: Waiter, pairs: Iterable[Pair], accept: Callable[[Pair], bool] = accept_any
    ) -> None:
        """Let `waiter` also be handed a free slot of `pairs` (in this order of preference)
        when their own lines are empty and `accept(pair)` agrees at that moment. A free slot
        there right now is handed over at once. No-op for a waiter whose wait has ended."""
        if not waiter._live():
            return
        waiter._accept = accept
        for host, model in pairs:
            pair = self._pair(host, model)
            if pair is waiter._home or pair in waiter._watching:
                continue
            pair.watchers.append(waiter)
            waiter._watching[pair] = None
        for pair in list(waiter._watching):
            free = pair.parallel - pair.in_flight
            if (
                pair.queued == 0
                and pair.line.allows(waiter.share.priority, free)
                and accept(Pair(pair.host, pair.model))
            ):
                waiter._grant(pair)
                return

    def wake(self, host: str) -> None:
        """Offer the host's free slots to its watchers again (it became usable: up, undrained)."""
        for pair in list(self._pairs.get(host, {}).values()):
            self._hand_over(pair)

    def in_flight(self, host: str, model: str) -> int:
        """Slots of the pair held right now."""
        pair = self._find(host, model)
        return pair.in_flight if pair is not None else 0

    def queued(self, host: str, model: str) -> int:
        """Requests in the pair's line right now."""
        pair = self._find(host, model)
        return pair.queued if pair is not None else 0

    def free_for(self, host: str, model: str) -> int:
        """Free slots of one pair (an unconfigured pair has one slot)."""
        pair = self._find(host, model)
        if pair is None:
            return 1
        return max(0, pair.parallel - pair.in_flight)

    def free_slots(self, host: str) -> int:
        """Free slots summed over the host's configured models; 0 for an unknown host."""
        return sum(
            max(0, pair.parallel - pair.in_flight)
            for pair in self._pairs.get(host, {}).values()
            if pair.configured
        )

    def snapshot(self) -> list[PairSnapshot]:
        """Every configured or busy pair, sorted by (host, model)."""
        return sorted(
            (
                PairSnapshot(
                    pair.host,
                    pair.model,
                    pair.parallel,
                    pair.queue_max,
                    pair.in_flight,
                    pair.queued,
                )  # fmt: skip
                for models in self._pairs.values()
                for pair in models.values()
            ),
            key=lambda snap: (snap.host, snap.model),
        )

    def _find(self, host: str, model: str) -> PairState | None:
        models = self._pairs.get(host)
        return models.get(model) if models is not None else None

    def _pair(self, host: str, model: str) -> PairState:
        models = self._pairs.setdefault(host, {})
        pair = models.get(model)
        if pair is None:
            line = Line(self._headroom, self._starvation_bound)
            pair = models[model] = PairState(host, model, line=line)
        return pair

    def _now(self, waiter: Waiter) -> float:
        return self._clock() if self._clock is not None else waiter.granted.get_loop().time()

    def _entry(self, share: Share) -> Entry:
        """The line's record of a request that took a slot without waiting in that line (it
        is charged all the same, settling nothing in advance)."""
        return Entry(share.key, share.priority, share.weight)

    def _release(self, pair: PairState, priority: Priority, after: Waiter | None = None) -> None:
        if pair.in_flight > 0:
            pair.in_flight -= 1
            pair.line.gave(priority)
            self._changed(pair.host)
        self._hand_over(pair, after)
        self._forget_if_idle(pair)

    def _declined(self, pair: PairState, waiter: Waiter) -> None:
        """`waiter` gave back the slot held for it: to the line, then the watchers after it."""
        self._release(pair, waiter.share.priority, after=waiter)

    def _hand_over(self, pair: PairState, after: Waiter | None = None) -> None:
        """Give the pair's free slots to its line, in its order, then offer them to its
        watchers (those after `after`, when it still watches the pair)."""
        while pair.has_free_slot():
            got = self._next_in_line(pair)
            if got is not None:
                got[0]._grant(pair, got[1])
                continue
            waiter = self._next_watcher(pair, after)
            if waiter is None:
                return
            waiter._offer(pair)

    def _next_in_line(self, pair: PairState) -> tuple[Waiter, Entry] | None:
        line = pair.line
        while line:
            got = line.next(self._now(next(iter(line))), pair.parallel - pair.in_flight)
            if got is None or got[0]._live():
                return got
            line.order.charge(got[1], Work())  # its task was cancelled: it did nothing
        return None

    @staticmethod
    def _next_watcher(pair: PairState, after: Waiter | None) -> Waiter | None:
        """The first live watcher (after `after`) not yet holding an offer of the pair, whose
        class may take the slot."""
        watchers = pair.watchers
        start = watchers.index(after) + 1 if after is not None and after in watchers else 0
        free = pair.parallel - pair.in_flight
        for waiter in watchers[start:]:
            if (
                waiter._live()
                and pair not in waiter._offers
                and pair.line.allows(waiter.share.priority, free)
            ):
                return waiter
        return None

    def _line_moved(self, pair: PairState) -> None:
        self._changed(pair.host)
        if pair.listeners:
            for waiter in pair.line:
                if waiter._attached and waiter._changed is not None:
                    waiter._changed.set()
        self._forget_if_idle(pair)

    def _forget_if_idle(self, pair: PairState) -> None:
        if pair.configured or not pair.idle():
            return
        models = self._pairs.get(pair.host)
        if models is None or models.get(pair.model) is not pair:
            return
        del models[pair.model]
        if not models:
            del self._pairs[pair.host]
