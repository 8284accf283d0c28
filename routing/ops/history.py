"""The dashboard's history: rings of per-step aggregates in memory, and the Request table beyond.

Every finished request is counted once (`observe`, from `routing.ops.metrics.observe`, in
whichever thread finishes it) into the step of the moment it finished, and every second the
sampler adds each host's queue depth and requests in flight (`sample`). Rates are per second:
a step's counts divided by its length.

A window is served at one resolution from one ring: the last 5 minutes in 5-second steps,
the last hour in 30-second steps. A ring holds its window (the hour ring ten minutes more, for
the 24 hours), so reading one is a copy of at most 140 steps, never a merge of thousands of
seconds, and the event loop is not held up when a dashboard opens. Memory is bounded by steps
x hosts x distinct error codes.

A restart does not empty the rings: once per process (`History.rebuild`, in a worker thread,
from the first dashboard, scrape or request on) they are filled from the rows of the requests
that started before the process did, in the step each finished, with three grouped queries.
Those steps have no queue depth or in-flight figures: nothing sampled them.

The 24 hours come from the Request table, in minutes (`DatabaseHistory`), up to an hour ago,
and from the hour ring after that (`History.day_points`): the last hour of the 24 hours is the
1-hour window's count, the 1-hour window holds the 5 minutes' steps, so a shorter window never
counts more than a longer one. A table row counts in the minute it finished, as in the rings;
queue depth and requests in flight are the minute's means from the rows' queued and running
time (Little's law). The table is read in a worker thread, kept for `DB_REFRESH` seconds, and
each refresh asks only for the minutes that became an hour old since the last one.

TTFB percentiles are read from counts in fixed buckets (the R10 series, ten per decade, 1 ms to
800 s) with linear interpolation inside a bucket, as Prometheus' `histogram_quantile` does: a
percentile is never more than one bucket (26%) off, and the memory per step stays small.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import math
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from django.db.models import F, Func, IntegerField

from accounting.recorder import RequestRecord
from accounting.report import CACHE_LOST_BLOCKS, COLD_TURN_SHARE, is_cache_lost, is_cold_turn
from hosts.live import HostLoad
from routing.runtime import Runtime

log = logging.getLogger("crossbar.dashboard")

OUTCOMES = ("2xx", "4xx", "5xx", "499")
_R10 = (1.0, 1.25, 1.6, 2.0, 2.5, 3.15, 4.0, 5.0, 6.3, 8.0)
TTFB_BOUNDS_MS: tuple[float, ...] = tuple(
    round(mantissa * 10**decade, 2) for decade in range(6) for mantissa in _R10
)
SAMPLE_EVERY = 1.0  # seconds between samples of queue depth and in flight
CARD_SECONDS = 300  # the per-host cards cover the last 5 minutes
DB_REFRESH = 60.0  # seconds a 24-hour read of the Request table is kept
DB_FULL_RELOAD = 3600.0  # seconds between full 24-hour loads (catching rows written late)
HOUR_RING_SPARE = 600  # seconds the hour ring keeps past its hour: where the 24 hours take over
LONGEST_REQUEST = 3600  # seconds: a row started longer before a window than this is not read


@dataclass(slots=True, frozen=True)
class Window:
    name: str
    seconds: int
    step: int  # seconds per point


WINDOWS: dict[str, Window] = {
    "5m": Window("5m", 300, 5),
    "1h": Window("1h", 3600, 30),
    "24h": Window("24h", 86400, 60),
}
RING_WINDOWS = ("5m", "1h")
# A ring's steps, oldest first: (step start, {host: Stats}); "routes" keys them by route.
Steps = list[tuple[int, dict[str, "Stats"]]]
# The refusals that are a route's, not a host's: nothing free, nothing usable, its pinned host
# down. Their rows name no host.
ROUTE_REFUSALS = frozenset({"queue_full", "no_healthy_host", "pinned_host_down"})


def outcome(status: int) -> str:
    """The outcome class a status counts in: 499 (the client left) is apart from the 4xx."""
    if status == 499:
        return "499"
    if status >= 500:
        return "5xx"
    if status >= 400:
        return "4xx"
    return "2xx"


def error_label(code: str, status: int) -> str:
    """What an error is counted as: its code, or `http_<status>` when it has none."""
    if code:
        return code
    return f"http_{status}" if status >= 400 else ""


class Stats:
    """What one host did in one step; mutable, merged into larger spans."""

    __slots__ = (
        "outcomes", "codes", "ttfb", "tokens", "prompt", "cached", "cold", "cache_lost",
        "refused", "flight_sum", "queued_sum", "samples", "queued_peak",
    )  # fmt: skip

    def __init__(self) -> None:
        self.outcomes = [0, 0, 0, 0]  # in the order of OUTCOMES
        self.codes: dict[str, int] = {}
        self.ttfb: dict[int, int] = {}  # bucket index -> count
        self.tokens = 0  # completion tokens
        self.prompt = 0  # prompt tokens of rows whose cached count is known too
        self.cached = 0
        self.cold = 0
        self.cache_lost = 0  # answers whose host held less than the prefix index predicted
        self.refused = 0  # the route's queue_full refusals while this host was full
        self.flight_sum = 0.0
        self.queued_sum = 0.0
        self.samples = 0
        self.queued_peak: float | None = None

    @property
    def requests(self) -> int:
        return sum(self.outcomes)

    def count(
        self,
        status: int,
        code: str,
        ttfb_ms: int | None,
        completion: int | None,
        prompt: int | None,
        cached: int | None,
        cold: bool,
        cache_lost: bool,
    ) -> None:
        self.outcomes[OUTCOMES.index(outcome(status))] += 1
        if label := error_label(code, status):
            self.codes[label] = self.codes.get(label, 0) + 1
        if ttfb_ms is not None:
            index = bisect.bisect_left(TTFB_BOUNDS_MS, ttfb_ms)
            self.ttfb[index] = self.ttfb.get(index, 0) + 1
        if completion:
            self.tokens += completion
        if prompt is not None and cached is not None:
            self.prompt += prompt
            self.cached += cached
        if cold:
            self.cold += 1
        if cache_lost:
            self.cache_lost += 1

    def merge(self, other: Stats) -> None:
        """Add `other`'s counts and its samples of in flight and queue depth."""
        self.merge_counts(other)
        self.flight_sum += other.flight_sum
        self.queued_sum += other.queued_sum
        self.samples += other.samples
        if other.queued_peak is not None:
            self.queued_peak = max(self.queued_peak or 0.0, other.queued_peak)

    def merge_counts(self, other: Stats) -> None:
        """Add `other`'s requests, errors, TTFBs and tokens; not its samples."""
        for i, n in enumerate(other.outcomes):
            self.outcomes[i] += n
        for label, n in other.codes.items():
            self.codes[label] = self.codes.get(label, 0) + n
        for index, n in other.ttfb.items():
            self.ttfb[index] = self.ttfb.get(index, 0) + n
        self.tokens += other.tokens
        self.prompt += other.prompt
        self.cached += other.cached
        self.cold += other.cold
        self.cache_lost += other.cache_lost
        self.refused += other.refused

    def ttfb_percentile(self, p: float) -> float | None:
        """The p-th percentile of TTFB in ms, from the buckets; None without a TTFB."""
        total = sum(self.ttfb.values())
        if not total:
            return None
        rank = max(1, math.ceil(p / 100 * total))
        seen = 0
        for index in sorted(self.ttfb):
            n = self.ttfb[index]
            if seen + n >= rank:
                if index >= len(TTFB_BOUNDS_MS):
                    return TTFB_BOUNDS_MS[-1]
                low = TTFB_BOUNDS_MS[index - 1] if index else 0.0
                high = TTFB_BOUNDS_MS[index]
                return round(low + (high - low) * (rank - seen) / n, 1)
            seen += n
        return TTFB_BOUNDS_MS[-1]  # not reached: the loop ends at the last rank

    @property
    def cache_hit(self) -> float | None:
        return round(self.cached / self.prompt, 4) if self.prompt else None

    @property
    def in_flight_mean(self) -> float | None:
        return round(self.flight_sum / self.samples, 2) if self.samples else None

    @property
    def queued_mean(self) -> float | None:
        return round(self.queued_sum / self.samples, 2) if self.samples else None


