"""`requests_report`'s cold_turns column: returning conversations that found their cache gone."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import pytest
from django.core.management import call_command

from accounting.models import Request
from accounting.report import COLD_TURN_SHARE, is_cold_turn

pytestmark = pytest.mark.django_db

WINDOW = ["--from", "2026-11-30", "--to", "2026-12-01"]


def add(host: str, lease: str, prompt: int | None, cached: int | None) -> None:
    Request.objects.create(
        route="chat", model="qwen", host=host, started=datetime(2026, 11, 30, 12, tzinfo=UTC),
        queued_ms=0, ttfb_ms=100, total_ms=1000, status=200, lease=lease,
        prompt_tokens=prompt, cached_tokens=cached,
    )  # fmt: skip


def test_a_cold_turn_is_a_reused_lease_with_less_than_the_share_cached() -> None:
    assert COLD_TURN_SHARE == 0.5
    assert is_cold_turn("reused", 100, 49)
    assert not is_cold_turn("reused", 100, 50)
    assert not is_cold_turn("new", 100, 0)  # a new conversation has nothing to find
    assert not is_cold_turn("moved", 100, 0)  # nor one moved to another host
    assert not is_cold_turn("reused", 100, None)  # unknown is not cold
    assert not is_cold_turn("reused", None, 0)
    assert not is_cold_turn("reused", 0, 0)


def test_the_report_counts_cold_turns_per_host() -> None:
    add("gpu1", "reused", 1000, 100)  # cold
    add("gpu1", "reused", 1000, 400)  # cold
    add("gpu1", "reused", 1000, 900)
    add("gpu1", "new", 1000, 0)
    add("gpu2", "reused", 1000, 990)
    add("gpu2", "reused", None, None)

    rows: list[dict[str, Any]] = json.loads(
        call_command("requests_report", *WINDOW, "--by", "host", "--format", "json")
    )
    table = call_command("requests_report", *WINDOW, "--by", "host")

    assert {row["host"]: row["cold_turns"] for row in rows} == {"gpu1": 2, "gpu2": 0}
    header = table.splitlines()[2].split()
    assert header.index("cold_turns") == header.index("completion_tokens") + 1
