"""Client keys' token budgets: how many tokens a key may spend per UTC day and per UTC month.

A request spends its prompt tokens (the cached part included, as its row counts them) plus
its generated tokens, counted when it ends, in the period it ends in. A budget is checked when
a request is admitted: a key whose spend has reached a budget is refused until the period
resets (`BudgetExhausted`, with the reset); a request admitted under it runs to its end, so a
key may overshoot a budget by what its requests in flight spend.

`Ledger` keeps the spend of one process (`ClientGate`); with shared state, Redis keeps one
ledger for every process (routing/shared/clients.py), under the same period names
(`Period.name`). Both are seeded from the period's rows when the gateway starts
(`routing.runtime`), so a restart does not give a key its budget back.

Pure: no I/O; the wall clock is the caller's (`now`, an aware datetime). Not thread-safe.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from routing.core.errors import BudgetExhausted

__all__ = ["Ledger", "Period", "Spend", "exhausted", "periods"]


@dataclass(slots=True, frozen=True)
class Period:
    """One UTC day or month: `kind` ("day" or "month"), its `name` ("2026-12-06", "2026-12")
    and the instants it starts and ends (aware, UTC)."""

    kind: str
    name: str
    starts: datetime
    ends: datetime


def periods(now: datetime) -> tuple[Period, Period]:
    """The UTC day and the UTC month `now` is in."""
    now = now.astimezone(UTC)
    day = now.replace(hour=0, minute=0, second=0, microsecond=0)
    month = day.replace(day=1)
    next_month = (month + timedelta(days=32)).replace(day=1)
    return (
        Period("day", day.strftime("%Y-%m-%d"), day, day + timedelta(days=1)),
        Period("month", month.strftime("%Y-%m"), month, next_month),
    )


@dataclass(slots=True, frozen=True)
class Spend:
    """A key's tokens spent in the current day and month."""

    day: int = 0
    month: int = 0


def exhausted(
    per_day: int | None, per_month: int | None, spend: Spend, now: datetime
) -> BudgetExhausted | None:
    """The refusal of a key with these budgets and this spend, or None while it is under both.

    When both are spent, the refusal names the one that resets last: retrying at the first
    reset would only be refused again."""
    day, month = periods(now)
    over = [
        (period, limit)
        for period, limit, spent in ((month, per_month, spend.month), (day, per_day, spend.day))
        if limit is not None and spent >= limit
    ]
    if not over:
        return None
    period, limit = over[0]
    resets = period.ends.strftime("%Y-%m-%dT%H:%M:%SZ")
    return BudgetExhausted(
        f"token budget exhausted for this API key: {limit} tokens per {period.kind} "
        f"(UTC), {spend.month if period.kind == 'month' else spend.day} spent; "
        f"it resets at {resets}",
        retry_after=max(1, math.ceil((period.ends - now).total_seconds())),
        detail={"budget": period.kind, "limit": limit, "resets": resets},
    )


class Ledger:
    """The tokens each key spent in the current UTC day and month, in this process."""

    def __init__(self) -> None:
        self._spent: dict[str, tuple[str, int, str, int]] = {}  # name: day, n, month, n

    def spend(self, name: str, now: datetime) -> Spend:
        """What `name` spent in the day and month `now` is in."""
        day, month = periods(now)
        kept = self._spent.get(name)
        if kept is None:
            return Spend()
        return Spend(kept[1] if kept[0] == day.name else 0, kept[3] if kept[2] == month.name else 0)

    def add(self, name: str, tokens: int, now: datetime) -> None:
        """Count `tokens` spent by `name` at `now` (a new day or month starts from 0)."""
        day, month = periods(now)
        spend = self.spend(name, now)
        self._spent[name] = (day.name, spend.day + tokens, month.name, spend.month + tokens)

    def seed(self, spends: Mapping[str, Spend], now: datetime) -> None:
        """Add the spend of the named keys in the period of `now`, read from its rows.

        Added, not set: a request of a key configured while its rows were read may have ended
        meanwhile, and its tokens are not to be lost (at worst they count twice, once)."""
        day, month = periods(now)
        for name, seeded in spends.items():
            spend = self.spend(name, now)
            self._spent[name] = (
                day.name, spend.day + seeded.day, month.name, spend.month + seeded.month
            )  # fmt: skip

    def keep_only(self, names: set[str]) -> None:
        """Forget keys not among `names` (removed from the configuration)."""
        for name in [name for name in self._spent if name not in names]:
            del self._spent[name]