def _point(t: int, by_host: dict[str, Stats]) -> dict[str, Any]:
    """One chart point: the fleet's figures and each host's, JSON-ready."""
    total = Stats()
    hosts: dict[str, dict[str, Any]] = {}
    for host, stats in sorted(by_host.items()):
        total.merge(stats)
        if host:  # requests that reached no host count in the totals only
            hosts[host] = {
                "requests": stats.requests,
                "in_flight": stats.in_flight_mean,
                "queued": stats.queued_mean,
                "cache_hit": stats.cache_hit,
                "cold": stats.cold,
                "cache_lost": stats.cache_lost,
            }
    return {
        "t": t,
        "requests": dict(zip(OUTCOMES, total.outcomes, strict=True)),
        "codes": dict(sorted(total.codes.items())),
        "ttfb_p50": total.ttfb_percentile(50),
        "ttfb_p95": total.ttfb_percentile(95),
        "tokens": total.tokens,
        "cache_hit": total.cache_hit,
        "hosts": hosts,
    }


class Ring:
    """The last `length` steps of `step` seconds, each {host: Stats}. Not locked: History is."""

    def __init__(self, step: int, length: int) -> None:
        self.step = step
        self.length = length
        self._starts = [-1] * length  # the start of the step each slot holds
        self._slots: list[dict[str, Stats]] = [{} for _ in range(length)]

    def at(self, now: float, host: str) -> Stats:
        """The stats of `host` for the step that holds `now`, emptied when it is stale."""
        start = int(now // self.step) * self.step
        i = (start // self.step) % self.length
        if self._starts[i] > start:
            # Older than the ring (the wall clock stepped back): counted nowhere, rather than
            # wiping the newer step that holds the slot.
            return Stats()
        if self._starts[i] != start:
            self._starts[i] = start
            self._slots[i] = {}
        slot = self._slots[i]
        stats = slot.get(host)
        if stats is None:
            stats = slot[host] = Stats()
        return stats

    def steps(self, first: int, last: int) -> list[tuple[int, dict[str, Stats]]]:
        """Every step start from `first` to `last` (both step starts), with what it holds."""
        out = []
        for start in range(first, last + 1, self.step):
            i = (start // self.step) % self.length
            out.append((start, self._slots[i] if self._starts[i] == start else {}))
        return out


class History:
    """The in-memory rings; every method is safe from any thread.

    `began` is when this history started counting: every request the process serves starts
    later and is counted as it finishes (`observe`); those started before are the rows'
    (`rebuild`), so none is counted twice. `version` changes when the past changes (a rebuild),
    for readers to ask for their window whole again.
    """

    def __init__(self, clock: Any = time.time) -> None:
        self._clock = clock
        self.began: float = clock()
        self.version = 0
        self._lock = threading.Lock()
        self._rebuild_lock = threading.Lock()  # held through a rebuild's query: one at a time
        self._rebuilt = False
        five, hour = WINDOWS["5m"], WINDOWS["1h"]
        self._rings = {
            "5m": Ring(five.step, five.seconds // five.step + 1),
            "1h": Ring(hour.step, (hour.seconds + HOUR_RING_SPARE) // hour.step + 1),
        }
        # The routes' own refusals, {route: Stats} a step, for the dashboard's 5 minutes.
        self._routes = Ring(five.step, five.seconds // five.step + 1)
        # With shared state, turns a ring's steps as this process holds them into the whole
        # fleet's (routing/ops/dashboard_share.py); None: this process's are the fleet's.
        self.fleet_steps: Callable[[str, Steps], Steps] | None = None

    @property
    def rebuilt(self) -> bool:
        return self._rebuilt

    def rebuild(self) -> bool:
        """Count, once, the requests that started before `began` and finished within the rings'
        reach, from the Request rows; False when that was done already.

        Blocks on the database (three aggregate queries over the rows of about two hours):
        call it in a worker thread, never on the event loop. The rows say nothing of queue
        depth and in flight between samples, so the steps before `began` have none.
        """
        with self._rebuild_lock:
            if self._rebuilt:
                return False
            step = WINDOWS["5m"].step
            last = int(self._clock() // step) * step
            reach = WINDOWS["1h"].seconds + HOUR_RING_SPARE
            steps = read_steps(last - reach, last + step, step, started_before=self.began)
            with self._lock:
                for start, by_host in steps.items():
                    for host, stats in by_host.items():
                        for ring in self._rings.values():
                            ring.at(start, host).merge_counts(stats)
                self._rebuilt = True
                self.version += 1
            return True

    def observe(self, record: RequestRecord, now: float | None = None) -> None:
        """Count one finished request in the steps of `now` (default: the clock)."""
        moment = self._clock() if now is None else now
        cold = is_cold_turn(record.lease, record.prompt_tokens, record.cached_tokens)
        lost = is_cache_lost(record.predicted_cached_blocks, record.reported_cached_blocks)
        refused_by = record.refused_by.split() if record.refused_by else ()
        with self._lock:
            for ring in self._rings.values():
                ring.at(moment, record.host).count(
                    record.status,
                    record.code,
                    record.ttfb_ms,
                    record.completion_tokens,
                    record.prompt_tokens,
                    record.cached_tokens,
                    cold,
                    lost,
                )
                # The row counts once, under its host (none for a route's refusal); the hosts
                # that were full each count that they were.
                for host in refused_by:
                    ring.at(moment, host).refused += 1
            if not record.host and record.code in ROUTE_REFUSALS:
                refusals = self._routes.at(moment, record.route)
                refusals.refused += 1
                refusals.codes[record.code] = refusals.codes.get(record.code, 0) + 1

    def sample(self, loads: Iterable[HostLoad], now: float | None = None) -> None:
        """Add one sample of each host's requests in flight and queue depth."""
        moment = self._clock() if now is None else now
        with self._lock:
            for name, in_flight, queued in loads:
                for ring in self._rings.values():
                    stats = ring.at(moment, name)
                    stats.flight_sum += in_flight
                    stats.queued_sum += queued
                    stats.samples += 1
                    stats.queued_peak = max(stats.queued_peak or 0, queued)

    def points(
        self, window: str, since: int | None = None, now: float | None = None
    ) -> list[dict[str, Any]]:
        """The window's chart points, oldest first; from step `since` on when given.

        The last point is the step in progress: a reader asks again from its start.
        """
        spec = WINDOWS[window]
        moment = self._clock() if now is None else now
        last = int(moment // spec.step) * spec.step
        first = last - spec.seconds + spec.step
        if since is not None:
            first = max(first, int(since // spec.step) * spec.step)
        return [_point(start, slot) for start, slot in self.steps(window, first, last)]

    def steps(self, ring: str, first: int, last: int) -> Steps:
        """The steps of `ring` ("5m", "1h", or "routes": the routes' refusals) from step start
        `first` to `last`, each a copy; the whole fleet's when `fleet_steps` is set."""
        held = self._routes if ring == "routes" else self._rings[ring]
        with self._lock:
            steps = [(start, _merged([slot])) for start, slot in held.steps(first, last)]
        return steps if self.fleet_steps is None else self.fleet_steps(ring, steps)

    def day_points(
        self, table: DatabaseHistory, since: int | None = None, now: float | None = None
    ) -> list[dict[str, Any]]:
        """The 24-hour window's points, a minute each, oldest first; from minute `since` on.

        Minutes before the table's reach are its rows'; the rest come from the hour ring, two
        steps a minute, so the last hour is what the 1-hour window counts and the 24 hours never
        count less. The last point is the minute in progress.
        """
        moment = self._clock() if now is None else now
        last = int(moment // 60) * 60
        first = last - WINDOWS["24h"].seconds + 60
        minutes, until = table.read()
        seam = first if until is None else max(first, until)
        if since is not None:
            first = max(first, since)
        hour = dict(self.steps("1h", max(seam, first), last + 30))
        recent = {
            t: _merged([hour.get(t, {}), hour.get(t + 30, {})])
            for t in range(max(seam, first), last + 1, 60)
        }
        hosts = {host for by_host in minutes.values() for host in by_host if host}
        return [
            _point(t, recent[t] if t >= seam else _with_idle(minutes.get(t, {}), hosts))
            for t in range(first, last + 1, 60)
        ]

    def cards(self, now: float | None = None) -> dict[str, dict[str, Any]]:
        """Per host, what it did in the last `CARD_SECONDS`: the dashboard's host cards."""
        spec = WINDOWS["5m"]
        moment = self._clock() if now is None else now
        last = int(moment // spec.step) * spec.step
        steps = self.steps("5m", last - CARD_SECONDS + spec.step, last)
        merged = _merged(slot for _, slot in steps)
        merged.pop("", None)
        # The step in progress is only partly over: rates are over the time that has passed.
        span = CARD_SECONDS - spec.step + (moment - last)
        return {host: _card(stats, span) for host, stats in sorted(merged.items())}

    def route_refusals(self, now: float | None = None) -> dict[str, dict[str, Any]]:
        """Per route, the requests it refused itself in the last `CARD_SECONDS` (no host was
        free or usable): `{"refused": n, "codes": {code: n}}`."""
        spec = WINDOWS["5m"]
        moment = self._clock() if now is None else now
        last = int(moment // spec.step) * spec.step
        steps = self.steps("routes", last - CARD_SECONDS + spec.step, last)
        merged = _merged(slot for _, slot in steps)
        return {
            route: {"refused": stats.refused, "codes": dict(sorted(stats.codes.items()))}
            for route, stats in sorted(merged.items())
        }


def _merged(slots: Iterable[dict[str, Stats]]) -> dict[str, Stats]:
    """Each host's stats over `slots`, added up into new Stats (the ring's are not shared)."""
    merged: dict[str, Stats] = {}
    for slot in slots:
        for host, stats in slot.items():
            merged.setdefault(host, Stats()).merge(stats)
    return merged


def _card(stats: Stats, span: float) -> dict[str, Any]:
    return {
        "requests": stats.requests,
        "rps": round(stats.requests / span, 3),
        "outcomes": dict(zip(OUTCOMES, stats.outcomes, strict=True)),
        "codes": dict(sorted(stats.codes.items())),
        "ttfb_p50": stats.ttfb_percentile(50),
        "ttfb_p95": stats.ttfb_percentile(95),
        "tokens_per_s": round(stats.tokens / span, 2),
        "cache_hit": stats.cache_hit,
        "cold": stats.cold,
        "cache_lost": stats.cache_lost,
        "refused": stats.refused,
        "in_flight": stats.in_flight_mean,
        "queued_peak": stats.queued_peak,
    }


# -- the Request table: the 24-hour view, and the rings at start -----------------------------


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


def _with_idle(by_host: dict[str, Stats], hosts: set[str]) -> dict[str, Stats]:
    """A minute with no row of a host: nothing finished there, so none ran or waited (a 0)."""
    missing = hosts - by_host.keys()
    if not missing:
        return by_host
    idle = dict(by_host)
    for host in missing:
        idle[host] = Stats()
        idle[host].samples = 1
    return idle


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
    from django.db.models import Count, F, Q, Sum

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
    both = Q(prompt_tokens__isnull=False, cached_tokens__isnull=False)
    counted = rows.values("step", "host").annotate(
        n=Count("pk"),
        c4xx=Count("pk", filter=Q(status__gte=400, status__lt=499)),
        c5xx=Count("pk", filter=Q(status__gte=500)),
        c499=Count("pk", filter=Q(status=499)),
        tokens=Sum("completion_tokens"),
        prompt=Sum("prompt_tokens", filter=both),
        cached=Sum("cached_tokens", filter=both),
        cold=Count(
            "pk",
            filter=Q(
                lease="reused",
                prompt_tokens__gt=0,
                cached_tokens__lt=F("prompt_tokens") * COLD_TURN_SHARE,
            ),
        ),
        # is_cache_lost in SQL: a comparison with an unknown (NULL) figure is never true, so
        # a row without both figures is not counted, on SQLite and PostgreSQL alike.
        cache_lost=Count(
            "pk",
            filter=Q(predicted_cached_blocks__gt=F("reported_cached_blocks") + CACHE_LOST_BLOCKS),
        ),
        busy_ms=Sum(F("total_ms") - F("queued_ms")),
        queued_ms=Sum("queued_ms"),
    )
    steps: dict[int, dict[str, Stats]] = {}
    for row in counted:
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
        steps.setdefault(row["step"] * step, {})[row["host"]] = stats

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
    return steps


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


# -- the process's history and its sampler ------------------------------------------------

history = History()
database_history = DatabaseHistory()

_samplers: weakref.WeakKeyDictionary[Runtime, asyncio.Task[None]] = weakref.WeakKeyDictionary()
_rebuilds: weakref.WeakKeyDictionary[Runtime, asyncio.Task[None]] = weakref.WeakKeyDictionary()


def ensure_sampler(runtime: Runtime) -> None:
    """Sample `runtime`'s hosts every second from now on, and have the rings rebuilt from the
    rows once (in a worker thread); call on the runtime's loop.

    The runtime has no hook for this, so whoever first needs the history starts it: a
    dashboard opening, a scrape, or a request finishing (`routing.ops.metrics.observe`). A
    rebuild that failed (the database down) is tried again by the next dashboard or scrape.
    """
    task = _samplers.get(runtime)
    if task is None or task.done():
        _samplers[runtime] = runtime.loop.create_task(
            _sample_forever(runtime), name="crossbar-history"
        )
    rebuild = _rebuilds.get(runtime)
    if not history.rebuilt and (rebuild is None or rebuild.done()):
        _rebuilds[runtime] = runtime.loop.create_task(_rebuild(), name="crossbar-history-rebuild")


async def _rebuild() -> None:
    from channels.db import database_sync_to_async

    try:
        # Not thread_sensitive, like the 24-hour read: a slow query holds up no other work.
        await database_sync_to_async(history.rebuild, thread_sensitive=False)()
    except Exception:  # the charts then start at this process's start, as they did before
        log.exception("history: cannot read the requests before this process started")


def sampling(runtime: Runtime) -> bool:
    task = _samplers.get(runtime)
    return task is not None and not task.done()


async def _sample_forever(runtime: Runtime) -> None:
    from routing.ops.live import host_loads

    while not runtime.client.is_closed:
        try:
            history.sample(host_loads(runtime))
        except Exception:  # a sample missed is a gap in a chart, never a dead sampler
            log.exception("history: cannot sample the hosts")
        # On the second, so each step gets the same number of samples.
        await asyncio.sleep(SAMPLE_EVERY - time.time() % SAMPLE_EVERY)
