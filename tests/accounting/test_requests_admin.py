"""The request list as an operator reads it: error codes, clients, and times to the second."""

from __future__ import annotations

import re
from datetime import UTC, datetime

import pytest
from django.test import Client

from tests.helpers.request_rows import LIST, add, listed

pytestmark = pytest.mark.django_db


def cells(html: str, field: str) -> list[str]:
    """The text of every cell of one column, top to bottom, tags stripped."""
    found = re.findall(rf'<t[dh] class="field-{field}[^"]*"[^>]*>(.*?)</t[dh]>', html, re.S)
    return [re.sub(r"<[^>]+>", "", cell).strip() for cell in found]


def test_the_list_shows_the_error_code_and_the_client_of_each_request(
    admin_client: Client,
) -> None:
    add(fingerprint="1" * 64, status=503, code="queue_full", client="web-frontend")
    add(
        fingerprint="2" * 64,
        started=datetime(2026, 11, 30, 11, 0, tzinfo=UTC),
        status=502,
        code="upstream_unreachable",
    )
    add(fingerprint="3" * 64, started=datetime(2026, 11, 30, 10, 0, tzinfo=UTC))

    html = admin_client.get(LIST).content.decode()

    assert cells(html, "error_code") == ["queue_full", "upstream_unreachable", "-"]
    assert cells(html, "client") == ["web-frontend", "-", "-"]
    # A long code may break after its underscores rather than widen the table.
    assert "upstream_<wbr>unreachable" in html


def test_times_are_shown_to_the_second_in_the_list_and_on_the_rows_page(
    admin_client: Client,
) -> None:
    row = add(started=datetime(2026, 11, 30, 8, 13, 5, 250_000, tzinfo=UTC))

    listing = admin_client.get(LIST).content.decode()
    page = admin_client.get(f"{LIST}{row.pk}/change/").content.decode()

    assert cells(listing, "started_at") == ["2026-11-30 08:13:05"]
    assert '<div class="readonly">2026-11-30 08:13:05</div>' in page
    for html in (listing, page):
        assert "a.m." not in html and "p.m." not in html


def test_a_requests_page_starts_with_its_status_code_and_reason_and_shows_its_start_once(
    admin_client: Client,
) -> None:
    row = add(status=503, code="queue_full", error="every slot and place of gpu1 is taken")

    page = admin_client.get(f"{LIST}{row.pk}/change/").content.decode()
    labels = [
        re.sub(r"<[^>]+>|:", "", label).strip()
        for label in re.findall(r"<label[^>]*>(.*?)</label>", page, re.S)
    ]

    assert labels[:3] == ["Status", "Code", "Error"]
    assert labels.count("Started") == 1
    assert "every slot and place of gpu1 is taken" in page


def test_only_a_499_says_on_its_page_that_the_client_went_away(admin_client: Client) -> None:
    served = add(status=200)
    left = add(status=499, code="client_disconnected", error="client disconnected")

    served_page = admin_client.get(f"{LIST}{served.pk}/change/").content.decode()
    left_page = admin_client.get(f"{LIST}{left.pk}/change/").content.decode()

    assert "client went away" not in served_page
    assert re.search(r"<div class=\"readonly\">200</div>", served_page)
    assert re.search(r"<div class=\"readonly\">499 \(the client went away\)</div>", left_page)


def test_the_timings_are_labelled_in_milliseconds_on_a_requests_page(admin_client: Client) -> None:
    row = add()

    page = admin_client.get(f"{LIST}{row.pk}/change/").content.decode()
    labels = [
        re.sub(r"<[^>]+>|:", "", label).strip()
        for label in re.findall(r"<label[^>]*>(.*?)</label>", page, re.S)
    ]

    assert {"Queued (ms)", "TTFB (ms)", "Total (ms)"} <= set(labels)


def test_a_route_refusals_page_names_no_host_and_lists_the_hosts_that_were_full(
    admin_client: Client,
) -> None:
    row = add(status=503, code="queue_full", host="", refused_by="gpu1 gpu2")

    page = admin_client.get(f"{LIST}{row.pk}/change/").content.decode()
    shown = re.search(r"field-refused_by.*?<div class=\"readonly\">(.*?)</div>", page, re.S)

    assert shown is not None and shown.group(1) == "gpu1 gpu2"
    assert re.search(r"field-host.*?<div class=\"readonly\">-</div>", page, re.S)


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        ("?client=web-frontend", ["00000003", "00000001"]),
        ("?client=ci-batch", ["00000002"]),
        ("?code=queue_full", ["00000003"]),
        ("?code=", ["00000002", "00000001"]),
    ],
)
def test_the_client_and_code_filters_narrow_the_list(
    admin_client: Client, query: str, expected: list[str]
) -> None:
    rows: list[dict[str, object]] = [
        {"client": "web-frontend"},
        {"client": "ci-batch"},
        {"client": "web-frontend", "status": 503, "code": "queue_full"},
    ]
    for n, values in enumerate(rows, start=1):
        add(
            fingerprint=f"{n:08x}" + "0" * 56,
            started=datetime(2026, 11, 1, n, tzinfo=UTC),
            **values,
        )

    assert listed(admin_client, query) == expected


def test_the_filter_sidebar_offers_the_clients_and_codes_found(admin_client: Client) -> None:
    add(client="web-frontend", status=429, code="rate_limit_exceeded")
    add(client="ci-batch")

    html = admin_client.get(LIST).content.decode()

    assert "By client" in html and "By code" in html
    for link in ("?client=web-frontend", "?client=ci-batch", "?code=rate_limit_exceeded"):
        assert link in html


def test_the_columns_have_short_headers(admin_client: Client) -> None:
    add()

    html = admin_client.get(LIST).content.decode()
    headers = re.findall(r'<th scope="col" class="[^"]*column-\w+[^"]*">(.*?)</th>', html, re.S)

    assert [re.sub(r"<[^>]+>|\s+", " ", header).strip() for header in headers] == [
        "Started", "Route", "Model", "Host", "Client", "Status", "Code", "Queued (ms)",
        "TTFB (ms)", "Total (ms)", "Tokens in/out", "Cache hit", "Fingerprint",
    ]  # fmt: skip
