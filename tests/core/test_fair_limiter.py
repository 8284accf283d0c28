"""The limiter's line in fair order: priority classes, aging, headroom, weighted shares.

`routing/core/fairness.py` is the policy, tested alone in test_fairness.py; these tests drive it
through the limiter, as requests do: slots held and released, waiters granted in turn. The
clock is the test's own (`Clock`), so waits age without sleeping.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable

from routing.core.fairness import Priority, Share, Work
from routing.core.limiter import Limiter, Slot, Waiter
from routing.core.pairs import Pair

PAIR = Pair("h1", "m")
BATCH = Share("nightly", Priority.BATCH)
CHAT = Share("chat", Priority.INTERACTIVE)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def limiter_of(parallel: int = 1, queue_max: int = 20, clock: Clock | None = None) -> Limiter:
    limiter = Limiter(clock=clock or Clock())
    limiter.configure(PAIR.host, PAIR.model, parallel=parallel, queue_max=queue_max)
    return limiter


def take(limiter: Limiter, share: Share) -> Slot:
    got = limiter.place([PAIR], share)
    assert isinstance(got, Slot), f"expected a free slot, got {got!r}"
    return got


def line_up(limiter: Limiter, share: Share) -> Waiter:
    got = limiter.place([PAIR], share)
    assert isinstance(got, Waiter), f"expected a place in line, got {got!r}"
    return got


def served_in_turn(
    slot: Slot, waiters: list[Waiter], work: Work | Callable[[Slot], Work] = Work()
) -> list[Waiter]:
    """Release `slot`, then each slot granted in turn (each charged `work`, or what `work`
    says of it): the waiters in the order they were served."""
    order: list[Waiter] = []
    while True:
        slot.charge(work(slot) if callable(work) else work)
        slot.release()
        granted = [w for w in waiters if w not in order and w.granted.done()]
        if not granted:
            return order
        assert len(granted) == 1, "one freed slot went to more than one waiter"
        order.append(granted[0])
        slot = granted[0].granted.result()


async def test_with_one_key_and_one_class_the_line_is_first_come_first_served() -> None:
    limiter = limiter_of()
    held = take(limiter, Share("only"))
    waiters = [line_up(limiter, Share("only")) for _ in range(6)]

    assert [w.position for w in waiters] == [1, 2, 3, 4, 5, 6]
    assert served_in_turn(held, waiters, Work(evaluated=100, generated=50)) == waiters


async def test_requests_without_a_key_are_one_anonymous_key_served_first_come() -> None:
    limiter = limiter_of()
    held = take(limiter, Share())
    waiters = [line_up(limiter, Share()) for _ in range(4)]

    assert served_in_turn(held, waiters, Work(evaluated=10)) == waiters


async def test_an_interactive_request_goes_before_batch_requests_queued_earlier() -> None:
    limiter = limiter_of()
    held = take(limiter, BATCH)
    batch = [line_up(limiter, BATCH) for _ in range(3)]
    chat = line_up(limiter, CHAT)

    assert chat.position == 1
    assert served_in_turn(held, [*batch, chat]) == [chat, *batch]


async def test_two_backlogged_standard_keys_of_weights_1_and_2_get_grants_1_to_2() -> None:
    limiter = limiter_of(queue_max=200)
    light, heavy = Share("light", weight=1), Share("heavy", weight=2)
    held = take(limiter, light)
    waiters = [line_up(limiter, share) for _ in range(60) for share in (light, heavy)]

    served = served_in_turn(held, waiters, Work(evaluated=400, generated=100))[:60]

    counts = Counter(w.share.key for w in served)
    assert counts["heavy"] == 2 * counts["light"], counts


async def test_a_key_whose_requests_cost_10_times_more_gets_a_tenth_of_the_grants() -> None:
    limiter = limiter_of(queue_max=200)
    heavy, light = Share("heavy"), Share("light")
    held = take(limiter, heavy)
    waiters = [line_up(limiter, share) for _ in range(60) for share in (heavy, light)]

    def work(slot: Slot) -> Work:
        owner = next(
            (w.share.key for w in waiters if w.granted.done() and w.granted.result() is slot), ""
        )
        return Work(evaluated=1000) if owner == "heavy" else Work(evaluated=80, cached=200)

    served = served_in_turn(held, waiters, work)[:55]

    counts = Counter(w.share.key for w in served)
    assert counts["light"] >= 8 * counts["heavy"], counts


async def test_a_batch_request_behind_a_stream_of_interactive_ones_is_served_at_the_bound() -> None:
    clock = Clock()
    limiter = limiter_of(clock=clock)
    limiter.set_fairness({}, starvation_bound=5.0)
    slot = take(limiter, CHAT)
    batch = line_up(limiter, BATCH)
    chat = line_up(limiter, CHAT)
    for _ in range(4):  # each second an interactive request is served, and another arrives
        clock.now += 1.0
        slot.release()
        assert chat.granted.done() and not batch.granted.done()
        slot, chat = chat.granted.result(), line_up(limiter, CHAT)

    clock.now += 1.0  # the batch request has waited 5 s: the bound
    slot.release()

    assert batch.granted.done() and not chat.granted.done()


async def test_headroom_keeps_a_slot_from_batch_for_an_interactive_request() -> None:
    limiter = limiter_of(parallel=2)
    limiter.set_fairness({Priority.INTERACTIVE: 1}, starvation_bound=30.0)
    running = take(limiter, BATCH)
    batch = line_up(limiter, BATCH)  # one slot is free, but it is the interactive class's

    assert not batch.granted.done()
    chat = limiter.place([PAIR], CHAT)
    assert isinstance(chat, Slot)  # at once, although a batch request waited before it
    chat.release()
    assert not batch.granted.done()
    running.release()
    assert batch.granted.done()


async def test_with_no_headroom_a_free_slot_never_idles_while_anyone_waits() -> None:
    limiter = limiter_of(parallel=2)
    limiter.set_fairness({}, starvation_bound=30.0)
    first, second = take(limiter, BATCH), take(limiter, BATCH)
    waiters = [line_up(limiter, BATCH), line_up(limiter, Share())]

    first.release()
    second.release()

    assert all(w.granted.done() for w in waiters)


async def test_a_waiter_watching_another_pair_is_still_handed_its_free_slot() -> None:
    limiter = limiter_of()
    limiter.configure("h2", "m", parallel=1, queue_max=0)
    held = take(limiter, BATCH)
    other = limiter.place([Pair("h2", "m")], CHAT)
    waiter = line_up(limiter, BATCH)
    limiter.watch(waiter, [Pair("h2", "m")])
    assert isinstance(other, Slot)

    other.release()
    waiter.settle()

    assert waiter.granted.done() and waiter.granted.result().host == "h2"
    held.release()
    await asyncio.sleep(0)
