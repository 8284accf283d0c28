"""The order of one line (`routing.core.fairness`): classes, aging, headroom, fair shares, FIFO.

Pure: no loop, no clock. Times are plain numbers passed in, so nothing depends on the machine.
The stateful model at the end checks the promises after every step of random joins, leaves,
grants, charges and time passing; the share test checks that weights hold over long runs.
"""

from __future__ import annotations

import math
import random
from collections import Counter, defaultdict
from collections.abc import Mapping

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from routing.core.fairness import (
    DEFAULT_STARVATION_BOUND,
    Entry,
    FairLine,
    Priority,
    Work,
)

INTERACTIVE, STANDARD, BATCH = Priority.INTERACTIVE, Priority.STANDARD, Priority.BATCH
NOBODY_RUNS: Mapping[Priority, int] = {}


def waiting(line: FairLine, *entries: Entry) -> list[Entry]:
    for entry in entries:
        line.join(entry)
    return list(entries)


def grant_all(line: FairLine, now: float = 0.0) -> list[Entry]:
    """Everyone in the line, in the order one freed slot at a time hands them out."""
    order = []
    while (entry := line.next(now, 1, NOBODY_RUNS)) is not None:
        order.append(entry)
        line.charge(entry, Work(evaluated=100))
    return order


def grant_all_but(line: FairLine, count: int) -> list[Entry]:
    """The next `count` grants, with their work not charged yet."""
    return [entry for _ in range(count) if (entry := line.next(0.0, 1, NOBODY_RUNS))]


# -- classes, aging, FIFO --------------------------------------------------------------------


def test_an_interactive_request_goes_before_batch_requests_that_came_first() -> None:
    line = FairLine()
    batch = waiting(line, Entry("nightly", BATCH), Entry("nightly", BATCH))
    chat = Entry("chat", INTERACTIVE, arrived=1.0)
    line.join(chat)

    assert line.next(2.0, 1, NOBODY_RUNS) is chat
    assert grant_all(line, 2.0) == batch


def test_classes_go_interactive_then_standard_then_batch() -> None:
    line = FairLine()
    batch, standard, chat = waiting(
        line, Entry("b", BATCH), Entry("s", STANDARD), Entry("i", INTERACTIVE)
    )

    assert grant_all(line) == [chat, standard, batch]


def test_one_keys_requests_are_served_first_come_first_served() -> None:
    line = FairLine()
    mine = waiting(line, *(Entry("k", STANDARD, arrived=float(i)) for i in range(5)))

    assert grant_all(line, 5.0) == mine


def test_a_batch_request_waiting_past_the_bound_goes_before_a_newer_interactive_one() -> None:
    line = FairLine(starvation_bound=30.0)
    old_batch = Entry("nightly", BATCH, arrived=0.0)
    chat = Entry("chat", INTERACTIVE, arrived=25.0)
    waiting(line, old_batch, chat)

    assert line.next(29.0, 1, NOBODY_RUNS) is chat  # not yet past the bound: class decides
    line.join(newer_chat := Entry("chat", INTERACTIVE, arrived=29.5))
    assert line.next(30.0, 1, NOBODY_RUNS) is old_batch
    assert line.next(30.0, 1, NOBODY_RUNS) is newer_chat


def test_requests_past_the_bound_go_oldest_first_whatever_their_class() -> None:
    line = FairLine(starvation_bound=10.0)
    standard, batch, chat = waiting(
        line,
        Entry("s", STANDARD, arrived=1.0),
        Entry("b", BATCH, arrived=0.0),
        Entry("i", INTERACTIVE, arrived=2.0),
    )

    assert [line.next(12.0, 1, NOBODY_RUNS) for _ in range(3)] == [batch, standard, chat]


def test_the_default_starvation_bound_is_thirty_seconds() -> None:
    assert DEFAULT_STARVATION_BOUND == 30.0
    line = FairLine()
    old = Entry("b", BATCH, arrived=0.0)
    waiting(line, old, Entry("i", INTERACTIVE, arrived=29.0))

    assert line.next(30.0, 1, NOBODY_RUNS) is old


