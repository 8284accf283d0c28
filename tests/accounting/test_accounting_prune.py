from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.utils import timezone

from accounting.management.commands import requests_prune
from accounting.models import Request

pytestmark = pytest.mark.django_db


def add_aged(*ages: timedelta) -> None:
    now = timezone.now()
    Request.objects.bulk_create(
        Request(
            route="chat",
            model="qwen",
            host="gpu1",
            started=now - age,
            queued_ms=0,
            total_ms=10,
            status=200,
        )
        for age in ages
    )


def remaining_ages_in_days() -> list[int]:
    now = timezone.now()
    return sorted(
        (now - started).days for started in Request.objects.values_list("started", flat=True)
    )


def prune(*args: str) -> Any:
    return call_command("requests_prune", *args)


def test_prune_deletes_only_requests_older_than_the_cutoff() -> None:
    add_aged(*(timedelta(days=d, hours=1) for d in (0, 1, 29, 30, 31, 90)))

    output = prune("--older-than", "30d")

    assert output.startswith("Deleted 3 requests started before ")
    assert remaining_ages_in_days() == [0, 1, 29]


def test_prune_deletes_in_batches_until_nothing_old_is_left(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(requests_prune, "BATCH", 7)
    add_aged(*[timedelta(days=40)] * 30, *[timedelta(hours=1)] * 5)

    output = prune("--older-than", "30d", "--verbosity", "2")

    assert output.startswith("Deleted 30 requests")
    assert Request.objects.count() == 5


def test_dry_run_counts_without_deleting() -> None:
    add_aged(timedelta(hours=2), timedelta(hours=30), timedelta(days=3))

    output = prune("--older-than", "24h", "--dry-run")

    assert output.startswith("Would delete 2 requests started before ")
    assert Request.objects.count() == 3


def test_nothing_old_means_nothing_deleted() -> None:
    add_aged(timedelta(minutes=5))

    assert prune("--older-than", "1h").startswith("Deleted 0 requests")
    assert Request.objects.count() == 1


@pytest.mark.parametrize("age", ["30", "thirty days", "0d", "-5d"])
def test_a_bad_age_is_refused_with_a_clear_message(age: str) -> None:
    add_aged(timedelta(days=400))

    with pytest.raises(CommandError, match="--older-than: .* is not a duration"):
        prune(f"--older-than={age}")
    assert Request.objects.count() == 1


def test_the_age_is_required_to_delete() -> None:
    add_aged(timedelta(days=400))

    with pytest.raises(CommandError, match="--older-than is required to delete"):
        prune()
    assert Request.objects.count() == 1


def test_a_dry_run_without_an_age_counts_the_requests_older_than_1_7_30_and_90_days() -> None:
    add_aged(
        timedelta(hours=2),
        *[timedelta(days=2)] * 2,
        *[timedelta(days=10)] * 3,
        timedelta(days=40),
        timedelta(days=100),
    )

    output = prune("--dry-run")

    assert output.splitlines() == [
        "8 requests in all; nothing deleted. Older than:",
        "    1d  7",
        "    7d  5",
        "   30d  2",
        "   90d  1",
        "Delete with --older-than AGE (e.g. --older-than 30d).",
    ]
    assert Request.objects.count() == 8


def test_one_m_is_refused_as_ambiguous_naming_minutes_and_months() -> None:
    add_aged(timedelta(days=400), timedelta(days=2))

    with pytest.raises(CommandError) as refused:
        prune("--older-than", "1m")

    message = str(refused.value)
    assert "“1m” is ambiguous: write 1min for minutes or 1mo for months (30 days)" in message
    assert "s, min, h, d or mo" in message
    assert Request.objects.count() == 2


@pytest.mark.parametrize(
    ("age", "kept_ages_in_days"),
    [
        ("90min", [0]),
        ("36000s", [0, 0]),
        ("3d", [0, 0, 2]),
        ("1mo", [0, 0, 2]),
        ("2mo", [0, 0, 2, 31]),
    ],
)
def test_minutes_and_months_are_spelled_min_and_mo(age: str, kept_ages_in_days: list[int]) -> None:
    add_aged(
        timedelta(minutes=30),
        timedelta(hours=2),
        timedelta(days=2),
        timedelta(days=31),
        timedelta(days=400),
    )

    prune("--older-than", age)

    assert remaining_ages_in_days() == kept_ages_in_days
