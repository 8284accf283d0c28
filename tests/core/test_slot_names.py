"""The slots named on each host (`SlotNames`): which slot a request is told, when none, and
what the answers that named a slot say of their host. Plain values: no server, no fleet."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from routing.core.leases import LeaseKey
from routing.core.patience import Figures
from routing.core.prefixes import Prefix, PrefixIndex
from routing.core.slot_names import SlotNames

MINE = Prefix((11, 12, 13, 21, 22), 20, 4)
THEIRS = Prefix((11, 12, 13, 31), 16, 4)
ME = LeaseKey("chat", "fp-mine", "m")
THEM = LeaseKey("chat", "fp-theirs", "m")


@dataclass
class _Hold:
    held: ClassVar[Literal[True]] = True
    host: str = "gpu1"
    model: str = "m"
    released: bool = False

    def release(self) -> None:
        self.released = True


def names(similarity: float = 0.1) -> SlotNames:
    return SlotNames(Figures(), PrefixIndex(1000), similarity)


def test_a_free_slot_is_named_for_the_conversation_that_keeps_its_number():
    book, described = names(), object()
    named = book.name(0, ME, _Hold(), MINE, 2, described, in_flight=1)
    assert named is not None
    assert (named.number, named.key, named.told, named.filled) == (0, ME, True, False)


def test_a_slot_another_request_runs_in_is_not_named_again_without_the_figures_to_price_it():
    book, described = names(), object()
    first = _Hold()
    assert book.name(0, ME, first, MINE, 2, described, in_flight=1) is not None
    assert book.name(0, ME, _Hold(), MINE, 2, described, in_flight=2) is None
    first.release()
    assert book.name(0, ME, _Hold(), MINE, 2, described, in_flight=1) is not None


def test_a_free_slot_is_not_named_while_a_request_runs_where_the_host_chose():
    book, described = names(), object()
    # Two running, this one included, and none of the others named here.
    assert book.name(1, ME, _Hold(), MINE, 2, described, in_flight=2) is None
    # The other one named here: its slot is known, so this one's is free.
    other = book.name(0, THEM, _Hold(), THEIRS, 2, described, in_flight=1)
    assert other is not None
    assert book.name(1, ME, _Hold(), MINE, 2, described, in_flight=2) is not None


def test_an_answer_that_ended_in_a_slot_makes_the_next_turn_there_find_it_filled():
    book, described = names(), object()
    first = book.name(0, ME, (hold := _Hold()), MINE, 2, described, in_flight=1)
    assert first is not None
    book.answered(first, 20, 0, None, None, cache_lost=False)
    hold.release()
    second = book.name(0, ME, (hold := _Hold()), MINE, 2, described, in_flight=1)
    assert second is not None and second.filled and second.took is None
    hold.release()
    # Read anew (another description), the host's slots are as good as empty.
    third = book.name(0, ME, _Hold(), MINE, 2, object(), in_flight=1)
    assert third is not None and not third.filled


def test_a_slot_found_emptied_twice_stops_the_naming_until_the_host_is_read_anew():
    book, described = names(), object()
    # The first turn only foresees its empty slot (the host would choose it); the second
    # names a slot that held nothing known; the third and fourth find theirs emptied.
    for _ in range(4):
        assert not book.emptying("gpu1", "m", described)
        named = book.name(0, ME, (hold := _Hold()), MINE, 1, described, in_flight=1)
        assert named is not None
        book.answered(named, 20, 0, None, None, cache_lost=False)
        hold.release()
    assert book.emptying("gpu1", "m", described)
    assert not book.emptying("gpu1", "m", object())


def test_an_answer_that_found_only_another_conversations_opening_is_counted_for_its_host():
    book, described = names(), object()
    theirs = book.name(0, THEM, (hold := _Hold()), THEIRS, 1, described, in_flight=1)
    assert theirs is not None
    book.answered(theirs, 16, 3, None, None, cache_lost=False)
    hold.release()
    mine = book.name(0, ME, _Hold(), MINE, 1, described, in_flight=1)
    assert mine is not None and mine.took == THEIRS
    book.answered(mine, 20, 3, predicted=5, reported=3, cache_lost=False)
    assert book.shared_lost("gpu1", "m", described) == 0  # not a lost cache by the rows' rule
    book.answered(mine, 20, 3, predicted=5, reported=3, cache_lost=True)
    assert book.shared_lost("gpu1", "m", described) == 1
    assert book.shared_lost("gpu2", "m", described) == 0
    assert book.shared_lost("gpu1", "m", object()) == 0  # the host read anew: a restart


def test_an_empty_slot_the_host_would_choose_itself_is_named_as_foreseen_only():
    book, described = names(similarity=0.95), object()
    theirs = book.name(0, THEM, (hold := _Hold()), THEIRS, 2, described, in_flight=1)
    assert theirs is not None
    book.answered(theirs, 16, 3, None, None, cache_lost=False)
    hold.release()
    # Slot 1 is empty, slot 0 holds a prompt sharing less than 0.95 of this one's.
    mine = book.name(1, ME, _Hold(), MINE, 2, described, in_flight=1)
    assert mine is not None and not mine.told
    at_default = names(similarity=0.1)
    theirs = at_default.name(0, THEM, (hold := _Hold()), THEIRS, 2, described, in_flight=1)
    assert theirs is not None
    at_default.answered(theirs, 16, 3, None, None, cache_lost=False)
    hold.release()
    mine = at_default.name(1, ME, _Hold(), MINE, 2, described, in_flight=1)
    assert mine is not None and mine.told
