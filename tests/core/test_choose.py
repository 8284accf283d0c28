"""The chooser: a route's hosts for one request, best first."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from routing.core.choose import Candidate, ranked


def candidate(host: str, **changes: Any) -> Candidate:
    """A healthy host with the model loaded, two free slots, weight 1 and no leases, unless
    changed."""
    base = Candidate(
        host=host,
        healthy=True,
        draining=False,
        loaded=True,
        can_serve=True,
        free=2,
        queued=0,
        weight=1.0,
    )
    return replace(base, **changes)


def test_host_with_the_model_loaded_wins_over_one_that_only_lists_it() -> None:
    listed = candidate("listed", loaded=False, free=8, weight=4.0)
    loaded = candidate("loaded", free=0)

    assert ranked([listed, loaded]) == ["loaded", "listed"]


def test_host_that_only_lists_the_model_is_ranked_when_none_has_it_loaded() -> None:
    hosts = [
        candidate("a", loaded=False, free=1),
        candidate("b", loaded=False, free=3),
        candidate("c", loaded=False, can_serve=False, free=9),
    ]

    assert ranked(hosts) == ["b", "a"]


def test_a_host_that_would_refuse_a_model_it_has_not_loaded_is_never_ranked() -> None:
    refuses = candidate("refuses", loaded=False, answers=False, free=8, weight=4.0)
    loads = candidate("loads", loaded=False, free=1)
    full = candidate("full", free=0)

    assert ranked([refuses, loads, full]) == ["full", "loads"]
    assert ranked([refuses]) == []


def test_most_free_slots_times_weight_comes_first() -> None:
    hosts = [
        candidate("many-slots", free=4, weight=1.0),
        candidate("heavy", free=3, weight=2.0),
        candidate("light", free=7, weight=0.5),
    ]

    assert ranked(hosts) == ["heavy", "many-slots", "light"]


def test_equal_scores_go_to_the_host_holding_fewer_leases_before_the_shorter_queue() -> None:
    hosts = [
        candidate("busy-cache", leases=5, queued=0),
        candidate("fresh", leases=1, queued=3),
        candidate("middle", leases=2, queued=0),
    ]

    assert ranked(hosts) == ["fresh", "middle", "busy-cache"]


def test_equal_scores_and_leases_go_to_the_shortest_queue() -> None:
    hosts = [
        candidate("a", free=0, queued=3),
        candidate("b", free=0, queued=1),
        candidate("c", free=0, queued=2),
    ]

    assert ranked(hosts) == ["b", "c", "a"]


def test_free_slots_count_before_leases() -> None:
    hosts = [candidate("few-leases", free=1, leases=0), candidate("roomy", free=3, leases=9)]

    assert ranked(hosts) == ["roomy", "few-leases"]


def test_a_host_with_room_for_another_conversation_comes_before_a_crowded_one() -> None:
    # "crowded" holds as many conversations as it has slots: a new one there would overwrite
    # one of theirs, so more free slots do not put it first; among crowded hosts they do.
    hosts = [
        candidate("crowded", free=2, leases=2, crowded=True),
        candidate("room", free=1, leases=1),
        candidate("crowded-busier", free=1, leases=2, crowded=True),
    ]

    assert ranked(hosts) == ["room", "crowded", "crowded-busier"]


def test_equal_everything_keeps_route_order() -> None:
    hosts = [candidate("first"), candidate("second"), candidate("third")]

    assert ranked(hosts) == ["first", "second", "third"]
    assert ranked(list(reversed(hosts))) == ["third", "second", "first"]


def test_full_host_is_still_ranked() -> None:
    assert ranked([candidate("full", free=0, queued=4)]) == ["full"]


def test_draining_and_unhealthy_hosts_are_never_ranked() -> None:
    hosts = [
        candidate("draining", draining=True, free=9),
        candidate("down", healthy=False, free=9),
        candidate("busy", free=0, queued=2),
    ]

    assert ranked(hosts) == ["busy"]


def test_draining_loaded_host_does_not_hide_a_host_that_lists_the_model() -> None:
    hosts = [candidate("draining", draining=True), candidate("listed", loaded=False)]

    assert ranked(hosts) == ["listed"]


def test_nothing_is_ranked_when_no_host_is_eligible() -> None:
    hosts = [
        candidate("draining", draining=True),
        candidate("down", healthy=False),
        candidate("unrelated", loaded=False, can_serve=False),
    ]

    assert ranked(hosts) == []
    assert ranked([]) == []
