"""Priced patience's estimates and its choice, from recorded figures, without a server."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from routing.core.patience import (
    DEFAULT_PATIENCE,
    Choice,
    Figures,
    Priced,
    Pricing,
    decide,
    line_wait,
    prefill,
)
from routing.core.prefixes import (
    BLOCK_CHARS,
    BLOCK_TOKENS,
    NO_PREFIX,
    Prefix,
    PrefixIndex,
    prefix_blocks,
)

MODEL = "llama3"
# 40 whole blocks of text and 8 characters more: with 4 characters a token, 2,562 tokens.
PROMPT = prefix_blocks({"messages": [{"role": "user", "content": "word " * 2048 + "abc"}]})
TOKENS = PROMPT.length // 4
BLOCK = BLOCK_CHARS // 4  # tokens a block holds


def figures(**hosts: tuple[float, float]) -> Figures:
    """Figures of hosts given as (service seconds, prompt tokens a second), for a model
    whose text holds 4 characters a token."""
    known = Figures()
    for name, (service, speed) in hosts.items():
        known.held(name, MODEL, service)
        known.prompted(name, MODEL, NO_PREFIX, 1000, 0, 1000 / speed * 1000)
    known.prompted("elsewhere", MODEL, PROMPT, TOKENS, TOKENS, None)  # 4 characters a token
    return known


def pricing(known: Figures, index: PrefixIndex | None = None, slots: int = 1) -> Pricing:
    return Pricing(known, index or PrefixIndex(10_000), MODEL, PROMPT, lambda host: slots)


# -- the plain estimates -------------------------------------------------------------------


def test_the_wait_in_line_is_the_place_times_the_service_time_over_the_slots():
    assert line_wait(1, 4.0, 1) == 4.0
    assert line_wait(3, 4.0, 2) == 6.0
    assert line_wait(0, 4.0, 2) == 0.0  # no longer in line
    assert line_wait(2, 4.0, 0) == 8.0  # a host counts at least one slot


def test_a_running_request_known_to_be_near_its_end_frees_its_slot_for_the_line_sooner():
    # Two slots held 4 s on average: one request has held its slot 3.5 s, the other 1 s.
    assert line_wait(1, 4.0, 2, [3.5, 1.0]) == 0.5
    assert line_wait(2, 4.0, 2, [3.5, 1.0]) == 3.0
    # The third place waits for the first slot to free twice: its end, then a whole service.
    assert line_wait(3, 4.0, 2, [3.5, 1.0]) == 4.5
    assert line_wait(1, 4.0, 2, [9.0, 1.0]) == 0.0  # past its mean: expected to end now


def test_a_busy_slot_whose_request_is_not_known_here_frees_as_if_evenly_spread():
    # One slot of two held by a request this process knows (1 s in), one by another process's.
    assert line_wait(1, 4.0, 2, [1.0]) == 2.0
    assert line_wait(2, 4.0, 2, [1.0]) == 3.0
    # Three slots, two of them another process's: theirs free after 1 s and 2 s of a 3 s service.
    assert [line_wait(p, 3.0, 3, [2.5]) for p in (1, 2, 3)] == [0.5, 1.0, 2.0]
    # More known than slots (parallel lowered): a slot frees as the last two of three end.
    assert line_wait(1, 4.0, 2, [3.9, 3.0, 1.0]) == 1.0


def test_a_prefill_evaluates_what_the_host_does_not_hold_at_its_speed():
    assert prefill(3000, 1000, 1000) == 2.0
    assert prefill(3000, 0, 500) == 6.0
    assert prefill(1000, 1200, 1000) == 0.0  # never negative


# -- the figures ---------------------------------------------------------------------------


def test_a_host_without_answers_has_no_figures():
    known = Figures()

    assert known.service("gpu1", MODEL) is None
    assert known.speed("gpu1") is None
    assert known.units_per_token(MODEL, BLOCK_CHARS) is None


def test_the_figures_are_an_answers_own_numbers_at_first():
    known = Figures()
    known.held("gpu1", MODEL, 3.0)
    known.prompted("gpu1", MODEL, PROMPT, 1000, 200, 400.0)  # 800 evaluated in 0.4 s

    assert known.service("gpu1", MODEL) == 3.0
    assert known.speed("gpu1") == 2000.0
    assert known.units_per_token(MODEL, BLOCK_CHARS) == PROMPT.length / 1000
    assert known.service("gpu1", "other model") is None
    assert known.units_per_token(MODEL, BLOCK_TOKENS) is None  # token ids are another unit


def test_recent_answers_weigh_more_than_old_ones():
    known = Figures()
    for _ in range(20):
        known.held("gpu1", MODEL, 1.0)
    for _ in range(5):
        known.held("gpu1", MODEL, 10.0)

    service = known.service("gpu1", MODEL)
    assert service is not None and 7.0 < service < 10.0  # past the mean of all, 2.8


def test_a_tiny_evaluation_weighs_little_in_a_hosts_speed():
    known = Figures()
    known.prompted("gpu1", MODEL, PROMPT, 2000, 0, 1000.0)  # 2,000 tokens a second
    # A cache hit evaluates one token, in time that is mostly overhead: 100 tokens a second.
    known.prompted("gpu1", MODEL, PROMPT, 2001, 2000, 10.0)

    speed = known.speed("gpu1")
    assert speed is not None and speed > 1900


def test_unknown_or_senseless_counts_teach_nothing():
    known = Figures()
    known.prompted("gpu1", MODEL, PROMPT, None, None, 100.0)
    known.prompted("gpu1", MODEL, PROMPT, 0, 0, 100.0)
    # A prompt the index cannot read (no units) may still tell a speed: not these.
    known.prompted("gpu1", MODEL, NO_PREFIX, 100, None, 100.0)
    known.prompted("gpu1", MODEL, NO_PREFIX, 100, 100, 100.0)  # nothing evaluated
    known.prompted("gpu1", MODEL, NO_PREFIX, 100, 0, 0.0)
    known.held("gpu1", MODEL, -1.0)

    assert known.speed("gpu1") is None
    assert known.service("gpu1", MODEL) is None
    assert known.units_per_token(MODEL, BLOCK_CHARS) is None


def test_the_smallest_answers_still_count():
    known = Figures()
    one_unit = Prefix((), 1, BLOCK_CHARS)  # a prompt of one character
    known.prompted("gpu1", MODEL, one_unit, 1, 0, 0.5)  # one token, in half a millisecond

    assert known.speed("gpu1") == 2000.0
    assert known.units_per_token(MODEL, BLOCK_CHARS) == 1.0
    assert Pricing(known, PrefixIndex(10), MODEL, one_unit, lambda host: 1).spill("gpu1") == 0.0005


def test_a_slot_held_no_time_at_all_is_a_figure_too():
    known = Figures()
    known.held("gpu1", MODEL, 0.0)

    assert known.service("gpu1", MODEL) == 0.0


def test_the_figures_keep_a_bounded_number_of_hosts_the_least_recently_fed_going_first():
    known = Figures(max_entries=2)
    for name in ("gpu1", "gpu2", "gpu1", "gpu3"):
        known.held(name, MODEL, 1.0)

    assert known.service("gpu2", MODEL) is None
    assert known.service("gpu1", MODEL) == 1.0
    assert known.service("gpu3", MODEL) == 1.0


def test_a_host_replaced_or_gone_is_forgotten_and_the_others_kept():
    known = Figures()
    for name in ("gpu1", "gpu2"):
        known.held(name, MODEL, 1.0)
        known.prompted(name, MODEL, PROMPT, 1000, 0, 1000.0)

    known.forget(["gpu1"])

    assert (known.service("gpu1", MODEL), known.speed("gpu1")) == (None, None)
    assert (known.service("gpu2", MODEL), known.speed("gpu2")) == (1.0, 1000.0)
    assert known.units_per_token(MODEL, BLOCK_CHARS) is not None  # the model's, not a host's


# -- the prices ----------------------------------------------------------------------------


def test_a_cold_start_is_the_whole_prompt_at_the_hosts_speed():
    prices = pricing(figures(gpu2=(1.0, 1280.0)))

    assert PROMPT.length % 4 == 0 and len(PROMPT.blocks) == 40
    assert prices.spill("gpu2") == pytest.approx(TOKENS / 1280)


def test_a_spill_costs_its_prefill_to_each_request_running_where_it_goes_too():
    running = {"gpu2": [0.5, 0.2]}  # two requests run on gpu2: the prefill delays them too
    prices = Pricing(figures(gpu2=(1.0, 1280.0)), PrefixIndex(10_000), MODEL, PROMPT,
                     lambda host: 3, running=lambda host: running.get(host, []))  # fmt: skip

    assert prices.spill("gpu2") == pytest.approx(3 * TOKENS / 1280)
    running["gpu2"] = []
    assert prices.spill("gpu2") == pytest.approx(TOKENS / 1280)


def test_staying_counts_the_homes_prefill_once_whoever_runs_there():
    index = PrefixIndex(10_000)
    index.learn("gpu1", MODEL, PROMPT.blocks[:30])
    prices = Pricing(figures(gpu1=(4.0, 1000.0)), index, MODEL, PROMPT, lambda host: 2,
                     running=lambda host: [3.0, 2.0])  # fmt: skip

    assert prices.stay("gpu1", 1) == pytest.approx(1.0 + (TOKENS - 30 * BLOCK) / 1000)


def test_a_host_that_holds_the_prompts_start_evaluates_only_the_rest():
    index = PrefixIndex(10_000)
    index.learn("gpu2", MODEL, PROMPT.blocks[:30])  # 30 of the 40 blocks
    prices = pricing(figures(gpu2=(1.0, 1280.0)), index)

    assert prices.spill("gpu2") == pytest.approx((TOKENS - 30 * BLOCK) / 1280)


def test_staying_is_the_wait_in_line_then_what_home_does_not_hold():
    index = PrefixIndex(10_000)
    index.learn("gpu1", MODEL, PROMPT.blocks)  # home holds it all: nothing left to evaluate
    prices = pricing(figures(gpu1=(4.0, 1000.0)), index, slots=2)

    assert prices.stay("gpu1", 3) == pytest.approx(6.0 + (TOKENS - 40 * BLOCK) / 1000)
    index.correct("gpu1", MODEL, PROMPT.blocks, 20)  # it lost half
    assert prices.stay("gpu1", 3) == pytest.approx(6.0 + (TOKENS - 20 * BLOCK) / 1000)


def test_staying_behind_requests_near_their_end_is_priced_by_what_they_have_left():
    index = PrefixIndex(10_000)
    index.learn("gpu1", MODEL, PROMPT.blocks)
    known = figures(gpu1=(4.0, 1000.0))
    held = {"gpu1": [3.0, 2.0]}
    prices = Pricing(known, index, MODEL, PROMPT, lambda host: 2, running=held.__getitem__)
    home = (TOKENS - 40 * BLOCK) / 1000

    assert prices.stay("gpu1", 1) == pytest.approx(1.0 + home)
    held["gpu1"] = [0.5, 0.0]  # the slot freed and two new requests began
    assert prices.stay("gpu1", 1) == pytest.approx(3.5 + home)


def test_a_line_whose_waits_ran_long_prices_its_waits_as_long_as_they_ran():
    index = PrefixIndex(10_000)
    index.learn("gpu1", MODEL, PROMPT.blocks)
    known = figures(gpu1=(4.0, 1000.0))
    prices = pricing(known, index, slots=2)
    home = (TOKENS - 40 * BLOCK) / 1000
    assert known.lateness("gpu1", MODEL) == 1.0  # no wait compared yet
    assert prices.line("gpu1", 3) == 6.0

    known.waited("gpu1", MODEL, priced=1.0, actual=2.5)
    known.waited("gpu1", MODEL, priced=3.0, actual=4.5)

    # Two waits priced 4 s in all took 7 s (the newer weighs more: 4.5 + 0.75 x 2.5 over 3.75).
    assert known.lateness("gpu1", MODEL) == pytest.approx(6.375 / 3.75)
    assert prices.stay("gpu1", 3) == pytest.approx(6.0 * 6.375 / 3.75 + home)
    assert prices.line("gpu1", 3) == 6.0  # what the next wait is compared with: uncorrected
    assert known.lateness("gpu2", MODEL) == known.lateness("gpu1", "other model") == 1.0


def test_the_correction_from_the_waits_that_followed_is_bounded_and_forgotten_with_its_host():
    known = Figures()
    known.waited("gpu1", MODEL, priced=0.1, actual=60.0)  # behind a stall
    known.waited("gpu2", MODEL, priced=10.0, actual=0.0)  # the slot freed at once
    known.waited("gpu3", MODEL, priced=0.0, actual=1.0)  # nothing to compare: no wait priced
    known.waited("gpu3", MODEL, priced=1.0, actual=-1.0)  # a clock gone backwards

    assert known.lateness("gpu1", MODEL) == 4.0
    assert known.lateness("gpu2", MODEL) == 0.5
    assert known.lateness("gpu3", MODEL) == 1.0
    known.forget(["gpu1"])
    assert known.lateness("gpu1", MODEL) == 1.0
    assert known.lateness("gpu2", MODEL) == 0.5


def test_no_measurements_no_price():
    index = PrefixIndex(10_000)
    prices = pricing(Figures(), index)

    assert prices.stay("gpu1", 1) is None
    assert prices.spill("gpu2") is None
    assert pricing(figures(gpu1=(1.0, 1000.0))).spill("gpu9") is None  # units, but no speed
    only_speed = Figures()
    only_speed.prompted("gpu1", MODEL, PROMPT, TOKENS, 0, 1000.0)
    assert pricing(only_speed).stay("gpu1", 1) is None  # no service time yet
    assert pricing(only_speed).spill("gpu1") is not None


def test_a_prompt_the_index_cannot_read_has_no_price():
    prices = Pricing(figures(gpu1=(1.0, 1000.0)), PrefixIndex(10), MODEL, NO_PREFIX, lambda h: 1)

    assert prices.spill("gpu1") is None
    assert prices.stay("gpu1", 1) is None


# -- the choice ----------------------------------------------------------------------------


def test_no_measurements_the_fixed_default_decides():
    assert decide(None, None, [], spent=False) == Priced(Choice.DEFAULT, None, None, False)
    assert decide(None, None, [], spent=True) == Priced(Choice.DEFAULT, None, None, True)
    # One price known: the default decides, and the row keeps the price it had.
    assert decide(5.0, None, [], spent=False) == Priced(Choice.DEFAULT, 5.0, None, False)
    assert decide(None, 0.1, [], spent=True) == Priced(Choice.DEFAULT, None, 0.1, True)
    assert DEFAULT_PATIENCE == 2.0


def test_home_wait_longer_than_cold_start_spills_at_once():
    assert decide(5.0, 0.8, [], spent=False) == Priced(Choice.SPILL, 5.0, 0.8, True)


def test_cold_start_longer_than_home_wait_stays_even_once_the_default_has_passed():
    assert decide(0.8, 5.0, [], spent=True) == Priced(Choice.STAY, 0.8, 5.0, False)
    assert not decide(1.0, 1.0, [], spent=True).takes  # a tie stays: the cache is warm there


def test_a_free_slot_is_left_to_a_free_host_priced_sooner():
    assert not decide(5.0, 2.0, [1.0], spent=False).takes
    assert decide(5.0, 1.0, [2.0, None], spent=False).takes
    assert decide(5.0, 1.0, [1.0], spent=False).takes  # as soon: the first one offered


def test_line_moves_re_decided():
    # A spill priced 3 s against a wait of two places of a host that serves in 2 s: staying
    # (4 s) loses; one place on (2 s), it wins.
    index = PrefixIndex(10_000)
    index.learn("gpu1", MODEL, PROMPT.blocks)
    prices = pricing(figures(gpu1=(2.0, 1000.0), gpu2=(1.0, 2560 / 3)), index)
    spill = prices.spill("gpu2")

    assert decide(prices.stay("gpu1", 2), spill, [], False).choice is Choice.SPILL
    assert decide(prices.stay("gpu1", 1), spill, [], False).choice is Choice.STAY


@given(
    stay=st.floats(0, 1e6, allow_nan=False),
    spill=st.floats(0, 1e6, allow_nan=False),
    rivals=st.lists(st.one_of(st.none(), st.floats(0, 1e6, allow_nan=False)), max_size=4),
    spent=st.booleans(),
)
def test_a_priced_choice_takes_a_slot_only_when_it_is_the_soonest_of_all(
    stay: float, spill: float, rivals: list[float | None], spent: bool
):
    priced = decide(stay, spill, rivals, spent)

    soonest = min([stay, *(rival for rival in rivals if rival is not None)])
    assert priced.takes == (spill < stay and spill <= soonest)
    assert priced.choice is (Choice.SPILL if priced.takes else Choice.STAY)
    assert (priced.stay, priced.spill) == (stay, spill)


def test_a_spill_to_a_host_whose_own_conversations_will_want_its_free_slot_costs_them_a_service():
    """Its slot is held a whole service while the conversations leased there come back: with
    as many of them between turns as it has free slots, one finds none (the cascade's cause);
    with fewer, the share of the free slots they may need; with none, nothing."""
    known = figures(gpu2=(4.0, 1000.0))
    owners = {"gpu2": 0}
    free = {"gpu2": 2}
    prices = Pricing(known, PrefixIndex(10_000), MODEL, PROMPT, lambda host: 2,
                     owners=owners.__getitem__, free=free.__getitem__)  # fmt: skip
    cold = TOKENS / 1000

    assert prices.spill("gpu2") == pytest.approx(cold)
    owners["gpu2"] = 1
    assert prices.spill("gpu2") == pytest.approx(cold + 4.0 / 2)
    owners["gpu2"] = 3  # more of them than free slots: one waits up to a whole service
    assert prices.spill("gpu2") == pytest.approx(cold + 4.0)
    free["gpu2"] = 0  # a host reported with no free slot counts one (the one being priced)
    assert prices.displaced("gpu2") == pytest.approx(4.0)


def test_a_host_not_yet_timed_costs_its_own_conversations_nothing_in_a_spills_price():
    known = figures()
    known.prompted("gpu2", MODEL, NO_PREFIX, 1000, 0, 1000.0)  # a speed, no service yet
    prices = Pricing(known, PrefixIndex(10_000), MODEL, PROMPT, lambda host: 2,
                     owners=lambda host: 5, free=lambda host: 1)  # fmt: skip

    assert prices.displaced("gpu2") == 0.0
    assert prices.spill("gpu2") == pytest.approx(TOKENS / 1000)
