"""Client keys' token budgets kept in Redis: one ledger for every gateway process.

`RedisClients` of two processes against a real redis-server, then two gateway processes over
real sockets: a key that spent its budget through one is refused at once by the other.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import pytest

from accounting.models import Request
from routing.core.budgets import Spend
from routing.core.clients import ClientSpec
from routing.core.errors import BudgetExhausted
from routing.shared.clients import RedisClients
from routing.shared.state import Shared
from tests.helpers.asking import issue, post
from tests.helpers.fleet import add_host, add_route
from tests.helpers.gateway import running_gateway
from tests.helpers.waits import wait_until


def _month_end_ahead() -> datetime:
    """23:00 UTC on the last day of next month: an hour before a day and a month reset, and
    late enough that the counts' expiries (set on Redis's clock) are all ahead."""
    first = datetime.now(UTC).replace(day=1, hour=23, minute=0, second=0, microsecond=0)
    after_next = (first + timedelta(days=62)).replace(day=1)
    return after_next - timedelta(days=1)


NOW = _month_end_ahead()
RESET = (NOW + timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M:%SZ")


@contextlib.asynccontextmanager
async def two(url: str, now: datetime = NOW) -> AsyncIterator[tuple[RedisClients, ...]]:
    shared = [Shared(url), Shared(url)]
    gates = tuple(RedisClients(s, now=lambda: now) for s in shared)
    for s in shared:
        await s.start()
    try:
        yield gates
    finally:
        for s in shared:
            await s.aclose()


async def test_tokens_spent_through_one_process_refuse_the_key_on_the_other(redis_url):
    spec = ClientSpec("team", tokens_per_day=10)
    other = ClientSpec("others", tokens_per_day=10)
    async with two(redis_url) as (a, b):
        first = await a.admit(spec, "chat")
        await (await b.admit(spec, "chat")).arelease(4)  # 4 spent: under the budget
        await first.arelease(7)  # 11: over it

        with pytest.raises(BudgetExhausted) as refused:
            await b.admit(spec, "chat")
        await (await a.admit(other, "chat")).arelease()

    assert refused.value.status == 429 and refused.value.code == "budget_exhausted"
    assert refused.value.retry_after == 3600
    assert "10 tokens per day (UTC), 11 spent" in refused.value.message
    assert RESET in refused.value.message


async def test_a_new_day_starts_from_nothing_but_the_month_keeps_counting(redis_url):
    spec = ClientSpec("team", tokens_per_day=10, tokens_per_month=25)
    async with two(redis_url, NOW - timedelta(days=2)) as (a, _):
        await (await a.admit(spec, "chat")).arelease(20)
    async with two(redis_url, NOW - timedelta(days=1)) as (a, b):
        await (await a.admit(spec, "chat")).arelease(5)  # the new day admits; 25 this month
        with pytest.raises(BudgetExhausted) as refused:
            await b.admit(spec, "chat")

    assert "25 tokens per month (UTC), 25 spent" in refused.value.message


async def test_the_spend_seeded_from_rows_counts_only_where_redis_has_none(redis_url):
    spec = ClientSpec("team", tokens_per_day=100)
    async with two(redis_url) as (a, b):
        await a.seed({"team": Spend(day=90, month=90), "idle": Spend(1, 1)}, NOW)
        await (await b.admit(spec, "chat")).arelease(10)  # 100: the budget is spent
        await b.seed({"team": Spend(day=0, month=0)}, NOW)  # a second start changes nothing

        with pytest.raises(BudgetExhausted):
            await a.admit(spec, "chat")


@pytest.mark.django_db(transaction=True)
def test_a_key_that_spent_its_budget_through_one_gateway_is_refused_at_once_by_the_other(
    tmp_path, redis_url, fake
):
    add_route("chat", [add_host("gpu1", fake.url)])
    key = issue("team-a", tokens_per_day=5)
    other = issue("team-b", tokens_per_day=5)
    env = {"CROSSBAR_REDIS_URL": redis_url}
    with running_gateway(tmp_path, **env) as first, running_gateway(tmp_path, **env) as second:
        first.sync()
        second.sync()
        spent = post(first, key=key)
        # Its row is written once the request has ended and its spend was sent to Redis.
        wait_until(Request.objects.filter(client="team-a").exists, what="the row")
        wait_until(lambda: post(first, key=key).status_code == 429, what="the spend in Redis")
        refused = post(second, key=key)
        unaffected = post(second, key=other)

    assert spent.status_code == 200
    assert refused.status_code == 429
    assert refused.json()["error"]["code"] == "budget_exhausted"
    assert int(refused.headers["retry-after"]) >= 1
    assert unaffected.status_code == 200


@pytest.mark.django_db(transaction=True)
def test_a_gateway_started_on_an_empty_redis_counts_the_spend_of_todays_rows(
    tmp_path, redis_url, fake
):
    add_route("chat", [add_host("gpu1", fake.url)])
    key = issue("team-a", tokens_per_day=100)
    Request.objects.create(
        client="team-a", route="chat", started=datetime.now(UTC), queued_ms=0, total_ms=1,
        status=200, prompt_tokens=70, completion_tokens=30,
    )  # fmt: skip

    with running_gateway(tmp_path, CROSSBAR_REDIS_URL=redis_url) as gateway:
        gateway.sync()
        refused = post(gateway, key=key)

    assert refused.status_code == 429
    assert refused.json()["error"]["code"] == "budget_exhausted"
