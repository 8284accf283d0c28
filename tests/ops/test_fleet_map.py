"""The fleet map's rows, from what the model actor saw and decided (routing/ops/fleet_map.py)."""

from __future__ import annotations

from routing.core.model_placement import Status
from routing.models_actor.decisions import Decided
from routing.models_actor.fleet_view import Seen
from routing.ops.fleet_map import BY_HAND, decision_log, fleet_map

T = 1_800_000_000.0  # wall-clock seconds


def decided(*entries: Decided) -> dict[tuple[str, str, str], Decided]:
    return {(d.kind, d.host, d.model): d for d in entries}


def test_a_model_crossbar_loaded_shows_its_host_since_when_idle_since_and_the_loads_reason():
    load = Decided(T, "load", "gpu1", "a", "demand: 1 waiting, loaded nowhere; load ~3 s")
    loaded = Decided(T + 3, "loaded", "gpu1", "a", "load took 3.0 s")
    seen = {("gpu1", "a"): Seen(Status.LOADED, T + 3, T + 40)}

    [row] = fleet_map(seen, decided(load, loaded), busy=())

    assert row.model == "a"
    [placed] = row.hosts
    assert placed.as_json() == {
        "host": "gpu1", "status": "loaded", "since": "2027-01-15T08:00:03+00:00",
        "idle_since": "2027-01-15T08:00:40+00:00", "why": "demand",
        "reason": "demand: 1 waiting, loaded nowhere; load ~3 s",
    }  # fmt: skip
    assert row.unplaced is None


def test_a_model_busy_on_its_host_is_not_idle():
    seen = {("gpu1", "a"): Seen(Status.LOADED, T, T + 5)}

    [row] = fleet_map(seen, {}, busy={("gpu1", "a")})

    assert row.hosts[0].idle_since is None


def test_a_load_under_way_shows_loading_with_its_reason_and_no_idle_time():
    load = Decided(T, "load", "gpu2", "b", "pinned")
    seen = {("gpu2", "b"): Seen(Status.LOADING, T + 0.01, T + 0.01)}

    [row] = fleet_map(seen, decided(load), busy=())

    [placed] = row.hosts
    assert (placed.status, placed.why, placed.idle_since) == ("loading", "pinned", None)


def test_a_model_crossbar_did_not_load_is_there_by_hand_or_found_loaded():
    seen = {("gpu1", "a"): Seen(Status.LOADED, T, T)}

    [row] = fleet_map(seen, {}, busy=())

    assert (row.hosts[0].why, row.hosts[0].reason) == (BY_HAND, "")


def test_a_model_loaded_again_by_hand_after_crossbars_copy_went_is_there_by_hand():
    load = Decided(T, "load", "gpu1", "a", "min_loaded 1")
    loaded = Decided(T + 2, "loaded", "gpu1", "a", "load took 2.0 s")
    seen = {("gpu1", "a"): Seen(Status.LOADED, T + 600, T + 600)}

    [row] = fleet_map(seen, decided(load, loaded), busy=())

    assert row.hosts[0].why == BY_HAND


def test_a_load_that_ended_before_the_last_load_began_gives_no_reason():
    """A second load under way has no `loaded` yet: the first one's says nothing of it."""
    loaded = Decided(T, "loaded", "gpu1", "a", "load took 2.0 s")
    load = Decided(T + 0.5, "load", "gpu1", "a", "demand: 2 waiting")
    seen = {("gpu1", "a"): Seen(Status.LOADED, T, T)}

    [row] = fleet_map(seen, decided(load, loaded), busy=())

    assert row.hosts[0].why == BY_HAND


def test_a_model_loaded_nowhere_has_no_hosts_and_says_why_no_load_placed_it():
    unplaced = Decided(T, "unplaced", "", "big", "gpu1: no room (models_max 1, 1 busy)")
    seen = {
        ("gpu1", "big"): Seen(Status.UNLOADED, T, T),
        ("gpu1", "a"): Seen(Status.LOADED, T, T),
        ("gpu2", "big"): Seen(Status.FAILED, T, T),
    }

    rows = fleet_map(seen, decided(unplaced), busy=())

    assert [row.model for row in rows] == ["a", "big"]
    big = rows[1].as_json()
    assert big["hosts"] == []
    assert big["unplaced"] == "gpu1: no room (models_max 1, 1 busy)"
    assert big["unplaced_at"] == "2027-01-15T08:00:00+00:00"


def test_a_model_on_two_hosts_lists_both_by_name():
    seen = {
        ("gpu2", "a"): Seen(Status.LOADED, T, T),
        ("gpu1", "a"): Seen(Status.LOADING, T, T),
    }

    [row] = fleet_map(seen, {}, busy=())

    assert [(p.host, p.status) for p in row.hosts] == [("gpu1", "loading"), ("gpu2", "loaded")]


def test_the_decision_log_gives_the_last_decisions_newest_first():
    recent = [Decided(T + n, "load", "gpu1", f"m{n}", "demand") for n in range(5)]

    log = decision_log(recent, 3)

    assert [entry["model"] for entry in log] == ["m4", "m3", "m2"]
    assert log[0] == {"at": "2027-01-15T08:00:04+00:00", "kind": "load", "host": "gpu1",
                      "model": "m4", "reason": "demand"}  # fmt: skip
