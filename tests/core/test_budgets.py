"""Token budgets as pure functions: UTC days and months, the refusal, the ledger, the gate."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest

from accounting.keys import hash_key
from routing.core.budgets import Ledger, Spend, exhausted, periods
from routing.core.clients import ClientGate, ClientSpec
from routing.core.errors import BudgetExhausted, answer_for

NEW_YEARS_EVE = datetime(2026, 12, 31, 23, 59, 30, tzinfo=UTC)


def test_days_and_months_are_utc_whatever_the_clocks_zone() -> None:
    in_tokyo = NEW_YEARS_EVE.astimezone(timezone(timedelta(hours=9)))  # already 1 January

    day, month = periods(in_tokyo)

    assert (day.name, month.name) == ("2026-12-31", "2026-12")
    assert day.starts == datetime(2026, 12, 31, tzinfo=UTC)
    assert day.ends == month.ends == datetime(2027, 1, 1, tzinfo=UTC)
    assert periods(datetime(2027, 2, 28, 12, tzinfo=UTC))[1].ends == datetime(
        2027, 3, 1, tzinfo=UTC
    )


def test_a_key_is_refused_once_its_spend_reaches_the_budget_not_before() -> None:
    assert exhausted(10, None, Spend(day=9, month=9), NEW_YEARS_EVE) is None
    assert exhausted(None, None, Spend(day=99, month=99), NEW_YEARS_EVE) is None

    refused = exhausted(10, None, Spend(day=10, month=10), NEW_YEARS_EVE)

    assert isinstance(refused, BudgetExhausted)
    assert refused.retry_after == 30
    answer = answer_for(refused)
    assert (answer.status, answer.code) == (429, "budget_exhausted")
    assert answer.message == (
        "token budget exhausted for this API key: 10 tokens per day (UTC), 10 spent; "
        "it resets at 2027-01-01T00:00:00Z"
    )
    assert refused.detail == {"budget": "day", "limit": 10, "resets": "2027-01-01T00:00:00Z"}


def test_with_both_budgets_spent_the_refusal_names_the_one_that_resets_last() -> None:
    mid_month = datetime(2026, 12, 15, 12, tzinfo=UTC)

    both = exhausted(10, 100, Spend(day=10, month=100), mid_month)
    day_only = exhausted(10, 100, Spend(day=10, month=50), mid_month)

    assert both is not None and both.detail["budget"] == "month"
    assert both.retry_after == int((datetime(2027, 1, 1, tzinfo=UTC) - mid_month).total_seconds())
    assert day_only is not None and day_only.retry_after == 12 * 3600


def test_the_ledger_starts_each_day_and_month_from_nothing() -> None:
    ledger = Ledger()
    ledger.add("team", 7, NEW_YEARS_EVE - timedelta(days=1))
    ledger.add("team", 5, NEW_YEARS_EVE)

    assert ledger.spend("team", NEW_YEARS_EVE) == Spend(day=5, month=12)
    assert ledger.spend("team", NEW_YEARS_EVE + timedelta(seconds=30)) == Spend(0, 0)
    assert ledger.spend("other", NEW_YEARS_EVE) == Spend(0, 0)


def test_seeding_adds_the_rows_spend_to_what_ended_meanwhile() -> None:
    ledger = Ledger()
    ledger.add("team", 3, NEW_YEARS_EVE)

    ledger.seed({"team": Spend(day=10, month=40), "idle": Spend(1, 2)}, NEW_YEARS_EVE)
    ledger.keep_only({"team"})

    assert ledger.spend("team", NEW_YEARS_EVE) == Spend(day=13, month=43)
    assert ledger.spend("idle", NEW_YEARS_EVE) == Spend(0, 0)


def test_the_gate_refuses_a_key_whose_released_requests_spent_its_budget() -> None:
    now = [NEW_YEARS_EVE - timedelta(hours=1)]
    gate = ClientGate(now=lambda: now[0])
    spec = ClientSpec("team", tokens_per_day=100, max_concurrent=5)
    other = ClientSpec("other", tokens_per_day=100)
    gate.configure({hash_key("a"): spec, hash_key("b"): other})

    running = gate.admit(spec, "chat")
    gate.admit(spec, "chat").release(60)
    second_running = gate.admit(spec, "chat")  # 60 spent: still under
    running.release(40)
    running.release(40)  # a second release spends nothing more

    with pytest.raises(BudgetExhausted) as refused:
        gate.admit(spec, "chat")
    gate.admit(other, "chat")
    second_running.release(1)
    assert refused.value.retry_after == 3630  # to 00:00 UTC
    assert gate.in_flight("team") == 0
    now[0] = NEW_YEARS_EVE + timedelta(seconds=31)  # a new day, a new month
    gate.admit(spec, "chat")
