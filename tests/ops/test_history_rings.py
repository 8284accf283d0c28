"""The dashboard's history in memory: per-step rings of finished requests and samples."""

from __future__ import annotations

from hosts.live import HostLoad
from routing.ops.history_rings import History
from tests.helpers.history_records import T0, point_at, record


def test_requests_count_by_outcome_in_the_step_they_finish() -> None:
    history = History()
    for status in (200, 200, 404, 429, 499, 502, 503):
        history.observe(record(status=status), now=T0 + 1)
    history.observe(record(), now=T0 + 7)  # the next 5-second step

    points = history.points("5m", now=T0 + 8)

    assert point_at(points, T0)["requests"] == {"2xx": 2, "4xx": 2, "5xx": 2, "499": 1}
    assert point_at(points, T0 + 5)["requests"] == {"2xx": 1, "4xx": 0, "5xx": 0, "499": 0}
    assert [p["t"] for p in points][-1] == T0 + 5  # the step in progress is the last point
    assert len(points) == 60 and points[0]["t"] == T0 + 5 - 295


def test_errors_count_by_their_code_or_by_status_when_they_have_none() -> None:
    history = History()
    history.observe(record(status=503, code="queue_full"), now=T0)
    history.observe(record(status=503, code="queue_full"), now=T0)
    history.observe(record(status=502), now=T0)  # a host's own error: no gateway code
    history.observe(record(status=200), now=T0)

    [point] = history.points("5m", since=int(T0), now=T0)

    assert point["codes"] == {"http_502": 1, "queue_full": 2}


def test_ttfb_percentiles_come_from_the_buckets_within_a_bucket_of_the_truth() -> None:
    history = History()
    for ms in range(1, 101):
        history.observe(record(ttfb_ms=ms), now=T0)
    history.observe(record(ttfb_ms=None, status=503), now=T0)  # no response head: left out

    [point] = history.points("5m", since=int(T0), now=T0)

    assert point["ttfb_p50"] == 50.0
    assert point["ttfb_p95"] == 95.0


def test_tokens_cache_hits_and_cold_turns_add_up_per_host() -> None:
    history = History()
    history.observe(record(lease="new", prompt_tokens=100, cached_tokens=0), now=T0)
    history.observe(record(lease="reused", prompt_tokens=100, cached_tokens=90), now=T0)
    history.observe(record(lease="reused", prompt_tokens=100, cached_tokens=10), now=T0)  # cold
    history.observe(record(lease="reused", prompt_tokens=100, cached_tokens=None), now=T0)
    history.observe(record(host="gpu2", lease="reused", prompt_tokens=50, cached_tokens=49), now=T0)

    [point] = history.points("5m", since=int(T0), now=T0)

    assert point["tokens"] == 5 * 20
    assert point["cache_hit"] == round((0 + 90 + 10 + 49) / (300 + 50), 4)
    assert point["hosts"]["gpu1"]["cache_hit"] == round(100 / 300, 4)
    assert point["hosts"]["gpu1"]["cold"] == 1
    assert point["hosts"]["gpu2"]["cold"] == 0


def test_a_host_that_held_less_than_the_prefix_index_predicted_counts_a_lost_cache() -> None:
    history = History()
    for predicted, reported in [(10, 0), (10, 8), (10, 9), (10, 30), (None, 0), (10, None)]:
        lost = record(predicted_cached_blocks=predicted, reported_cached_blocks=reported)
        history.observe(lost, now=T0)
    history.observe(
        record(host="gpu2", predicted_cached_blocks=4, reported_cached_blocks=0), now=T0
    )

    [point] = history.points("5m", since=int(T0), now=T0)
    cards = history.cards(now=T0 + 1)

    # Ten predicted and none or eight held: lost; nine is within the conversion's block, and
    # more than predicted or an unknown figure is no loss.
    assert point["hosts"]["gpu1"]["cache_lost"] == 2
    assert point["hosts"]["gpu2"]["cache_lost"] == 1
    assert (cards["gpu1"]["cache_lost"], cards["gpu2"]["cache_lost"]) == (2, 1)


def test_a_request_that_reached_no_host_counts_for_the_fleet_only() -> None:
    history = History()
    history.observe(record(host="", status=404, code="model_not_found"), now=T0)

    [point] = history.points("5m", since=int(T0), now=T0)

    assert point["requests"]["4xx"] == 1
    assert point["hosts"] == {}


def test_a_model_loaded_nowhere_counts_as_its_routes_refusal() -> None:
    history = History()
    history.observe(record(host="", status=503, code="model_not_loaded"), now=T0)

    assert history.route_refusals(now=T0 + 1) == {
        "chat": {"refused": 1, "codes": {"model_not_loaded": 1}}
    }


