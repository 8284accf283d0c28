from __future__ import annotations

import csv
import io
import json
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.utils import timezone

from accounting.models import Request
from accounting.report import percentile

pytestmark = pytest.mark.django_db

NOON = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
WINDOW = ["--from", "2026-11-30", "--to", "2026-12-01"]


def add(**values: Any) -> None:
    row: dict[str, Any] = {
        "route": "chat",
        "model": "qwen",
        "host": "gpu1",
        "started": NOON,
        "queued_ms": 0,
        "ttfb_ms": 100,
        "total_ms": 1000,
        "status": 200,
        "streamed": False,
        "lease": "new",
    }
    row.update(values)
    Request.objects.create(**row)


def report(*args: str) -> str:
    return call_command("requests_report", *args)


def report_json(*args: str) -> list[dict[str, Any]]:
    return json.loads(report(*WINDOW, "--format", "json", *args))


def test_percentile_is_the_value_at_the_nearest_rank() -> None:
    values = list(range(1, 21))

    assert percentile(values, 50) == 10
    assert percentile(values, 95) == 19
    assert percentile(values, 100) == 20
    assert percentile([7], 95) == 7
    assert percentile([], 50) is None


def test_latency_percentiles_are_nearest_rank_per_group() -> None:
    for n in range(1, 21):
        add(queued_ms=n, ttfb_ms=n * 10, total_ms=n * 100)
    add(route="code", queued_ms=5, ttfb_ms=50, total_ms=500)

    chat, code = report_json()

    assert (chat["route"], chat["requests"]) == ("chat", 20)
    assert (chat["queued_p50_ms"], chat["queued_p95_ms"]) == (10, 19)
    assert (chat["ttfb_p50_ms"], chat["ttfb_p95_ms"]) == (100, 190)
    assert (chat["total_p50_ms"], chat["total_p95_ms"]) == (1000, 1900)
    assert (code["route"], code["total_p50_ms"], code["total_p95_ms"]) == ("code", 500, 500)


def test_ttfb_percentiles_leave_out_requests_that_got_no_response_head() -> None:
    add(ttfb_ms=100)
    add(ttfb_ms=300)
    add(ttfb_ms=None, status=503)
    add(ttfb_ms=None, status=503)
    add(ttfb_ms=None, status=503)

    [chat] = report_json()

    assert (chat["ttfb_p50_ms"], chat["ttfb_p95_ms"]) == (100, 300)


def test_a_group_without_any_response_head_has_no_ttfb() -> None:
    add(ttfb_ms=None, status=503)

    [chat] = report_json()

    assert chat["ttfb_p50_ms"] is None
    assert chat["tok_per_s"] is None
    assert chat["cache_hit"] is None


def test_errors_are_split_into_4xx_5xx_and_client_gone() -> None:
    for status in [200, 200, 400, 404, 429, 499, 499, 500, 502, 503, 504]:
        add(status=status)

    [chat] = report_json()

    assert chat["requests"] == 11
    assert (chat["4xx"], chat["5xx"], chat["499"]) == (3, 4, 2)


def test_token_sums_skip_unknown_counts_rather_than_count_them_as_zero() -> None:
    add(prompt_tokens=100, cached_tokens=50, completion_tokens=10)
    add(prompt_tokens=200, cached_tokens=None, completion_tokens=None)
    add(prompt_tokens=None, cached_tokens=30, completion_tokens=5)
    add(prompt_tokens=300, cached_tokens=300, completion_tokens=0)

    [chat] = report_json()

    assert chat["prompt_tokens"] == 600
    assert chat["cached_tokens"] == 380
    assert chat["completion_tokens"] == 15


def test_a_group_where_no_row_knows_its_tokens_reports_them_unknown_not_zero() -> None:
    add(route="chat", prompt_tokens=None, cached_tokens=None, completion_tokens=None)
    add(route="code", prompt_tokens=0, cached_tokens=None, completion_tokens=0)

    chat, code = report_json()
    *_, header, chat_row, code_row = report(*WINDOW).splitlines()

    assert (chat["prompt_tokens"], chat["cached_tokens"], chat["completion_tokens"]) == (
        None,
        None,
        None,
    )
    assert (code["prompt_tokens"], code["cached_tokens"], code["completion_tokens"]) == (0, None, 0)
    columns = header.split()
    tokens = [columns.index(name) for name in ("prompt_tokens", "cached_tokens")]
    assert [chat_row.split()[i] for i in tokens] == ["-", "-"]
    assert [code_row.split()[i] for i in tokens] == ["0", "-"]


def test_cache_hit_counts_only_rows_where_prompt_and_cached_are_both_known() -> None:
    add(prompt_tokens=100, cached_tokens=50)
    add(prompt_tokens=200, cached_tokens=None)
    add(prompt_tokens=None, cached_tokens=30)
    add(prompt_tokens=300, cached_tokens=300)

    [chat] = report_json()

    assert chat["cache_hit"] == 0.875


def test_tokens_per_second_is_measured_over_streamed_generation_time() -> None:
    add(streamed=True, completion_tokens=100, ttfb_ms=200, total_ms=2200)
    add(streamed=True, completion_tokens=50, ttfb_ms=100, total_ms=1100)
    add(streamed=False, completion_tokens=1000, ttfb_ms=900, total_ms=1000)
    add(streamed=True, completion_tokens=None, ttfb_ms=100, total_ms=5100)
    add(streamed=True, completion_tokens=70, ttfb_ms=None, total_ms=5100)

    [chat] = report_json()

    assert chat["tok_per_s"] == 50.0
    assert chat["completion_tokens"] == 1220


