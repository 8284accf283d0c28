"""Client keys' token spend, read from the request rows: what budgets count.

A request spends its prompt tokens (the cached part included) plus its generated tokens; an
unknown count spends nothing. Days and months are UTC, as the gateway's budgets
(routing/core/budgets.py) count them. The gateway reads `spend_by_client` when it starts (off
the request path) so a restart keeps the spend; the admin shows `tokens_since` per key.
"""

from __future__ import annotations

from datetime import UTC, datetime

from django.db.models import BigIntegerField, F, Q, QuerySet, Subquery, Sum, Value
from django.db.models.functions import Coalesce

from accounting.models import Request

# A row's tokens as a budget counts them.
TOKENS = Coalesce(F("prompt_tokens"), Value(0)) + Coalesce(F("completion_tokens"), Value(0))


def spend_periods(now: datetime) -> tuple[datetime, datetime]:
    """The starts of the UTC day and the UTC month `now` is in."""
    day = now.astimezone(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    return day, day.replace(day=1)


def tokens_since(rows: QuerySet[Request], since: datetime) -> Coalesce:
    """An annotation: the tokens of `rows` (one client's, by `OuterRef`) started since `since`."""
    spent = rows.filter(started__gte=since).values("client").annotate(n=Sum(TOKENS))
    return Coalesce(Subquery(spent.values("n"), output_field=BigIntegerField()), Value(0))


def spent_of(spent: int, budget: int | None) -> str:
    return f"{spent:,}" if budget is None else f"{spent:,} of {budget:,}"


def spend_by_client(names: set[str], now: datetime) -> dict[str, tuple[int, int]]:
    """{name: (tokens today, tokens this month)} of the named clients, from their rows (UTC).

    Sync: call it from a thread (`sync_to_async`). Rows have their start only: a request
    running across midnight counts in the day it started here, in the day it ended in a
    running gateway's ledger."""
    if not names:
        return {}
    day, month = spend_periods(now)
    rows = Request.objects.filter(client__in=names, started__gte=month)
    totals = rows.values("client").annotate(
        month=Sum(TOKENS), day=Sum(TOKENS, filter=Q(started__gte=day))
    )
    return {row["client"]: (row["day"] or 0, row["month"] or 0) for row in totals}
