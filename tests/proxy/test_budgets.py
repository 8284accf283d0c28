"""Client keys' token budgets through the gateway, over real sockets: a key past its day's or
month's tokens is refused at once (429 `budget_exhausted`, `Retry-After` to the reset), with a
row; other keys are not; a restarted gateway counts the spend of the period's rows.

Key names are new in each test: with CROSSBAR_TEST_SHARED=1 the session's gateway keeps spend
in its redis-server, which outlives a test's database.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import httpx
import pytest
from django.core.management import call_command

from accounting.models import Request
from tests.helpers.asking import issue, post
from tests.helpers.fleet import add_host, add_route
from tests.helpers.gateway import running_gateway
from tests.helpers.observe import series
from tests.helpers.waits import wait_until

pytestmark = pytest.mark.django_db(transaction=True)


def named(what: str) -> str:
    return f"{what}-{uuid.uuid4().hex[:8]}"


def spent_row(client: str) -> Request:
    """The row of the client's first request, once written (its spend is counted by then)."""
    rows = Request.objects.filter(client=client, status=200)
    wait_until(rows.exists, what=f"{client}'s row")
    return rows.get()


def next_midnight(now: datetime) -> datetime:
    return now.replace(hour=0, minute=0, second=0, microsecond=0) + timedelta(days=1)


def next_month(now: datetime) -> datetime:
    first = now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    return (first + timedelta(days=32)).replace(day=1)


def refused_until(response: httpx.Response, reset: datetime, asked: datetime) -> None:
    """`response` is the budget's refusal, saying when it resets (ISO, UTC) and how long."""
    assert response.status_code == 429
    error = response.json()["error"]
    assert error["code"] == "budget_exhausted"
    assert reset.strftime("%Y-%m-%dT%H:%M:%SZ") in error["message"]
    wait = (reset - asked).total_seconds()
    assert wait - 60 <= int(response.headers["retry-after"]) <= wait + 1


def test_a_key_past_its_daily_budget_gets_429_until_midnight_utc_and_another_key_does_not(
    gateway, fake
):
    add_route("chat", [add_host("gpu1", fake.url)])
    spender, other = named("spender"), named("other")
    key = issue(spender, tokens_per_day=10)
    other_key = issue(other, tokens_per_day=10_000)
    gateway.sync()

    first = post(gateway, key=key, max_tokens=12)
    row = spent_row(spender)
    asked = datetime.now(UTC)
    refused = post(gateway, key=key)
    unaffected = post(gateway, key=other_key)

    assert first.status_code == 200
    assert (row.prompt_tokens or 0) + (row.completion_tokens or 0) >= 10
    refused_until(refused, next_midnight(asked), asked)
    assert "10 tokens per day" in refused.json()["error"]["message"]
    assert unaffected.status_code == 200
    refusal = Request.objects.filter(client=spender, status=429)
    wait_until(refusal.exists, what="the refusal's row")
    assert refusal.get().code == "budget_exhausted"


def test_a_request_under_the_budget_runs_to_its_end_and_may_overshoot_it(gateway, fake):
    add_route("chat", [add_host("gpu1", fake.url)])
    spender = named("spender")
    key = issue(spender, tokens_per_day=30)
    gateway.sync()

    first = post(gateway, key=key, max_tokens=40)  # admitted with 0 spent: runs whole
    row = spent_row(spender)

    assert first.status_code == 200 and row.completion_tokens == 40
    assert post(gateway, key=key).status_code == 429


def test_a_key_past_its_monthly_budget_gets_429_until_the_first_of_next_month(gateway, fake):
    add_route("chat", [add_host("gpu1", fake.url)])
    spender = named("spender")
    key = issue(spender, tokens_per_day=1_000_000, tokens_per_month=5)
    gateway.sync()

    assert post(gateway, key=key).status_code == 200
    spent_row(spender)
    asked = datetime.now(UTC)
    refused = post(gateway, key=key)

    refused_until(refused, next_month(asked), asked)
    assert "5 tokens per month" in refused.json()["error"]["message"]


def test_the_metrics_and_the_report_show_each_keys_tokens(gateway, fake):
    add_route("chat", [add_host("gpu1", fake.url)])
    spender = named("spender")
    key = issue(spender, tokens_per_day=1_000_000)
    gateway.sync()

    post(gateway, key=key, max_tokens=7)
    row = spent_row(spender)
    tokens = (row.prompt_tokens or 0) + (row.completion_tokens or 0)
    Request.objects.exclude(client=spender).delete()
    report = call_command("requests_report", "--by", "client", "--format", "csv")

    name = "crossbar_client_tokens_total"
    assert series(gateway.url, [name])[f"{name}[('client', '{spender}')]"] == tokens
    header, line = report.splitlines()
    assert dict(zip(header.split(","), line.split(","), strict=True))["tokens"] == str(tokens)


def test_a_restarted_gateway_counts_the_spend_of_todays_rows_but_not_yesterdays(
    tmp_path, fake, django_db_setup
):
    add_route("chat", [add_host("gpu1", fake.url)])
    now = datetime.now(UTC)
    yesterday = now - timedelta(days=1)
    spent, fresh = named("spent"), named("fresh")
    spent_key = issue(spent, tokens_per_day=100)
    fresh_key = issue(fresh, tokens_per_day=100)
    common = {"route": "chat", "queued_ms": 0, "total_ms": 1, "status": 200}
    Request.objects.bulk_create(
        [
            Request(client=spent, started=now, prompt_tokens=60, completion_tokens=40, **common),
            Request(
                client=fresh, started=yesterday, prompt_tokens=600, completion_tokens=400, **common
            ),
        ]
    )

    with running_gateway(tmp_path) as restarted:
        restarted.sync()
        refused = post(restarted, key=spent_key)
        served = post(restarted, key=fresh_key)

    assert refused.status_code == 429
    assert refused.json()["error"]["code"] == "budget_exhausted"
    assert served.status_code == 200


def test_a_key_added_to_a_running_gateway_counts_the_spend_of_its_names_rows(gateway, fake):
    add_route("chat", [add_host("gpu1", fake.url)])
    gateway.sync()
    spender = named("spender")
    Request.objects.create(
        client=spender, route="chat", started=datetime.now(UTC), queued_ms=0, total_ms=1,
        status=200, prompt_tokens=30, completion_tokens=20,
    )  # fmt: skip
    key = issue(spender, tokens_per_day=50)  # a key enabled again, under the same name
    gateway.sync()

    refused = post(gateway, key=key)

    assert refused.status_code == 429
    assert "50 tokens per day (UTC), 50 spent" in refused.json()["error"]["message"]
