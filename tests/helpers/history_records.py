"""Finished requests and their chart points, for the tests of the dashboard's history (the
rings and the reader of the rows count the same requests)."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

from accounting.recorder import RequestRecord

T0 = 1_764_590_400.0  # 2025-12-01 12:00:00 UTC, on a minute (and so on every step)

RECORD = RequestRecord(
    route="chat", fingerprint="f" * 64, model="llama3", host="gpu1",
    started=datetime.fromtimestamp(T0, UTC), queued_ms=0, ttfb_ms=40, total_ms=900,
    status=200, streamed=True, lease="new", prompt_tokens=100, cached_tokens=0,
    completion_tokens=20,
)  # fmt: skip


def record(**changes: Any) -> RequestRecord:
    return replace(RECORD, **changes)


def point_at(points: list[dict], t: float) -> dict:
    return next(p for p in points if p["t"] == int(t))
