"""The dashboard's history read from the Request table: per-step aggregates of the rows, the
24-hour view's minutes, and the rings filled from the rows after a restart."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from accounting.models import Request
from routing.ops.history_rings import History
from routing.ops.history_rows import DatabaseHistory, read_steps
from tests.helpers.history_records import T0, point_at, record


def add_row(minute: float, **values: object) -> None:
    """A row started `minute` minutes after T0, plus 5 s; by default it ends 6 s later."""
    row: dict[str, object] = {
        "route": "chat", "model": "llama3", "host": "gpu1",
        "started": datetime.fromtimestamp(T0 + minute * 60 + 5, UTC),
        "queued_ms": 0, "ttfb_ms": 50, "total_ms": 6000, "status": 200, "lease": "new",
        "prompt_tokens": 100, "cached_tokens": 0, "completion_tokens": 30,
    }  # fmt: skip
    row.update(values)
    Request.objects.create(**row)


def total(points: list[dict]) -> int:
    """The requests a window counts, as its chart's summary adds them up."""
    return sum(sum(p["requests"].values()) for p in points)


@pytest.mark.django_db
def test_the_table_is_read_per_minute_with_the_rings_figures() -> None:
    add_row(0, status=200, queued_ms=3000, total_ms=9000)
    add_row(0, status=503, code="queue_full", ttfb_ms=None, completion_tokens=None)
    add_row(0, status=499, lease="reused", prompt_tokens=100, cached_tokens=20)  # cold
    add_row(0, host="gpu2", lease="reused", prompt_tokens=100, cached_tokens=80)
    add_row(1, status=502, ttfb_ms=400)
    add_row(-2000)  # older than the window asked for

    minutes = read_steps(int(T0), int(T0) + 120, 60)

    assert sorted(minutes) == [int(T0), int(T0) + 60]
    first = minutes[int(T0)]
    assert first["gpu1"].outcomes == [1, 0, 1, 1]
    assert first["gpu1"].cold == 1 and first["gpu2"].cold == 0
    assert first["gpu1"].tokens == 60
    assert first[""].codes == {"queue_full": 1, "http_499": 1}
    # Little's law: 6 s + 6 s + 6 s of running (9 - 3, 6, 6) over the minute.
    assert first["gpu1"].in_flight_mean == round(18 / 60, 2)
    assert first["gpu1"].queued_mean == round(3 / 60, 2)
    # TTFB is the fleet's: three of 50 ms (one row had no head), in the (40, 50] bucket.
    assert sum(first[""].ttfb.values()) == 3
    assert 40 < first[""].ttfb_percentile(50) <= 50  # type: ignore[operator]  # None fails the test
    assert minutes[int(T0) + 60][""].codes == {"http_502": 1}


LOSSES = [
    (10, 0, True), (10, 8, True),  # the host held none, or two blocks fewer: lost
    (10, 9, False),  # one block fewer: within the conversion from tokens
    (3, 40, False),  # more than predicted: the index did not know all it held
    (10, None, False), (None, 0, False), (None, None, False),  # unknown is no loss
]  # fmt: skip


@pytest.mark.django_db
def test_the_table_counts_a_lost_cache_as_the_rings_do() -> None:
    for predicted, reported, _ in LOSSES:
        add_row(0, predicted_cached_blocks=predicted, reported_cached_blocks=reported)
        add_row(0, host="gpu2", predicted_cached_blocks=predicted, reported_cached_blocks=9)
    rings = History()
    for predicted, reported, _ in LOSSES:
        rings.observe(
            record(predicted_cached_blocks=predicted, reported_cached_blocks=reported), now=T0
        )

    [minute] = read_steps(int(T0), int(T0) + 60, 60).values()
    [point] = rings.points("5m", since=int(T0), now=T0)

    lost = sum(is_lost for _, _, is_lost in LOSSES)
    assert minute["gpu1"].cache_lost == point["hosts"]["gpu1"]["cache_lost"] == lost == 2
    # gpu2 held 9 of each: lost where 11 or more were predicted, and none was.
    assert minute["gpu2"].cache_lost == 0


@pytest.mark.django_db
def test_a_row_counts_in_the_step_it_finished_as_the_rings_count_it() -> None:
    add_row(0, total_ms=50_000)  # started at 0:05, finished at 0:55
    add_row(0, total_ms=60_000)  # finished at 1:05
    add_row(-30, total_ms=31 * 60_000)  # started half an hour before, finished at 1:05

    minutes = read_steps(int(T0), int(T0) + 120, 60)
    steps = read_steps(int(T0), int(T0) + 120, 5)

    assert minutes[int(T0)]["gpu1"].requests == 1
    assert minutes[int(T0) + 60]["gpu1"].requests == 2
    assert sorted(steps) == [int(T0) + 55, int(T0) + 65]


