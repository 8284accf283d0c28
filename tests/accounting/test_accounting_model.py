from __future__ import annotations

from datetime import UTC, datetime

import pytest
from django.db import IntegrityError, transaction

from accounting.models import Request

pytestmark = pytest.mark.django_db

STARTED = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


def minimal(**values: object) -> Request:
    row: dict[str, object] = {"route": "chat", "model": "qwen", "host": "gpu1", "started": STARTED}
    row |= {"queued_ms": 0, "total_ms": 5, "status": 200}
    return Request.objects.create(**row | values)


def test_unknown_token_counts_and_a_missing_response_head_are_stored_as_null() -> None:
    minimal(ttfb_ms=None, prompt_tokens=None, cached_tokens=None, completion_tokens=None)

    row = Request.objects.get()
    assert row.ttfb_ms is None
    assert (row.prompt_tokens, row.cached_tokens, row.completion_tokens) == (None, None, None)


def test_a_row_needs_only_what_every_request_has() -> None:
    row = minimal()

    row.refresh_from_db()
    assert (row.fingerprint, row.lease, row.error, row.client, row.fallback) == ("", "", "", "", "")
    assert row.streamed is False
    assert row.prompt_tokens is None


def test_zero_token_counts_stay_zero() -> None:
    minimal(prompt_tokens=0, cached_tokens=0, completion_tokens=0)

    assert Request.objects.filter(prompt_tokens=0, cached_tokens=0, completion_tokens=0).exists()


@pytest.mark.parametrize("field", ["queued_ms", "total_ms", "status"])
def test_timings_and_status_are_required(field: str) -> None:
    values = {"queued_ms": 0, "total_ms": 5, "status": 200, field: None}

    with pytest.raises(IntegrityError), transaction.atomic():
        Request.objects.create(route="chat", model="qwen", host="gpu1", started=STARTED, **values)


def test_names_are_plain_strings_that_outlive_the_configuration() -> None:
    relations = [f.name for f in Request._meta.get_fields() if f.is_relation]

    assert relations == []


def test_cache_hit_is_the_cached_share_of_the_prompt_when_both_are_known() -> None:
    assert minimal(prompt_tokens=400, cached_tokens=300).cache_hit == 0.75
    assert minimal(prompt_tokens=400, cached_tokens=0).cache_hit == 0
    assert minimal(prompt_tokens=400, cached_tokens=None).cache_hit is None
    assert minimal(prompt_tokens=None, cached_tokens=30).cache_hit is None
    assert minimal(prompt_tokens=0, cached_tokens=0).cache_hit is None


def test_a_row_reads_as_route_model_status_and_time() -> None:
    assert str(minimal(status=499)) == "chat qwen 499 at 2026-11-30 12:00:00"
