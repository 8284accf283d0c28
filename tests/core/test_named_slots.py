"""Whether a request waits for its busy slot (`waits_for_its_slot`), and what two prompts'
chains share (`common_blocks`): plain functions of the figures, priced in seconds."""

from __future__ import annotations

from routing.core.named_slots import common_blocks, waits_for_its_slot


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
