"""What one host did in one step of the dashboard's history (`Stats`), and how steps read: a
chart point, a host card, several steps added up.

A step's counts add up (`Stats.merge`), so a span of steps, a minute of two 30-second steps or
the steps of several processes read as one. Rates are per second: counts divided by the span.

TTFB percentiles are read from counts in fixed buckets (the R10 series, ten per decade, 1 ms to
800 s) with linear interpolation inside a bucket, as Prometheus' `histogram_quantile` does: a
percentile is never more than one bucket (26%) off, and the memory per step stays small.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

OUTCOMES = ("2xx", "4xx", "5xx", "499")
_R10 = (1.0, 1.25, 1.6, 2.0, 2.5, 3.15, 4.0, 5.0, 6.3, 8.0)
TTFB_BOUNDS_MS: tuple[float, ...] = tuple(
    round(mantissa * 10**decade, 2) for decade in range(6) for mantissa in _R10
)


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

    def sample(self, in_flight: float, queued: float) -> None:
        """Add one sample of the host's requests in flight and queue depth."""
        self.flight_sum += in_flight
        self.queued_sum += queued
        self.samples += 1
        self.queued_peak = max(self.queued_peak or 0, queued)

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


def merged(slots: Iterable[dict[str, Stats]]) -> dict[str, Stats]:
    """Each host's stats over `slots`, added up into new Stats (those of `slots` are not
    changed, nor shared with the result)."""
    out: dict[str, Stats] = {}
    for slot in slots:
        for host, stats in slot.items():
            out.setdefault(host, Stats()).merge(stats)
    return out


def chart_point(t: int, by_host: dict[str, Stats]) -> dict[str, Any]:
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


def host_card(stats: Stats, span: float) -> dict[str, Any]:
    """A host's card: what it did over `span` seconds, JSON-ready."""
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
