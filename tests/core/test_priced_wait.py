"""Priced patience over one wait (`PricedWait`): which free slot elsewhere takes a request
waiting in its home's line, and the choice its row keeps. Plain values: a request at place 1
of gpu1's line (one slot, 1 s a service, 1,000 tokens a second, the whole prompt held), gpu2
and gpu3 holding none of it."""

from __future__ import annotations

from dataclasses import dataclass, field

from routing.core.patience import Choice, Figures, Pricing
from routing.core.prefixes import NO_PREFIX, PrefixIndex, prefix_blocks
from routing.core.priced_wait import PricedWait

MODEL = "m"
PROMPT = prefix_blocks({"messages": [{"role": "user", "content": "word " * 2048 + "abc"}]})
TOKENS = PROMPT.length // 4


@dataclass
class _InLine:
    host: str = "gpu1"
    position: int = 1


@dataclass
class _Fleet:
    """The hosts with a free slot now, for `free_elsewhere`."""

    free: list[str] = field(default_factory=list)

    def elsewhere(self, *besides: str) -> list[str]:
        return [host for host in self.free if host not in besides]


def figures() -> tuple[Figures, PrefixIndex]:
    known, index = Figures(), PrefixIndex(10_000)
    index.learn("gpu1", MODEL, PROMPT.blocks)
    known.prompted("gpu1", MODEL, PROMPT, TOKENS, TOKENS - 1, 1.0)  # 4 characters a token
    speed(known, "gpu1", 1000.0)
    known.held("gpu1", MODEL, 1.0)
    return known, index


def speed(known: Figures, host: str, tokens_per_second: float) -> None:
    known.prompted(host, MODEL, NO_PREFIX, 1000, 0, 1e6 / tokens_per_second)


def waiting(known: Figures, index: PrefixIndex, fleet: _Fleet) -> PricedWait:
    pricing = Pricing(known, index, MODEL, PROMPT, lambda host: 1)
    return PricedWait(pricing, _InLine(), MODEL, fleet.elsewhere)


def test_a_free_slot_priced_sooner_than_the_line_takes_the_request_and_the_row_says_spill():
    known, index = figures()
    speed(known, "gpu2", TOKENS / 0.5)  # a cold start of 0.5 s against a 1 s line
    wait = waiting(known, index, _Fleet(["gpu2"]))
    assert wait.takes("gpu2")
    choice = wait.choice("gpu2")
    assert choice is not None and choice.choice is Choice.SPILL


def test_a_free_slot_priced_later_than_the_line_is_turned_down_and_the_row_says_so():
    known, index = figures()
    speed(known, "gpu2", TOKENS / 3.0)
    wait = waiting(known, index, _Fleet(["gpu2"]))
    assert not wait.takes("gpu2")
    stayed = wait.choice("gpu1")  # served at home: the choice it made about gpu2's slot
    assert stayed is not None and stayed.choice is Choice.STAY and stayed.spill is not None


def test_a_slot_left_to_a_host_priced_sooner_still_is_turned_down():
    known, index = figures()
    speed(known, "gpu2", TOKENS / 0.5)
    speed(known, "gpu3", TOKENS / 0.25)
    wait = waiting(known, index, _Fleet(["gpu2", "gpu3"]))
    assert not wait.takes("gpu2")
    assert wait.takes("gpu3")


def test_a_slot_without_figures_waits_for_the_fixed_default_then_takes_the_request():
    known, index = figures()
    wait = waiting(known, index, _Fleet(["gpu2"]))
    assert not wait.takes("gpu2")
    wait.spend()
    assert wait.takes("gpu2")
    choice = wait.choice("gpu2")
    assert choice is not None and choice.choice is Choice.DEFAULT


def test_its_own_homes_slot_always_takes_it():
    wait = PricedWait(None, _InLine(), MODEL, _Fleet().elsewhere)
    assert wait.takes("gpu1")


def test_a_repricing_with_no_free_slot_elsewhere_keeps_staying_as_the_rows_choice():
    known, index = figures()
    fleet = _Fleet()
    wait = waiting(known, index, fleet)
    wait.reprice()
    stayed = wait.choice("gpu1")
    assert stayed is not None and stayed.choice is Choice.STAY and stayed.spill is None
    speed(known, "gpu2", TOKENS / 0.5)
    fleet.free.append("gpu2")
    wait.reprice()
    priced = wait.choice("gpu1")
    assert priced is not None and priced.choice is Choice.SPILL and priced.spill is not None


