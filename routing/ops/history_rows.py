"""The dashboard's history read from the Request table: per-step aggregates of the rows
(`read_steps`), and the 24-hour view's minutes kept from them (`DatabaseHistory`).

A table row counts in the step it finished (`started` + `total_ms`), as the rings count a
request, so every window counts a request in the same step. Queue depth and requests in flight
are the step's means from the rows' queued and running time (Little's law). Everything here
blocks on the database: call it in a worker thread, never on the event loop.
"""

from __future__ import annotations

import math
import threading
import time
from datetime import UTC, datetime
from typing import Any

from django.db.models import Count, F, Func, IntegerField, Q, QuerySet, Sum

from accounting.report import CACHE_LOST_BLOCKS, COLD_TURN_SHARE
from routing.ops.history_steps import TTFB_BOUNDS_MS, WINDOWS, Stats, error_label

DB_REFRESH = 60.0  # seconds a 24-hour read of the Request table is kept
DB_FULL_RELOAD = 3600.0  # seconds between full 24-hour loads (catching rows written late)
LONGEST_REQUEST = 3600  # seconds: a row started longer before a window than this is not read


class DatabaseHistory:
    """Per-minute aggregates of the Request rows that finished between 24 hours and an hour ago.

    The last hour of the 24-hour view is the hour ring's (`History.day_points`), so only minutes
    older than an hour are read here: their rows are written by then, and a minute once read
    does not change, so each refresh asks only for the minutes that aged past the hour since the
    last one, and a full read every `DB_FULL_RELOAD` seconds catches rows written late (a
    database that was down, a recorder's backlog).
    """

    def __init__(self, clock: Any = time.time) -> None:
        self._clock = clock
        self._lock = threading.Lock()  # one query at a time; a second caller finds it fresh
        self._minutes: dict[int, dict[str, Stats]] = {}
        self._until: int | None = None  # the minutes before this one are read; None: none yet
        self._loaded_at = -math.inf
        self._full_at = -math.inf
        self.version = 0  # bumped on every refresh
        self.changed_from = 0  # the first minute the last refresh may have changed

    @property
    def stale(self) -> bool:
        return self._clock() - self._loaded_at >= DB_REFRESH

    async def refresh(self, force: bool = False) -> None:
        """Read what changed from the database, unless the last read is recent enough."""
        from channels.db import database_sync_to_async

        # Not thread_sensitive: a slow read must not hold up the thread the runtime's own
        # configuration reloads and the admin's views run in.
        await database_sync_to_async(self._refresh_sync, thread_sensitive=False)(force)

    def _refresh_sync(self, force: bool) -> None:
        with self._lock:
            now = self._clock()
            if not force and now - self._loaded_at < DB_REFRESH:
                return
            until = int((now - WINDOWS["1h"].seconds) // 60) * 60
            start = int(now // 60) * 60 + 60 - WINDOWS["24h"].seconds
            full = self._until is None or force or now - self._full_at >= DB_FULL_RELOAD
            first = start if self._until is None or full else max(start, min(self._until, until))
            fresh = read_steps(first, until, 60)
            minutes = {t: by_host for t, by_host in self._minutes.items() if start <= t < first}
            minutes.update(fresh)
            self._minutes = minutes
            self._until = until
            self._loaded_at = now
            if full:
                self._full_at = now
            self.changed_from = first
            self.version += 1

    def read(self) -> tuple[dict[int, dict[str, Stats]], int | None]:
        """The minutes as last read, and the minute they reach to (None before the first read).

        The Stats are shared: read them, never change them."""
        with self._lock:
            return dict(self._minutes), self._until


def read_steps(
    start: int, end: int, step: int, started_before: float | None = None
) -> dict[int, dict[str, Stats]]:
    """{step start: {host: Stats}} for the rows that finished in [start, end), by epoch seconds.

    A row finishes at `started` + `total_ms`, the moment the rings count a request, so every
    window counts a request in the same step. Only rows started at most `LONGEST_REQUEST`
    seconds before `start` are read (the index is on `started`), and with `started_before`
    only those started before that moment. `start` and `end` are multiples of `step`.

    Three aggregate queries, so the database does the counting and a day of rows is never read
    row by row: counts and sums per (step, host); TTFB buckets per step; errors per
    (step, code, status). Buckets and codes are the fleet's, so they go with the no-host entry
    (""). Queue depth and requests in flight are the step's means from the rows' queued and
    running time (Little's law), in the step each row finished.
    """
    from accounting.models import Request

    rows = Request.objects.filter(
        started__gte=datetime.fromtimestamp(start - LONGEST_REQUEST, UTC),
        started__lt=datetime.fromtimestamp(end, UTC),
    )
    if started_before is not None:
        rows = rows.filter(started__lt=datetime.fromtimestamp(started_before, UTC))
    rows = (
        rows.order_by()
        .annotate(step=_FinishedStep(step))
        .filter(step__gte=start // step, step__lt=end // step)
    )
    steps: dict[int, dict[str, Stats]] = {}
    for row in rows.values("step", "host").annotate(**_sums_per_host()):
        steps.setdefault(row["step"] * step, {})[row["host"]] = _host_stats(row, step)
    _add_fleet_ttfb_and_codes(rows, step, steps)
    return steps


def _sums_per_host() -> dict[str, Any]:
    """What `read_steps` sums per (step, host), as `annotate` arguments."""
    both = Q(prompt_tokens__isnull=False, cached_tokens__isnull=False)
    return {
        "n": Count("pk"),
        "c4xx": Count("pk", filter=Q(status__gte=400, status__lt=499)),
        "c5xx": Count("pk", filter=Q(status__gte=500)),
        "c499": Count("pk", filter=Q(status=499)),
        "tokens": Sum("completion_tokens"),
        "prompt": Sum("prompt_tokens", filter=both),
        "cached": Sum("cached_tokens", filter=both),
        "cold": Count(
            "pk",
            filter=Q(
                lease="reused",
                prompt_tokens__gt=0,
                cached_tokens__lt=F("prompt_tokens") * COLD_TURN_SHARE,
            ),
        ),
        # is_cache_lost in SQL: a comparison with an unknown (NULL) figure is never true, so a
        # row without both figures is not counted, on SQLite and PostgreSQL alike.
        "cache_lost": Count(
            "pk",
            filter=Q(predicted_cached_blocks__gt=F("reported_cached_blocks") + CACHE_LOST_BLOCKS),
        ),
        "busy_ms": Sum(F("total_ms") - F("queued_ms")),
        "queued_ms": Sum("queued_ms"),
    }


def _host_stats(row: dict[str, Any], step: int) -> Stats:
    """One host's Stats in one step, from its row of `_sums_per_host`."""
    stats = Stats()
    errors = row["c4xx"] + row["c5xx"] + row["c499"]
    stats.outcomes = [row["n"] - errors, row["c4xx"], row["c5xx"], row["c499"]]
    stats.tokens = row["tokens"] or 0
    stats.prompt = row["prompt"] or 0
    stats.cached = row["cached"] or 0
    stats.cold = row["cold"]
    stats.cache_lost = row["cache_lost"]
    # Little's law: the step's mean number running (or waiting) is their time over its length.
    stats.flight_sum = (row["busy_ms"] or 0) / (step * 1000)
    stats.queued_sum = (row["queued_ms"] or 0) / (step * 1000)
    stats.samples = 1
    return stats


def _add_fleet_ttfb_and_codes(
    rows: QuerySet[Any], step: int, steps: dict[int, dict[str, Stats]]
) -> None:
    """Add each step's TTFB buckets and error codes to its no-host entry: they are the
    fleet's."""

    def fleet(index: int) -> Stats:
        by_host = steps.setdefault(index * step, {})
        return by_host.get("") or by_host.setdefault("", Stats())

    heads = (
        rows.filter(ttfb_ms__isnull=False)
        .annotate(ttfb_bucket=_ttfb_bucket(0, len(TTFB_BOUNDS_MS)))
        .values("step", "ttfb_bucket")
        .annotate(n=Count("pk"))
    )
    for row in heads:
        fleet(row["step"]).ttfb[row["ttfb_bucket"]] = row["n"]
    failed = (
        rows.filter(Q(status__gte=400) | ~Q(code=""))
        .values("step", "code", "status")
        .annotate(n=Count("pk"))
    )
    for row in failed:
        if label := error_label(row["code"], row["status"]):
            codes = fleet(row["step"]).codes
            codes[label] = codes.get(label, 0) + row["n"]


class _FinishedStep(Func):
    """The step a row finished in (`started` + `total_ms`), counted from the epoch, computed by
    the database.

    Not TruncMinute and friends: on SQLite that is a Python function called for every row,
    which made a day of rows take seconds longer to read.
    """

    output_field = IntegerField()

    def __init__(self, step: int) -> None:
        super().__init__(F("started"), F("total_ms"))
        self.step = step

    def as_sql(  # type: ignore[override]  # a fixed template: no function, joiner or extras
        self, compiler: Any, connection: Any, **extra: Any
    ) -> tuple[str, tuple[Any, ...]]:
        started, total = (compiler.compile(e) for e in self.get_source_expressions())
        if connection.vendor == "sqlite":
            # julianday() is in days; 2440587.5 is the epoch's; the half millisecond keeps a
            # time on a step's start from landing in the step before by a rounding error.
            sql = (
                f"CAST((julianday({started[0]}) - 2440587.5) * 86400.0 + {total[0]} / 1000.0"
                f" + 0.0005 AS INTEGER) / {int(self.step)}"
            )
        else:
            sql = (
                f"CAST(FLOOR((EXTRACT(EPOCH FROM {started[0]}) + {total[0]} / 1000.0)"
                f" / {int(self.step)}) AS INTEGER)"
            )
        return sql, (*started[1], *total[1])


def _ttfb_bucket(low: int, high: int) -> Any:
    """The TTFB bucket of a row (`bisect_left` on `TTFB_BOUNDS_MS`), as a binary search in SQL:
    six comparisons per row instead of one per bucket."""
    from django.db.models import Case, Value, When

    if low == high:
        return Value(low)
    middle = (low + high) // 2
    return Case(
        When(ttfb_ms__lte=TTFB_BOUNDS_MS[middle], then=_ttfb_bucket(low, middle)),
        default=_ttfb_bucket(middle + 1, high),
        output_field=IntegerField(),
    )
