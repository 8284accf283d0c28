"""Whether a request waits for its busy slot (`waits_for_its_slot`), what two prompts' chains
share (`common_blocks`), whether an answer says its host took a slot as another
conversation had left it (`kept_only_shared`), and whether a request for an empty slot is left
to llama-server (`chooses_the_empty_slot`): plain functions of the figures."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from routing.core.leases import LeaseKey
from routing.core.named_slots import (
    NamedSlot,
    chooses_the_empty_slot,
    common_blocks,
    kept_only_shared,
    waits_for_its_slot,
)
from routing.core.prefixes import Prefix

# Two conversations' prompts in blocks of 4: a shared opening of 3 blocks, then their own.
OPENING = (11, 12, 13)
MINE = Prefix((*OPENING, 21, 22, 23, 24), 30, 4)
THEIRS = Prefix((*OPENING, 31, 32), 22, 4)


@dataclass
class _Hold:
    held: ClassVar[Literal[True]] = True
    host: str = "gpu1"
    model: str = "m"
    released: bool = False

    def release(self) -> None:
        self.released = True


def named(took: Prefix | None) -> NamedSlot:
    """Slot 0 named for a request with the prompt MINE, which finds `took` there."""
    key = LeaseKey("chat", "fp-mine", "m")
    return NamedSlot(0, key, _Hold(), object(), True, MINE, took=took)


def test_a_request_waits_for_its_slot_when_the_wait_and_its_new_part_come_sooner():
    # 0.3 s left in the slot and 0.1 s of new turn, against 0.5 s of prompt elsewhere.
    assert waits_for_its_slot(remaining=0.3, at_home=0.1, elsewhere=0.5)


def test_a_request_leaves_its_busy_slot_when_reading_elsewhere_comes_sooner():
    assert not waits_for_its_slot(remaining=0.5, at_home=0.1, elsewhere=0.5)


def test_equal_prices_leave_the_request_to_the_host_which_keeps_its_slots_working():
    assert not waits_for_its_slot(remaining=0.4, at_home=0.1, elsewhere=0.5)


def test_two_chains_share_their_blocks_up_to_the_first_that_differs():
    assert common_blocks((1, 2, 3, 4), (1, 2, 9, 4)) == 2
    assert common_blocks((1, 2, 3), (7, 2, 3)) == 0


def test_a_chain_that_ends_first_shares_all_its_blocks():
    assert common_blocks((1, 2), (1, 2, 3)) == 2
    assert common_blocks((1, 2, 3), ()) == 0


def test_an_answer_with_only_the_opening_another_conversation_left_says_the_slot_was_taken_as_is():
    # The index expected 6 of its 7 blocks (its own history); the host gave the 3 shared.
    assert kept_only_shared(named(THEIRS), predicted=6, reported=3)
    assert kept_only_shared(named(THEIRS), predicted=6, reported=4)  # a block of the edges


def test_an_answer_that_found_its_own_history_in_the_taken_slot_says_nothing():
    # The host loaded it back from --cache-ram (llama-server at -sps 0.95).
    assert not kept_only_shared(named(THEIRS), predicted=6, reported=6)
    assert not kept_only_shared(named(THEIRS), predicted=6, reported=5)


def test_a_conversation_expected_to_find_no_more_than_the_opening_says_nothing():
    # A new conversation's first turn in another's slot finds the opening, as it should.
    assert not kept_only_shared(named(THEIRS), predicted=4, reported=3)
    assert not kept_only_shared(named(THEIRS), predicted=None, reported=3)


def test_a_slot_of_its_own_or_an_answer_without_counts_says_nothing():
    assert not kept_only_shared(named(None), predicted=6, reported=3)
    assert not kept_only_shared(named(THEIRS), predicted=6, reported=None)


# MINE is 30 units long; THEIRS shares 3 blocks of 4 with it, counted as 4 blocks (a block's
# hash covers only its whole units): 16 of 30, 0.53 of MINE.
def test_a_request_for_an_empty_slot_is_left_to_a_host_that_would_not_take_another_slot_for_it():
    assert chooses_the_empty_slot(MINE, [THEIRS], similarity=0.95)


def test_a_request_for_an_empty_slot_names_it_where_the_host_would_take_a_slot_sharing_more():
    # At llama-server's default 0.1, the shared opening is enough to take THEIRS's slot.
    assert not chooses_the_empty_slot(MINE, [THEIRS], similarity=0.1)
    assert not chooses_the_empty_slot(MINE, [THEIRS], similarity=0.5)  # 16 / 30 is above


def test_a_slot_sharing_nothing_but_a_block_leaves_the_request_to_the_host_at_the_default():
    alone = Prefix((99, 98), 8, 4)  # nothing in common: one block's 4 units, 0.13 of MINE
    assert chooses_the_empty_slot(MINE, [alone], similarity=0.14)
    assert not chooses_the_empty_slot(MINE, [alone], similarity=0.1)


def test_with_no_other_idle_slot_a_request_for_an_empty_one_is_left_to_the_host():
    assert chooses_the_empty_slot(MINE, [], similarity=0.1)


def test_a_slot_counted_in_other_units_or_an_empty_prompt_keeps_the_slot_named():
    tokens = Prefix((1, 2), 64, 16)  # token ids, not characters: how much it holds is unknown
    assert not chooses_the_empty_slot(MINE, [tokens], similarity=0.95)
    assert not chooses_the_empty_slot(Prefix((), 0, 4), [], similarity=0.95)