def test_a_request_that_left_is_never_granted() -> None:
    line = FairLine()
    first, second = waiting(line, Entry("k"), Entry("k"))

    assert line.leave(first)
    assert not line.leave(first)
    assert grant_all(line) == [second]
    assert not line.leave(second)  # granted already


# -- headroom --------------------------------------------------------------------------------


def test_headroom_keeps_the_last_free_slot_from_batch_while_interactive_may_come() -> None:
    line = FairLine(headroom={INTERACTIVE: 1})
    batch = Entry("nightly", BATCH)
    line.join(batch)

    assert line.next(0.0, 1, {BATCH: 3}) is None  # 4 slots, 3 run batch: the last one is kept
    assert line.next(0.0, 2, {BATCH: 2}) is batch  # one more is free: batch takes one of two


def test_without_headroom_batch_takes_the_last_free_slot() -> None:
    line = FairLine()
    batch = Entry("nightly", BATCH)
    line.join(batch)

    assert line.next(0.0, 1, {BATCH: 3}) is batch


def test_headroom_is_kept_by_interactive_requests_already_running() -> None:
    line = FairLine(headroom={INTERACTIVE: 1})
    batch = Entry("nightly", BATCH)
    line.join(batch)

    assert line.next(0.0, 1, {INTERACTIVE: 1, BATCH: 2}) is batch


def test_a_kept_slot_goes_to_the_interactive_request_that_comes() -> None:
    line = FairLine(headroom={INTERACTIVE: 1})
    batch = Entry("nightly", BATCH, arrived=0.0)
    line.join(batch)
    assert line.next(1.0, 1, {BATCH: 3}) is None

    line.join(chat := Entry("chat", INTERACTIVE, arrived=2.0))

    assert line.next(2.0, 1, {BATCH: 3}) is chat


def test_headroom_for_interactive_also_keeps_the_slot_from_standard() -> None:
    line = FairLine(headroom={INTERACTIVE: 1, STANDARD: 2})
    standard, batch = waiting(line, Entry("s", STANDARD), Entry("b", BATCH))

    assert line.next(0.0, 1, {BATCH: 3}) is None
    # 2 free: standard keeps 1 for interactive; batch would leave 1 where standard keeps 2.
    assert line.next(0.0, 2, {BATCH: 2}) is standard
    assert line.next(0.0, 2, {BATCH: 1, STANDARD: 1}) is batch


def test_headroom_larger_than_the_line_still_leaves_one_slot_to_a_lower_class() -> None:
    line = FairLine(headroom={INTERACTIVE: 8})
    batch = Entry("nightly", BATCH)
    line.join(batch)

    assert line.next(0.0, 1, {BATCH: 1}) is None
    assert line.next(0.0, 2, NOBODY_RUNS) is batch  # 2 slots: one kept, one for batch


def test_headroom_holds_even_for_a_request_past_the_bound() -> None:
    line = FairLine(headroom={INTERACTIVE: 1}, starvation_bound=10.0)
    batch = Entry("nightly", BATCH, arrived=0.0)
    line.join(batch)

    assert line.next(60.0, 1, {BATCH: 3}) is None


# -- fair shares -----------------------------------------------------------------------------


def test_backlogged_keys_with_weights_1_and_2_share_the_work_1_to_2() -> None:
    line = FairLine()
    done: defaultdict[str, float] = defaultdict(float)
    for key, weight in (("light", 1.0), ("heavy", 2.0)):
        for _ in range(2):
            line.join(Entry(key, weight=weight))
    for step in range(600):
        entry = line.next(float(step), 1, NOBODY_RUNS)
        assert entry is not None
        work = Work(evaluated=300, cached=500, generated=100)
        line.charge(entry, work)
        done[entry.key] += work.cost()
        line.join(Entry(entry.key, weight=entry.weight, arrived=float(step)))  # stays backlogged

    assert abs(done["heavy"] / done["light"] - 2.0) <= 0.2


