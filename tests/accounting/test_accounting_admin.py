from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.test import Client

from accounting.admin import PeriodProbingQuerySet
from accounting.models import Request
from tests.helpers.request_rows import LIST, add, listed

pytestmark = pytest.mark.django_db


@pytest.fixture
def admin_client() -> Client:
    client = Client()
    client.force_login(get_user_model().objects.create_superuser("root", "", "pw"))
    return client


def test_anonymous_users_are_sent_to_the_login_page() -> None:
    response = Client().get(LIST)

    assert response.status_code == 302
    assert response["Location"].startswith("/admin/login/")


def test_requests_are_listed_newest_first_with_latency_tokens_and_cache_hit(
    admin_client: Client,
) -> None:
    add(fingerprint="a" * 64, started=datetime(2026, 11, 30, 9, 0, tzinfo=UTC))
    add(
        fingerprint="b" * 64,
        started=datetime(2026, 11, 30, 10, 0, tzinfo=UTC),
        queued_ms=12,
        ttfb_ms=345,
        total_ms=6789,
        prompt_tokens=4000,
        cached_tokens=3000,
        completion_tokens=250,
    )

    response = admin_client.get(LIST)
    html = response.content.decode()

    assert listed(admin_client) == ["bbbbbbbb", "aaaaaaaa"]
    assert "Cache hit" in html
    assert ">75%<" in html
    for value in ("12", "345", "6789", "4000/250"):
        assert f">{value}<" in html


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        ("?route=code", ["00000002"]),
        ("?host=gpu2", ["00000003"]),
        ("?model=llama", ["00000004"]),
        ("?status_class=2xx", ["00000004", "00000003", "00000002", "00000001"]),
        ("?status_class=4xx", ["00000005"]),
        ("?status_class=499", ["00000006"]),
        ("?status_class=5xx", ["00000007"]),
        ("?streamed__exact=0", ["00000004"]),
        ("?lease__exact=moved", ["00000003"]),
        ("?route=chat&status_class=5xx", ["00000007"]),
    ],
)
def test_filters_narrow_the_list(admin_client: Client, query: str, expected: list[str]) -> None:
    rows: list[dict[str, Any]] = [
        {},
        {"route": "code"},
        {"host": "gpu2", "lease": "moved"},
        {"model": "llama", "streamed": False},
        {"status": 429},
        {"status": 499},
        {"status": 502},
    ]
    for n, values in enumerate(rows, start=1):
        add(
            fingerprint=f"{n:08x}" + "0" * 56,
            started=datetime(2026, 11, 1, n, tzinfo=UTC),
            **values,
        )

    assert listed(admin_client, query) == expected


def test_filter_sidebar_offers_the_names_and_status_classes_found(admin_client: Client) -> None:
    add(route="chat", host="gpu1", model="qwen")
    add(route="code", host="gpu2", model="llama")

    html = admin_client.get(LIST).content.decode()

    for link in (
        "?route=code",
        "?host=gpu2",
        "?model=llama",
        "?status_class=499",
        "?lease__exact=",
    ):
        assert link in html


@pytest.mark.parametrize(
    ("term", "expected"),
    [
        ("3fa9", ["3fa9c2d1", "3fa90000"]),
        ("3FA9C2", ["3fa9c2d1"]),
        ("3fa9c2d1" + "e" * 56, ["3fa9c2d1"]),
        ("  3fa90 ", ["3fa90000"]),
        ("ffff", []),
        ("not-hex", []),
    ],
)
def test_search_finds_requests_by_fingerprint_prefix(
    admin_client: Client, term: str, expected: list[str]
) -> None:
    add(fingerprint="3fa9c2d1" + "e" * 56, started=datetime(2026, 11, 30, 2, tzinfo=UTC))
    add(fingerprint="3fa90000" + "e" * 56, started=datetime(2026, 11, 30, 1, tzinfo=UTC))
    add(fingerprint="3fb00000" + "e" * 56)
    add(fingerprint="")

    assert listed(admin_client, f"?q={term}") == expected


def test_date_hierarchy_finds_the_same_periods_as_django(admin_client: Client) -> None:
    for moment in [
        datetime(2025, 12, 31, 23, 59, 59, tzinfo=UTC),
        datetime(2026, 1, 1, 0, 0, tzinfo=UTC),
        datetime(2026, 11, 3, 8, 0, tzinfo=UTC),
        datetime(2026, 11, 3, 23, 0, tzinfo=UTC),
        datetime(2026, 11, 17, 0, 0, tzinfo=UTC),
        datetime(2026, 12, 1, 12, 0, tzinfo=UTC),
    ]:
        add(started=moment)
    probing = PeriodProbingQuerySet(Request)

    for kind in ("year", "month", "day"):
        assert probing.datetimes("started", kind) == list(
            Request.objects.datetimes("started", kind)
        )
    assert probing.filter(started__year=2026).datetimes("started", "month", "DESC") == list(
        Request.objects.filter(started__year=2026).datetimes("started", "month", "DESC")
    )

    html = admin_client.get(LIST + "?started__year=2026&started__month=11").content.decode()
    days = re.findall(r"started__day=(\d+)", html)
    assert days == ["3", "17"]


def test_requests_cannot_be_added_changed_or_deleted_in_the_admin(admin_client: Client) -> None:
    row = add(fingerprint="c" * 64)
    change = f"{LIST}{row.pk}/change/"

    assert admin_client.get(LIST + "add/").status_code == 403
    view = admin_client.get(change)
    assert view.status_code == 200
    assert "View request" in view.content.decode()
    assert 'name="_save"' not in view.content.decode()
    assert admin_client.post(change, {"route": "changed"}).status_code == 403
    assert admin_client.post(f"{LIST}{row.pk}/delete/", {"post": "yes"}).status_code == 403
    assert Request.objects.get().route == "chat"
