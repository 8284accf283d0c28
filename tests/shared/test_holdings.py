"""Holdings, a process's book of its shared slots, alone: no Redis, no round trip."""

from __future__ import annotations

import asyncio
import time

import pytest

from routing.shared.grants import Queued, Wait
from routing.shared.holdings import Holdings
from routing.shared.state import StateUnavailable


def test_a_grant_is_counted_on_its_pair_until_its_release_and_a_second_release_is_a_no_op() -> None:
    changed: list[str] = []
    book = Holdings("p", changed.append)
    grant = book.hold(book.new_id(), "h1/m", 0.0)

    assert (book.held(), book.held_on("h1", "m"), book.held_pairs()) == (1, 1, [("h1", "m")])
    assert book.unhold(grant) is True
    assert book.unhold(grant) is False
    assert (book.held(), book.held_on("h1", "m"), book.held_pairs()) == (0, 0, [])
    assert changed == ["h1", "h1"]


def test_a_renamed_hosts_grants_count_under_its_new_name_and_release_from_there() -> None:
    book = Holdings("p")
    grant = book.hold("p.1", "old/m", 0.0)
    book.hold("p.2", "new/m", 0.0)

    book.rename("old", "new")

    assert book.held_on("new", "m") == 2 and book.held_on("old", "m") == 0
    assert book.counted_pair(grant) == "new/m"
    book.unhold(grant)
    assert book.held_on("new", "m") == 1


def test_a_host_given_a_renamed_hosts_old_name_later_counts_its_own_grants() -> None:
    # The session's gateway in the shared suite renamed gpu1 to box1 in one test; every later
    # test's gpu1 then counted its grants under box1 and released them there, so gpu1's slots
    # stayed held in Redis for good (a 300 s queue timeout, then every request after it).
    book = Holdings("p")
    moved = book.hold("p.1", "gpu1/m", 0.0)
    book.rename("gpu1", "box1")
    book.unhold(moved)

    fresh = book.hold("p.2", "gpu1/m", 0.0)

    assert book.held_on("gpu1", "m") == 1 and book.held_on("box1", "m") == 0
    assert book.counted_pair(fresh) == "gpu1/m"
    book.unhold(fresh)
    assert book.held_on("gpu1", "m") == 0


async def test_a_lost_grants_holder_hears_once_and_its_release_counts_nothing() -> None:
    book = Holdings("p")
    grant = book.hold("p.1", "h1/m", 0.0)
    heard: list[str] = []
    book.on_lost(grant, lambda: heard.append("lost"))

    book.lose(grant)
    await asyncio.sleep(0)  # the callback runs soon, not inside `lose`

    assert heard == ["lost"] and book.held_on("h1", "m") == 0
    assert book.unhold(grant) is False
    later: list[str] = []
    book.on_lost(grant, lambda: later.append("lost"))  # lost already, and released: never
    await asyncio.sleep(0)
    assert later == []


async def test_a_grants_message_lands_on_its_wait_once_and_is_ignored_once_the_wait_is_gone() -> (
    None
):
    book = Holdings("p")
    loop = asyncio.get_running_loop()
    wait = Wait(book.new_id(), ["h1/m"], loop.create_future(), time.monotonic())
    book.add_wait(wait)

    book.grant_reached(wait.id, "h1/m")
    book.grant_reached(wait.id, "h1/m")  # a second message changes nothing

    assert wait.future.result().host == "h1" and book.held() == 1
    book.drop_wait(wait.id)
    book.grant_reached(wait.id, "h2/m")  # cancelled here: the cancel script returns it
    assert book.held() == 1


async def test_failing_the_waits_fails_the_places_in_line_but_not_a_place_being_made() -> None:
    book = Holdings("p")
    loop = asyncio.get_running_loop()
    queued = Wait("p.1", ["h1/m"], loop.create_future(), 0.0, Queued("p.1", "h1", "m", 1))
    making = Wait("p.2", ["h1/m"], loop.create_future(), 0.0)
    book.add_wait(queued)
    book.add_wait(making)

    book.fail_waits("Redis is away")

    with pytest.raises(StateUnavailable, match="Redis is away"):
        queued.future.result()
    assert not making.future.done()
    assert book.pending() == [making]


def test_a_call_of_unknown_outcome_asks_for_one_reconcile() -> None:
    book = Holdings("p")
    assert book.take_unsure() is False
    book.unsure()
    assert (book.take_unsure(), book.take_unsure()) == (True, False)