def test_past_the_bound_the_shares_still_decide_within_a_class() -> None:
    """Aging is between classes: a flooded class whose waiters are all past the bound keeps
    its keys' weights, or two keys flooding it would be served in arrival order, 1:1."""
    line = FairLine(starvation_bound=10.0)
    light = Entry("light", weight=1.0, arrived=0.0)
    heavy = [Entry("heavy", weight=8.0, arrived=1.0), Entry("heavy", weight=8.0, arrived=2.0)]
    waiting(line, light, *heavy)
    line.charge(Entry("light", weight=1.0), Work(evaluated=10_000))  # far ahead of its share

    assert line.next(5.0, 1, NOBODY_RUNS) is heavy[0]  # under the bound: the share decides
    assert line.next(60.0, 1, NOBODY_RUNS) is heavy[1]  # past it too: light is older, not owed


def test_past_the_bound_the_class_of_the_oldest_goes_first_and_its_shares_decide_there() -> None:
    line = FairLine(starvation_bound=10.0)
    old_batch = Entry("nightly", BATCH, weight=1.0, arrived=0.0)
    favoured = Entry("eval", BATCH, weight=8.0, arrived=3.0)
    chat = Entry("chat", INTERACTIVE, arrived=4.0)
    waiting(line, old_batch, favoured, chat)
    line.charge(Entry("nightly", BATCH), Work(evaluated=10_000))

    assert line.next(20.0, 1, NOBODY_RUNS) is favoured  # batch's turn; eval is owed within it


def test_a_key_that_was_idle_does_not_bank_credit() -> None:
    line = FairLine()
    for step in range(20):  # "busy" alone in the line for a while
        line.join(Entry("busy"))
        entry = line.next(float(step), 1, NOBODY_RUNS)
        assert entry is not None
        line.charge(entry, Work(evaluated=1000))
    busy = waiting(line, *(Entry("busy") for _ in range(3)))
    idle = waiting(line, *(Entry("idle") for _ in range(3)))

    order = grant_all(line, 20.0)

    # Taking turns, the first to come first: not three in a row for the key that was away.
    assert order == [busy[0], idle[0], busy[1], idle[1], busy[2], idle[2]]


def test_a_key_whose_long_request_still_runs_comes_back_without_credit() -> None:
    line = FairLine()
    long = Entry("long")
    waiting(line, long, Entry("busy"), Entry("busy"))
    assert line.next(0.0, 1, NOBODY_RUNS) is long  # it runs on while "busy" takes turns
    for step in range(20):
        entry = line.next(float(step), 1, NOBODY_RUNS)
        assert entry is not None and entry.key == "busy"
        line.charge(entry, Work(evaluated=1000))
        line.join(Entry("busy", arrived=float(step)))
    back = waiting(line, *(Entry("long", arrived=20.0) for _ in range(2)))
    busy = [entry for entry in line if entry.key == "busy"]  # joined before

    assert grant_all(line, 20.0)[:4] == [busy[0], back[0], busy[1], back[1]]


def test_work_done_while_nobody_waited_is_owed_to_nobody() -> None:
    line = FairLine()
    for _ in range(20):  # "alone" takes free slots straight away: nobody waits
        line.charge(Entry("alone"), Work(evaluated=1000))
    newcomer = waiting(line, *(Entry("new") for _ in range(2)))
    alone = waiting(line, *(Entry("alone") for _ in range(2)))

    assert grant_all(line) == [newcomer[0], alone[0], newcomer[1], alone[1]]


def test_work_is_charged_by_what_the_host_did_with_cached_tokens_discounted() -> None:
    assert Work(evaluated=100, cached=1000, generated=50).cost() == 100 + 100 + 100
    assert Work(evaluated=100, cached=1000, generated=50).cost(0.5, 1.0) == 100 + 500 + 50

    line = FairLine()
    fresh, second_fresh = waiting(line, Entry("fresh"), Entry("fresh"))
    cached, second_cached = waiting(line, Entry("cached"), Entry("cached"))
    assert grant_all_but(line, 2) == [fresh, cached]
    line.charge(fresh, Work(evaluated=1000))
    line.charge(cached, Work(cached=1000))

    assert line.virtual_work("fresh", STANDARD) == 1000
    assert line.virtual_work("cached", STANDARD) == 100
    assert line.next(0.0, 1, NOBODY_RUNS) is second_cached


