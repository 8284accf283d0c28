"""`requests_report`'s cache_lost column: hosts that held less of a prompt than predicted."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import pytest
from django.core.management import call_command

from accounting.models import Request
from accounting.report import is_cache_lost

pytestmark = pytest.mark.django_db

WINDOW = ["--from", "2026-11-30", "--to", "2026-12-01"]


def add(host: str, predicted: int | None, reported: int | None) -> None:
    Request.objects.create(
        route="chat", model="qwen", host=host, started=datetime(2026, 11, 30, 12, tzinfo=UTC),
        queued_ms=0, ttfb_ms=100, total_ms=1000, status=200, lease="reused",
        predicted_cached_blocks=predicted, reported_cached_blocks=reported,
    )  # fmt: skip


def test_a_lost_cache_is_more_than_one_block_fewer_than_predicted() -> None:
    assert is_cache_lost(10, 0)
    assert is_cache_lost(10, 8)
    assert not is_cache_lost(10, 9)  # the conversion from tokens is good to about a block
    assert not is_cache_lost(10, 30)  # more than predicted: the index did not know it all
    assert not is_cache_lost(None, 0)  # unknown is not a loss
    assert not is_cache_lost(10, None)


def test_the_report_counts_lost_caches_per_host() -> None:
    add("gpu1", 12, 0)  # lost
    add("gpu1", 12, 3)  # lost
    add("gpu1", 12, 11)
    add("gpu1", None, None)
    add("gpu2", 5, 5)
    add("gpu2", 5, None)

    rows: list[dict[str, Any]] = json.loads(
        call_command("requests_report", *WINDOW, "--by", "host", "--format", "json")
    )
    table = call_command("requests_report", *WINDOW, "--by", "host")

    assert {row["host"]: row["cache_lost"] for row in rows} == {"gpu1": 2, "gpu2": 0}
    header = table.splitlines()[2].split()
    assert header.index("cache_lost") == header.index("cold_turns") + 1
    assert table.splitlines()[3].split()[header.index("cache_lost")] == "2"