def test_a_queue_full_counts_once_in_the_totals_on_its_route_and_as_full_on_each_host() -> None:
    history = History()
    refused = record(host="", status=503, code="queue_full", refused_by="gpu1 gpu2")
    history.observe(refused, now=T0)
    history.observe(record(host="", status=503, code="no_healthy_host"), now=T0)
    history.observe(record(host="gpu2"), now=T0)

    point = point_at(history.points("5m", now=T0), T0)
    cards = history.cards(now=T0 + 1)

    assert point["requests"] == {"2xx": 1, "4xx": 0, "5xx": 2, "499": 0}
    assert point["codes"] == {"no_healthy_host": 1, "queue_full": 1}
    assert (cards["gpu1"]["refused"], cards["gpu2"]["refused"]) == (1, 1)
    # Neither host failed the request: their errors and codes count none of it.
    for host in ("gpu1", "gpu2"):
        assert cards[host]["outcomes"]["5xx"] == 0 and cards[host]["codes"] == {}
    assert history.route_refusals(now=T0 + 1) == {
        "chat": {"refused": 2, "codes": {"no_healthy_host": 1, "queue_full": 1}}
    }
    assert history.route_refusals(now=T0 + 301) == {}  # past the 5 minutes


def test_samples_give_each_hosts_mean_in_flight_and_queue_per_step() -> None:
    history = History()
    for second, (busy, waiting) in enumerate([(4, 2), (4, 0), (2, 0), (2, 0), (3, 3)]):
        history.sample([HostLoad("gpu1", busy, waiting), HostLoad("gpu2", 0, 0)], now=T0 + second)

    [point] = history.points("5m", since=int(T0), now=T0 + 4)
    cards = history.cards(now=T0 + 4)

    assert point["hosts"]["gpu1"]["in_flight"] == 3.0
    assert point["hosts"]["gpu1"]["queued"] == 1.0
    assert point["hosts"]["gpu2"] == {
        "requests": 0, "in_flight": 0.0, "queued": 0.0, "cache_hit": None, "cold": 0,
        "cache_lost": 0,
    }  # fmt: skip
    assert cards["gpu1"]["queued_peak"] == 3


def test_a_step_without_samples_has_no_queue_figure_rather_than_zero() -> None:
    history = History()
    history.observe(record(), now=T0)

    [point] = history.points("5m", since=int(T0), now=T0)

    assert point["hosts"]["gpu1"]["in_flight"] is None
    assert point["hosts"]["gpu1"]["queued"] is None


def test_old_steps_leave_the_5_minute_window_but_stay_in_the_hour() -> None:
    history = History()
    history.observe(record(), now=T0)

    five = history.points("5m", now=T0 + 600)
    hour = history.points("1h", now=T0 + 600)

    assert sum(p["requests"]["2xx"] for p in five) == 0
    assert point_at(hour, T0)["requests"]["2xx"] == 1
    assert hour[1]["t"] - hour[0]["t"] == 30 and len(hour) == 120


def test_a_slot_reused_after_a_lap_of_the_ring_starts_empty() -> None:
    history = History()
    history.observe(record(), now=T0)
    history.observe(record(status=500), now=T0 + 305)  # the same slot, one lap later

    [point] = history.points("5m", since=int(T0 + 305), now=T0 + 305)

    assert point["requests"] == {"2xx": 0, "4xx": 0, "5xx": 1, "499": 0}


def test_increments_start_at_the_step_asked_for() -> None:
    history = History()
    history.observe(record(), now=T0)
    history.observe(record(), now=T0 + 12)

    later = history.points("5m", since=int(T0 + 5), now=T0 + 12)

    assert [p["t"] for p in later] == [T0 + 5, T0 + 10]
    assert [p["requests"]["2xx"] for p in later] == [0, 1]


def test_cards_cover_the_last_five_minutes_per_host() -> None:
    history = History()
    history.observe(record(status=200, ttfb_ms=100), now=T0 - 400)  # too old for a card
    for i in range(30):
        history.observe(record(status=200 if i else 503, ttfb_ms=100), now=T0 + i)
    cold = record(host="gpu2", lease="reused", prompt_tokens=10, cached_tokens=1)
    history.observe(cold, now=T0)

    cards = history.cards(now=T0 + 300 - 5)

    assert cards["gpu1"]["requests"] == 30
    assert cards["gpu1"]["outcomes"] == {"2xx": 29, "4xx": 0, "5xx": 1, "499": 0}
    assert cards["gpu1"]["codes"] == {"http_503": 1}
    assert cards["gpu1"]["rps"] == round(30 / 295, 3)
    assert cards["gpu1"]["tokens_per_s"] == round(30 * 20 / 295, 2)
    # Thirty TTFBs of 100 ms: the percentile is read inside their bucket, (80, 100] ms.
    assert 80 < cards["gpu1"]["ttfb_p50"] <= 100
    assert cards["gpu2"]["cold"] == 1 and cards["gpu2"]["cache_hit"] == 0.1


def test_a_request_older_than_its_slot_does_not_wipe_the_newer_step() -> None:
    history = History()
    history.observe(record(), now=T0 + 305)
    history.observe(record(status=500), now=T0)  # the clock stepped back a lap of the ring

    [point] = history.points("5m", since=int(T0 + 305), now=T0 + 305)

    assert point["requests"] == {"2xx": 1, "4xx": 0, "5xx": 0, "499": 0}