def test_a_grant_charges_an_advance_so_free_slots_are_shared_before_any_answer() -> None:
    line = FairLine()
    a = waiting(line, *(Entry("a") for _ in range(3)))
    b = waiting(line, *(Entry("b") for _ in range(3)))

    granted = [line.next(0.0, 4 - i, NOBODY_RUNS) for i in range(4)]

    assert granted == [a[0], b[0], a[1], b[1]]


# -- the stateful model ----------------------------------------------------------------------

KEYS = {"a": 1.0, "b": 2.0, "c": 1.0}
SLOTS = 3
BOUND = 10.0


class FairLineModel(RuleBasedStateMachine):
    """Random joins, leaves, grants, answers and time passing on one line of `SLOTS` slots,
    with or without headroom; after every step the line holds exactly the model's waiters,
    and every grant kept the promises (checked as it is made)."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.waiting: list[Entry] = []  # in arrival order
        self.running: list[Entry] = []
        self.line = FairLine(starvation_bound=BOUND)

    @precondition(lambda self: not self.waiting and not self.running)
    @rule(interactive=st.integers(0, 2), standard=st.integers(0, 2))
    def set_headroom(self, interactive: int, standard: int) -> None:
        self.line.headroom = {INTERACTIVE: interactive, STANDARD: standard}

    @rule(key=st.sampled_from(sorted(KEYS)), priority=st.sampled_from(Priority))
    def arrive(self, key: str, priority: Priority) -> None:
        entry = Entry(key, priority, KEYS[key], arrived=self.now)
        self.line.join(entry)
        self.waiting.append(entry)

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def leave(self, data: st.DataObject) -> None:
        entry = data.draw(st.sampled_from(self.waiting))
        assert self.line.leave(entry)
        self.waiting.remove(entry)

    @rule(seconds=st.sampled_from([0.5, 3.0, 12.0]))
    def time_passes(self, seconds: float) -> None:
        self.now += seconds

    @precondition(lambda self: self.running)
    @rule(data=st.data(), tokens=st.integers(0, 2000))
    def answer(self, data: st.DataObject, tokens: int) -> None:
        entry = data.draw(st.sampled_from(self.running))
        self.running.remove(entry)
        self.line.charge(entry, Work(evaluated=tokens, generated=tokens // 4))

    @rule()
    def slots_free(self) -> None:
        """Hand out every free slot, as the limiter does when one frees."""
        while len(self.running) < SLOTS:
            free = SLOTS - len(self.running)
            running = Counter(entry.priority for entry in self.running)
            entry = self.line.next(self.now, free, running)
            if entry is None:
                self.check_idle_slot(free, running)
                return
            self.check_grant(entry, free, running)
            self.waiting.remove(entry)
            self.running.append(entry)

    def check_idle_slot(self, free: int, running: Mapping[Priority, int]) -> None:
        """Work conserving: a free slot idles only when headroom keeps it from every waiter."""
        for entry in self.waiting:
            assert not self.may_take(entry.priority, free, running), entry

    def check_grant(self, entry: Entry, free: int, running: Mapping[Priority, int]) -> None:
        assert entry in self.waiting
        assert self.may_take(entry.priority, free, running)
        others = [w for w in self.waiting if w is not entry]
        # FIFO within a key (and class).
        assert not [w for w in others if (w.key, w.priority) == (entry.key, entry.priority)
                    and w.seq < entry.seq]  # fmt: skip
        # No starvation past the bound because of classes: when waiters past it could take
        # this slot, it went to the class of the oldest of them (whose shares decide within).
        aged = [w for w in self.waiting if self.now - w.arrived >= BOUND
                and self.may_take(w.priority, free, running)]  # fmt: skip
        if aged:
            oldest = min(aged, key=lambda w: (w.arrived, w.seq))
            assert entry.priority is oldest.priority, oldest
        # Classes: while nobody is past the bound, nobody of a higher class that could take it
        # was passed.
        else:
            assert not [w for w in others if w.priority.rank > entry.priority.rank
                        and self.may_take(w.priority, free, running)]  # fmt: skip

    def may_take(self, priority: Priority, free: int, running: Mapping[Priority, int]) -> bool:
        """Headroom, said again plainly: after the grant, each higher class with headroom h
        still has min(h, slots - 1) slots free or running its class or above."""
        for higher in Priority:
            if higher.rank > priority.rank:
                above = sum(n for p, n in running.items() if p.rank >= higher.rank)
                if free - 1 + above < min(self.line.headroom.get(higher, 0), SLOTS - 1):
                    return False
        return True

    @invariant()
    def the_line_holds_exactly_the_waiters(self) -> None:
        assert sorted(e.seq for e in self.line) == sorted(e.seq for e in self.waiting)
        assert len(self.line) == len(self.waiting)


FairLineModel.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_the_line_keeps_its_promises_whatever_happens = FairLineModel.TestCase


# -- shares converge to the weights ----------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(
    weights=st.lists(st.integers(1, 4), min_size=2, max_size=3),
    slots=st.integers(1, 4),
    sizes=st.lists(st.integers(50, 2000), min_size=1, max_size=20),
    seed=st.integers(0, 2**32),
)
def test_over_a_long_backlogged_run_each_key_gets_work_in_proportion_to_its_weight(
    weights: list[int], slots: int, sizes: list[int], seed: int
) -> None:
    picks = random.Random(seed)
    # Weights decide while waits stay under the bound; past it, the oldest goes first (below).
    line = FairLine(starvation_bound=math.inf)
    keys = {f"k{i}": float(weight) for i, weight in enumerate(weights)}
    for key, weight in keys.items():
        for _ in range(slots + 1):
            line.join(Entry(key, weight=weight))
    running: list[Entry] = []
    done: defaultdict[str, float] = defaultdict(float)
    for step in range(400 * len(keys)):
        while len(running) < slots:
            entry = line.next(float(step), slots - len(running), NOBODY_RUNS)
            assert entry is not None  # every key stays backlogged
            running.append(entry)
        entry = running.pop(picks.randrange(len(running)))
        work = Work(evaluated=picks.choice(sizes), generated=picks.choice(sizes) // 8)
        line.charge(entry, work)
        done[entry.key] += work.cost()
        line.join(Entry(entry.key, weight=entry.weight, arrived=float(step)))

    total, weight_sum = sum(done.values()), sum(keys.values())
    for key, weight in keys.items():
        assert abs(done[key] / total - weight / weight_sum) <= 0.1 * weight / weight_sum, key


def test_keys_of_weights_1_and_2_flooding_a_full_line_at_one_rate_are_served_1_to_2() -> None:
    """The door as the limiter keeps it: a full line sheds for a newcomer further below its
    share (`to_shed`), so what waits, and so what is served, follows the weights and not the
    arrivals (1:1 here); without it a full line admits each key what it sends."""
    line, places = FairLine(starvation_bound=30.0), 8
    served: Counter[str] = Counter()
    weights = {"light": 1.0, "heavy": 2.0}
    for step in range(800):
        now = float(step)
        for key in ("light", "heavy") if step % 2 else ("heavy", "light"):
            entry = Entry(key, weight=weights[key], arrived=now)
            if len(line) >= places:
                victim = line.to_shed(key, STANDARD, weights[key])
                if victim is None:
                    continue  # refused
                assert line.leave(victim)
            line.join(entry)
        granted = line.next(now, 1, NOBODY_RUNS)
        assert granted is not None
        line.charge(granted, Work(evaluated=400, generated=50))
        served[granted.key] += 1

    assert abs(served["heavy"] / served["light"] - 2.0) <= 0.2, served