@pytest.mark.django_db(transaction=True)
async def test_the_24_hour_view_is_read_once_and_kept() -> None:
    from asgiref.sync import sync_to_async

    clock = [T0 + 3600 + 90]  # minutes 0 and 1 are an hour old: the table's
    db = DatabaseHistory(clock=lambda: clock[0])
    rings = History(clock=lambda: clock[0])
    await sync_to_async(add_row)(0)

    await db.refresh()
    first = rings.day_points(db)
    await sync_to_async(add_row)(1)
    await db.refresh()  # too soon: the kept read stands
    kept = rings.day_points(db)
    clock[0] += 61
    await db.refresh()
    fresh = rings.day_points(db, since=db.changed_from)

    assert len(first) == 24 * 60
    assert first[-1]["t"] == int(T0) + 3600 + 60
    assert point_at(first, T0)["requests"]["2xx"] == 1
    assert point_at(kept, T0 + 60)["requests"]["2xx"] == 0
    assert point_at(fresh, T0 + 60)["requests"]["2xx"] == 1
    assert db.changed_from == int(T0) + 60  # only the minute that became an hour old
    assert db.version == 2


@pytest.mark.django_db(transaction=True)
async def test_a_minute_without_rows_of_a_host_shows_it_idle_in_the_24_hour_view() -> None:
    from asgiref.sync import sync_to_async

    db = DatabaseHistory(clock=lambda: T0 + 3600 + 150)
    await sync_to_async(add_row)(0, total_ms=30_000)

    await db.refresh()
    points = History(clock=lambda: T0 + 3600 + 150).day_points(db)
    busy, idle = point_at(points, T0), point_at(points, T0 + 60)

    assert busy["hosts"]["gpu1"]["in_flight"] == 0.5  # 30 s of running over the minute
    assert idle["hosts"]["gpu1"] == {
        "requests": 0, "in_flight": 0.0, "queued": 0.0, "cache_hit": None, "cold": 0,
        "cache_lost": 0,
    }  # fmt: skip


@pytest.mark.django_db
def test_a_restarted_history_counts_the_requests_of_the_last_hour_from_the_rows() -> None:
    clock = [T0 + 7080]  # the process starts at minute 118
    for minute in range(0, 118, 2):  # a request every 2 minutes for 2 hours, before the start
        add_row(minute, status=200 if minute % 10 else 503, code="" if minute % 10 else "boom")
    rings = History(clock=lambda: clock[0])
    add_row(118)  # served by this process, which counted it as it finished
    clock[0] = T0 + 7200

    assert rings.rebuild() is True
    assert rings.rebuild() is False  # once: the rows are not counted twice

    five, hour = rings.points("5m"), rings.points("1h")
    assert total(five) == 1  # minute 116
    assert total(hour) == 28  # minutes 62 to 116: the hour's first step starts at 60:30
    assert sum(p["codes"].get("boom", 0) for p in hour) == 5
    assert sum(p["requests"]["5xx"] for p in hour) == 5
    # The rows say when requests ran, not what was queued or running between the samples.
    assert {p["hosts"]["gpu1"]["in_flight"] for p in hour if p["hosts"]} == {None}
    assert rings.version == 1


@pytest.mark.django_db
def test_a_restarted_history_cards_count_the_lost_caches_of_the_rows_before_it() -> None:
    add_row(3, predicted_cached_blocks=12, reported_cached_blocks=0)  # in no card: too old
    for minute in (6, 7, 8):
        add_row(minute, predicted_cached_blocks=12, reported_cached_blocks=0)
    add_row(8, host="gpu2", predicted_cached_blocks=12, reported_cached_blocks=12)
    rings = History(clock=lambda: T0 + 600)  # the process starts 10 minutes after T0

    rings.rebuild()
    cards = rings.cards()
    hour = rings.points("1h")

    assert (cards["gpu1"]["cache_lost"], cards["gpu2"]["cache_lost"]) == (3, 0)
    assert sum(p["hosts"].get("gpu1", {}).get("cache_lost", 0) for p in hour) == 4


@pytest.mark.django_db(transaction=True)
async def test_no_window_counts_more_than_a_longer_one_after_a_restart() -> None:
    from asgiref.sync import sync_to_async

    clock = [T0 + 7200.0]
    for minute in range(0, 120, 3):
        await sync_to_async(add_row)(minute)
    rings = History(clock=lambda: clock[0])
    db = DatabaseHistory(clock=lambda: clock[0])
    await db.refresh()
    await sync_to_async(rings.rebuild)()
    windows = []
    for second in range(0, 240, 10):  # four minutes of requests, the table's read kept
        clock[0] = T0 + 7200 + second
        rings.observe(record(), now=clock[0])
        rings.observe(record(status=503, code="queue_full"), now=clock[0])
        await db.refresh()
        windows.append(
            (total(rings.points("5m")), total(rings.points("1h")), total(rings.day_points(db)))
        )

    for five, hour, day in windows:
        assert five <= hour <= day
    # At the end: the 48 requests served since, plus the rows finished in each window: none
    # in the 5 minutes, those of minutes 66 to 117 in the hour (18), all 40 in the 24 hours.
    assert windows[-1] == (48, 48 + 18, 48 + 40)