@pytest.mark.parametrize(
    ("by", "groups"),
    [
        ("host", [("gpu1", 3), ("gpu2", 1)]),
        ("model", [("llama", 2), ("qwen", 2)]),
        ("host,model", [("gpu1", "llama", 1), ("gpu1", "qwen", 2), ("gpu2", "llama", 1)]),
        ("model,host", [("llama", "gpu1", 1), ("llama", "gpu2", 1), ("qwen", "gpu1", 2)]),
        ("lease", [("", 1), ("new", 1), ("reused", 2)]),
        ("client", [("", 2), ("team-a", 2)]),
        ("placement", [("home", 2), ("new", 1), ("spilled", 1)]),
        ("patience", [("", 2), ("spill", 1), ("stay", 1)]),
        ("code", [("", 3), ("queue_full", 1)]),
    ],
)
def test_requests_are_grouped_by_any_combination_of_names(
    by: str, groups: list[tuple[Any, ...]]
) -> None:
    add(host="gpu1", model="qwen", lease="new", client="team-a", placement="new")
    add(host="gpu1", model="qwen", lease="reused", client="team-a", placement="home")
    add(host="gpu1", model="llama", lease="reused", placement="home", patience="stay")
    add(host="gpu2", model="llama", lease="", placement="spilled", code="queue_full",
        patience="spill")  # fmt: skip
    names = by.split(",")

    rows = report_json("--by", by)

    assert [(*(row[name] for name in names), row["requests"]) for row in rows] == groups


def test_csv_has_a_header_row_and_one_line_per_group() -> None:
    add(route="chat", prompt_tokens=10, cached_tokens=5)
    add(route="code", ttfb_ms=None)

    lines = list(csv.reader(io.StringIO(report(*WINDOW, "--format", "csv"))))

    assert lines[0][:5] == ["route", "requests", "4xx", "5xx", "499"]
    assert lines[0][-2:] == ["cache_hit", "tok_per_s"]
    assert len(lines) == 3
    chat, code = (dict(zip(lines[0], line, strict=True)) for line in lines[1:])
    assert (chat["route"], chat["requests"], chat["cache_hit"]) == ("chat", "1", "0.5")
    assert (code["ttfb_p50_ms"], code["cache_hit"]) == ("", "")


def test_table_aligns_columns_and_names_the_window() -> None:
    add(route="chat", prompt_tokens=12_345, cached_tokens=6_000)
    add(route="a-much-longer-route", lease="")

    title, blank, header, *rows = report(*WINDOW, "--by", "route,lease").splitlines()

    assert title == "Requests from 2026-11-30 00:00:00 to 2026-12-01 00:00:00 UTC, by route, lease:"
    assert blank == ""
    assert header.split()[:3] == ["route", "lease", "requests"]
    assert len({len(line) for line in [header, *rows]}) == 1
    assert rows[0].split()[:2] == ["a-much-longer-route", "-"]
    assert "12,345" in rows[1]
    assert "48.6%" in rows[1]


def test_from_and_to_select_a_half_open_window() -> None:
    add(started=datetime(2026, 11, 29, 23, 59, 59, tzinfo=UTC))
    add(started=datetime(2026, 11, 30, 0, 0, tzinfo=UTC))
    add(started=datetime(2026, 11, 30, 23, 59, 59, tzinfo=UTC))
    add(started=datetime(2026, 12, 1, 0, 0, tzinfo=UTC))

    [chat] = report_json()
    [late] = json.loads(
        report(
            "--from", "2026-11-30T12:00+01:00", "--to", "2026-12-01T00:00:01Z", "--format", "json"
        )
    )

    assert chat["requests"] == 2
    assert late["requests"] == 2


def test_since_counts_back_from_now() -> None:
    now = timezone.now()
    add(started=now - timedelta(minutes=30))
    add(started=now - timedelta(hours=2))
    add(started=now - timedelta(hours=30))

    [hour] = json.loads(report("--since", "1h", "--format", "json"))
    [day] = json.loads(report("--format", "json"))

    assert hour["requests"] == 1
    assert day["requests"] == 2


def test_since_counts_back_from_to_when_both_are_given() -> None:
    add(started=datetime(2026, 11, 30, 10, 30, tzinfo=UTC))
    add(started=datetime(2026, 11, 30, 11, 30, tzinfo=UTC))
    add(started=NOON)

    [chat] = json.loads(report("--since", "2h", "--to", "2026-11-30T12:00", "--format", "json"))

    assert chat["requests"] == 2


def test_an_empty_window_reports_no_groups() -> None:
    add(started=NOON)

    assert report("--from", "2020-01-01", "--to", "2020-01-02") == (
        "Requests from 2020-01-01 00:00:00 to 2020-01-02 00:00:00 UTC: none."
    )
    assert (
        json.loads(report("--from", "2020-01-01", "--to", "2020-01-02", "--format", "json")) == []
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--since", "24"], "“24” is not a duration"),
        (["--since", "1w"], "“1w” is not a duration"),
        (["--since", "1h", "--from", "2026-11-30"], "Give --since or --from, not both."),
        (["--from", "yesterday"], "--from: “yesterday” is not an ISO date"),
        (["--from", "2026-12-01", "--to", "2026-11-30"], "The window is empty"),
        (["--by", "route,color"], "cannot group by “color”"),
        (["--by", "host,host"], "names a field twice"),
    ],
)
def test_bad_arguments_are_refused_with_a_clear_message(args: list[str], message: str) -> None:
    with pytest.raises(CommandError, match=message):
        report(*args)