def test_a_wait_at_home_longer_than_priced_makes_the_lines_next_waits_priced_longer():
    known, index = figures()
    wait = waiting(known, index, _Fleet())
    wait.begin(now=10.0)
    wait.waited(now=12.0)  # priced 1 s, waited 2 s
    assert known.lateness("gpu1", MODEL) == 2.0
    untouched = waiting(known, index, _Fleet())
    untouched.waited(now=99.0)  # never began: nothing to compare
    assert known.lateness("gpu1", MODEL) == 2.0


@dataclass
class _Counted(_Fleet):
    """`_Fleet`, counting how often the free hosts are asked for."""

    asked: int = 0

    def elsewhere(self, *besides: str) -> list[str]:
        self.asked += 1
        return super().elsewhere(*besides)


def test_slots_offered_in_one_repricing_get_the_choices_they_get_one_at_a_time():
    known, index = figures()
    speed(known, "gpu2", TOKENS / 0.5)
    speed(known, "gpu3", TOKENS / 0.25)
    wait = waiting(known, index, _Fleet(["gpu2", "gpu3"]))
    with wait.repriced():
        assert not wait.takes("gpu2")  # left to gpu3, priced sooner
        assert wait.takes("gpu3")
    turned_down, taken = wait.choice("gpu2"), wait.choice("gpu3")
    assert turned_down is not None and turned_down.choice is Choice.STAY
    assert taken is not None and taken.choice is Choice.SPILL


def test_slots_offered_in_one_repricing_ask_for_the_free_hosts_at_most_once():
    known, index = figures()
    for host, seconds in (("gpu2", 0.5), ("gpu3", 0.4), ("gpu4", 0.25)):
        speed(known, host, TOKENS / seconds)
    fleet = _Counted(["gpu2", "gpu3", "gpu4"])
    wait = waiting(known, index, fleet)
    with wait.repriced():
        asked = fleet.asked  # the repricing's own choice for the row
        assert [wait.takes(host) for host in ("gpu2", "gpu3", "gpu4")] == [False, False, True]
    assert fleet.asked == asked + 1


def test_a_slot_priced_later_than_the_line_is_turned_down_without_asking_for_its_rivals():
    known, index = figures()
    speed(known, "gpu2", TOKENS / 3.0)
    speed(known, "gpu3", TOKENS / 0.25)
    fleet = _Counted(["gpu2", "gpu3"])
    wait = waiting(known, index, fleet)
    assert not wait.takes("gpu2")
    assert fleet.asked == 0


def test_a_repricing_prices_its_offers_as_the_first_is_made_not_as_it_begins():
    known, index = figures()
    speed(known, "gpu2", TOKENS / 0.5)
    fleet = _Fleet(["gpu2"])
    wait = waiting(known, index, fleet)
    with wait.repriced():
        speed(known, "gpu3", TOKENS / 0.25)  # freed (or learnt) after the repricing began
        fleet.free.append("gpu3")
        assert not wait.takes("gpu2")


def test_a_host_whose_figures_come_after_a_repricing_began_is_priced_with_them():
    known, index = figures()
    fleet = _Fleet(["gpu2"])
    wait = waiting(known, index, fleet)
    with wait.repriced():
        speed(known, "gpu2", TOKENS / 0.5)  # its first answer, between repricing and offer
        assert wait.takes("gpu2")


def test_a_slot_offered_after_a_repricing_is_priced_as_the_fleet_is_then():
    known, index = figures()
    speed(known, "gpu2", TOKENS / 0.5)
    speed(known, "gpu3", TOKENS / 0.25)
    fleet = _Fleet(["gpu2", "gpu3"])
    wait = waiting(known, index, fleet)
    with wait.repriced():
        assert not wait.takes("gpu2")
    fleet.free.remove("gpu3")  # gpu3's slot was taken since
    assert wait.takes("gpu2")


def test_a_slot_offered_in_a_repricing_on_a_host_not_listed_free_is_priced_on_its_own():
    known, index = figures()
    speed(known, "gpu2", TOKENS / 3.0)
    speed(known, "gpu3", TOKENS / 0.5)
    wait = waiting(known, index, _Fleet(["gpu2"]))  # gpu3: a line, so not listed free
    with wait.repriced():
        assert not wait.takes("gpu2")
        assert wait.takes("gpu3")
    taken = wait.choice("gpu3")
    assert taken is not None and taken.choice is Choice.SPILL
