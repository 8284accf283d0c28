"""Load shedding by class: when every line a request could wait in is full, a request of a
higher class takes the place of the lowest class's most recently queued waiter, which is refused
(429 `over_capacity`); never the other way round. Within a class, a newcomer whose key is
further below its share takes the place of the last of the key most ahead of it. Driven
through the limiter (and placement's opening) as requests drive it; the order of the line
itself is tested in test_fair_limiter.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from routing.core.errors import QueueFull, Shed, answer_for
from routing.core.fairness import Priority, Share
from routing.core.limiter import Limiter, Slot, Waiter
from routing.core.pairs import Pair
from routing.core.placement import Placer, Waiting
from tests.helpers.memory_fleet import MODEL, MemoryFleet, Route, host

PAIR = Pair("h1", "m")
OTHER = Pair("h2", "m")
BATCH = Share("nightly", Priority.BATCH)
EVAL = Share("evals", Priority.BATCH)
STANDARD = Share("team", Priority.STANDARD)
CHAT = Share("chat", Priority.INTERACTIVE)
T = TypeVar("T")


def full_line(*waiting: Share, pairs: tuple[Pair, ...] = (PAIR,)) -> tuple[Limiter, list[Waiter]]:
    """A limiter whose pairs have one slot each, held, and a line of `len(waiting)` places
    each, filled with `waiting` in turn (pair by pair)."""
    limiter = Limiter(clock=lambda: 0.0)
    for pair in pairs:
        limiter.configure(pair.host, pair.model, parallel=1, queue_max=len(waiting))
        assert isinstance(limiter.place([pair], STANDARD), Slot)
    waiters = []
    for pair in pairs:
        for share in waiting:
            got = limiter.place([pair], share)
            assert isinstance(got, Waiter), f"expected a place in line, got {got!r}"
            waiters.append(got)
    return limiter, waiters


def shed(waiter: Waiter) -> bool:
    """Whether `waiter` was refused to make room for a higher class."""
    return waiter.granted.done() and isinstance(waiter.granted.exception(), Shed)


async def test_an_interactive_request_at_a_full_line_takes_the_last_batch_requests_place() -> None:
    limiter, (first, last) = full_line(BATCH, BATCH)

    newcomer = limiter.place([PAIR], CHAT)

    assert isinstance(newcomer, Waiter)
    assert shed(last) and not first.granted.done()
    assert newcomer.position == 1 and first.position == 2
    assert limiter.queued(*PAIR) == 2
    refusal = last.granted.exception()
    assert refusal is not None
    answer = answer_for(refusal)
    assert (answer.status, answer.code, answer.retry_after) == (429, "over_capacity", 1)
    assert "shed" in answer.message and "interactive" in answer.message
    assert "batch" in answer.message and "h1" in answer.message


async def test_the_lowest_class_is_shed_first_and_within_it_the_most_recently_queued() -> None:
    limiter, (early_standard, early_batch, late_batch, late_standard) = full_line(
        STANDARD, BATCH, EVAL, STANDARD
    )

    limiter.place([PAIR], CHAT)
    assert [shed(w) for w in (early_standard, early_batch, late_batch, late_standard)] == [
        False, False, True, False,
    ]  # fmt: skip
    limiter.place([PAIR], CHAT)
    assert shed(early_batch) and not shed(late_standard)
    limiter.place([PAIR], CHAT)
    assert shed(late_standard) and not shed(early_standard)


async def test_a_batch_request_at_a_full_line_is_refused_and_sheds_nobody() -> None:
    limiter, waiters = full_line(BATCH, STANDARD)

    assert limiter.place([PAIR], EVAL) is None
    assert not any(w.granted.done() for w in waiters)


async def test_nobody_of_a_higher_class_or_of_an_even_share_in_its_own_class_is_shed() -> None:
    limiter, waiters = full_line(CHAT, STANDARD)

    assert limiter.place([PAIR], STANDARD) is None
    assert limiter.place([PAIR], Share("other chat", Priority.INTERACTIVE)) is not None
    assert shed(waiters[1]) and not waiters[0].granted.done()
    assert limiter.place([PAIR], CHAT) is None  # only interactive requests wait now


async def test_a_key_with_no_place_in_a_line_another_key_of_its_class_fills_takes_its_last() -> (
    None
):
    limiter, (first, last) = full_line(BATCH, BATCH)

    newcomer = limiter.place([PAIR], EVAL)

    assert isinstance(newcomer, Waiter)
    assert shed(last) and not first.granted.done()
    refusal = last.granted.exception()
    assert refusal is not None
    answer = answer_for(refusal)
    assert (answer.status, answer.code) == (429, "over_capacity")
    assert "further below its share" in answer.message
    assert limiter.place([PAIR], EVAL) is None  # one place each: even shares, nobody shed


async def test_a_full_line_holds_a_key_of_weight_2_and_one_of_weight_1_two_for_one() -> None:
    light, heavy = Share("light", Priority.BATCH, 1.0), Share("heavy", Priority.BATCH, 2.0)
    limiter, lights = full_line(light, light, light)

    assert isinstance(limiter.place([PAIR], heavy), Waiter)
    assert isinstance(limiter.place([PAIR], heavy), Waiter)
    assert limiter.place([PAIR], heavy) is None  # two for one: the door holds

    assert [shed(w) for w in lights] == [False, True, True]
    assert limiter.place([PAIR], light) is None  # and light gets none back


async def test_a_standard_request_sheds_a_batch_request_never_an_interactive_one() -> None:
    limiter, (chat, batch) = full_line(CHAT, BATCH)

    assert isinstance(limiter.place([PAIR], STANDARD), Waiter)

    assert shed(batch) and not chat.granted.done()


async def test_a_line_with_room_elsewhere_sheds_nobody() -> None:
    limiter, waiters = full_line(BATCH, BATCH)
    limiter.configure(OTHER.host, OTHER.model, parallel=1, queue_max=1)
    assert isinstance(limiter.place([OTHER], BATCH), Slot)

    newcomer = limiter.place([PAIR, OTHER], CHAT)

    assert isinstance(newcomer, Waiter) and newcomer.host == OTHER.host
    assert not any(w.granted.done() for w in waiters)


async def test_of_several_full_lines_the_one_whose_lowest_class_is_lowest_gives_a_place() -> None:
    limiter, (standard_1, standard_2, batch_1, batch_2) = full_line(
        STANDARD, STANDARD, pairs=(PAIR, OTHER)
    )
    for waiter in (batch_1, batch_2):  # OTHER's line: standard requests, then batch ones
        waiter.cancel()
    batch = [limiter.place([OTHER], BATCH), limiter.place([OTHER], BATCH)]
    assert isinstance(batch[0], Waiter) and isinstance(batch[1], Waiter)

    newcomer = limiter.place([PAIR, OTHER], CHAT)

    assert isinstance(newcomer, Waiter) and newcomer.host == OTHER.host
    assert shed(batch[1]) and not batch[0].granted.done()
    assert not standard_1.granted.done() and not standard_2.granted.done()


async def test_a_conversation_whose_home_is_full_queues_on_another_host_before_shedding() -> None:
    route = Route(hosts=("gpu1", "gpu2"))
    fleet = MemoryFleet({"gpu1": host(1, 1), "gpu2": host(1, 1)}, route)
    home = await Placer(fleet, route, MODEL, "talk", 0.0, share=CHAT).now()  # gpu1 (route order)
    assert not isinstance(home, Waiting) and home.host == "gpu1"
    batch = fleet.limiter.place([Pair("gpu1", MODEL)], BATCH)
    fleet.occupy("gpu2")

    again = await Placer(fleet, route, MODEL, "talk", 0.0, share=CHAT).now()

    assert isinstance(again, Waiting) and again.host == "gpu2"
    assert isinstance(batch, Waiter) and not batch.granted.done()
    third = await Placer(fleet, route, MODEL, "talk", 0.0, share=CHAT).now()  # now both full
    assert isinstance(third, Waiting) and third.host == "gpu1" and shed(batch)


async def test_a_conversation_whose_only_host_is_full_sheds_a_batch_request_there() -> None:
    route = Route(hosts=("gpu1",))
    fleet = MemoryFleet({"gpu1": host(1, 1)}, route)
    first = await Placer(fleet, route, MODEL, "talk", 0.0, share=CHAT).now()
    batch = fleet.limiter.place([Pair("gpu1", MODEL)], BATCH)

    again = await Placer(fleet, route, MODEL, "talk", 0.0, share=CHAT).now()

    assert isinstance(again, Waiting) and isinstance(batch, Waiter) and shed(batch)
    assert not isinstance(first, Waiting)
    try:
        await Placer(fleet, route, MODEL, "talk", 0.0, share=BATCH).now()
    except QueueFull:
        pass
    else:
        raise AssertionError("a batch request at a line full of interactive ones is refused")


# -- a model: arrivals of every class, slots freed, waiters leaving -------------------------

CLASSES = st.sampled_from([BATCH, EVAL, STANDARD, CHAT])


class SheddingModel(RuleBasedStateMachine):
    """Two 1-slot pairs with short lines; requests of every class arrive, slots free, waiters
    leave. After each arrival: a refused newcomer leaves no lower class waiting in any line it
    could have waited in; a shed waiter was of the lowest class waiting, and the last of its
    class queued in its line when below the newcomer's, else (the newcomer's own class) the
    last of another key's."""

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        self.limiter = Limiter(clock=lambda: 0.0)
        for pair in (PAIR, OTHER):
            self.limiter.configure(pair.host, pair.model, parallel=1, queue_max=2)
        self.waiting: list[Waiter] = []
        self.held: list[Slot] = []

    def run(self, step: Callable[[], T]) -> T:
        """`step()` on the model's loop, as a request's task runs it."""

        async def on_loop() -> T:
            return step()

        return self.loop.run_until_complete(on_loop())

    def teardown(self) -> None:
        self.loop.close()
        asyncio.set_event_loop(None)

    def lines(self) -> list[list[Waiter]]:
        return [
            [w for w in self.waiting if w.host == pair.host and not w.granted.done()]
            for pair in (PAIR, OTHER)
        ]

    @rule(share=CLASSES, both=st.booleans())
    def arrive(self, share: Share, both: bool) -> None:
        pairs = [PAIR, OTHER] if both else [PAIR]
        before = self.lines()
        could = [w for line in before[: len(pairs)] for w in line]
        got = self.run(lambda: self.limiter.place(pairs, share))
        if got is None:
            ranks = [w.share.priority.rank for w in could]
            assert all(rank >= share.priority.rank for rank in ranks), "refused, a lower waits"
        elif isinstance(got, Slot):
            self.held.append(got)
        else:
            self.waiting.append(got)
        gone = [w for line in before for w in line if shed(w)]
        assert len(gone) <= 1
        for victim in gone:
            rank = victim.share.priority.rank
            assert victim in could and rank <= share.priority.rank
            assert rank == min(w.share.priority.rank for w in could)
            own = next(line for line in before if victim in line)
            if rank < share.priority.rank:
                assert victim is [w for w in own if w.share.priority.rank == rank][-1]
            else:  # its own class: another key's last, one further ahead of its share
                assert victim.share.key != share.key
                assert victim is [w for w in own if w.share == victim.share][-1]

    @rule(data=st.data())
    def free_a_slot(self, data: st.DataObject) -> None:
        self.collect()
        held = [slot for slot in self.held if not slot.released]
        if held:
            self.run(data.draw(st.sampled_from(held)).release)
        self.collect()

    @rule(data=st.data())
    def a_waiter_leaves(self, data: st.DataObject) -> None:
        live = [w for w in self.waiting if not w.granted.done()]
        if live:
            granted = self.run(data.draw(st.sampled_from(live)).cancel)
            if granted is not None:
                self.run(granted.release)
        self.collect()

    def collect(self) -> None:
        """The slots granted to waiters are held from now on."""
        for waiter in self.waiting:
            if waiter.granted.done() and not waiter.granted.cancelled():
                if waiter.granted.exception() is None:
                    self.held.append(waiter.granted.result())
        self.waiting = [w for w in self.waiting if not w.granted.done()]

    @invariant()
    def never_over_the_limits(self) -> None:
        for pair in (PAIR, OTHER):
            assert self.limiter.in_flight(*pair) <= 1
            assert self.limiter.queued(*pair) <= 2


SheddingModel.TestCase.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)  # fmt: skip
TestShedding = SheddingModel.TestCase
