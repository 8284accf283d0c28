"""The dashboard's history in memory: rings of per-step counts of finished requests and samples
of each host's load, one ring per window (`History`).

Every finished request is counted once (`observe`, from `routing.ops.metrics.observe`, in
whichever thread finishes it) into the step of the moment it finished, and every second the
sampler (routing/ops/history_sampler.py) adds each host's queue depth and requests in flight
(`sample`).

A window is served at one resolution from one ring: the last 5 minutes in 5-second steps,
the last hour in 30-second steps. A ring holds its window (the hour ring ten minutes more, for
the 24 hours), so reading one is a copy of at most 140 steps, never a merge of thousands of
seconds, and the event loop is not held up when a dashboard opens. Memory is bounded by steps
x hosts x distinct error codes.

A restart does not empty the rings: once per process (`History.rebuild`, in a worker thread,
from the first dashboard, scrape or request on) they are filled from the rows of the requests
that started before the process did, in the step each finished (routing/ops/history_rows.py).
Those steps have no queue depth or in-flight figures: nothing sampled them.

The 24 hours come from the Request table, in minutes (`DatabaseHistory`), up to an hour ago,
and from the hour ring after that (`History.day_points`): the last hour of the 24 hours is the
1-hour window's count, the 1-hour window holds the 5 minutes' steps, so a shorter window never
counts more than a longer one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from accounting.recorder import RequestRecord
from accounting.report import is_cache_lost, is_cold_turn
from hosts.live import HostLoad
from routing.ops.history_rows import DatabaseHistory, read_steps
from routing.ops.history_steps import WINDOWS, Stats, Steps, chart_point, host_card, merged

CARD_SECONDS = 300  # the per-host cards cover the last 5 minutes
HOUR_RING_SPARE = 600  # seconds the hour ring keeps past its hour: where the 24 hours take over
# The refusals that are a route's, not a host's: nothing free, nothing usable (the model loaded
# nowhere among them), its pinned host down. Their rows name no host.
ROUTE_REFUSALS = frozenset(
    {"queue_full", "no_healthy_host", "model_not_loaded", "pinned_host_down"}
)


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
                    ring.at(moment, name).sample(in_flight, queued)

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
        return [chart_point(start, slot) for start, slot in self.steps(window, first, last)]

    def steps(self, ring: str, first: int, last: int) -> Steps:
        """The steps of `ring` ("5m", "1h", or "routes": the routes' refusals) from step start
        `first` to `last`, each a copy; the whole fleet's when `fleet_steps` is set."""
        held = self._routes if ring == "routes" else self._rings[ring]
        with self._lock:
            steps = [(start, merged([slot])) for start, slot in held.steps(first, last)]
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
            t: merged([hour.get(t, {}), hour.get(t + 30, {})])
            for t in range(max(seam, first), last + 1, 60)
        }
        hosts = {host for by_host in minutes.values() for host in by_host if host}
        return [
            chart_point(t, recent[t] if t >= seam else _with_idle(minutes.get(t, {}), hosts))
            for t in range(first, last + 1, 60)
        ]

    def cards(self, now: float | None = None) -> dict[str, dict[str, Any]]:
        """Per host, what it did in the last `CARD_SECONDS`: the dashboard's host cards."""
        spec = WINDOWS["5m"]
        moment = self._clock() if now is None else now
        last = int(moment // spec.step) * spec.step
        steps = self.steps("5m", last - CARD_SECONDS + spec.step, last)
        by_host = merged(slot for _, slot in steps)
        by_host.pop("", None)
        # The step in progress is only partly over: rates are over the time that has passed.
        span = CARD_SECONDS - spec.step + (moment - last)
        return {host: host_card(stats, span) for host, stats in sorted(by_host.items())}

    def route_refusals(self, now: float | None = None) -> dict[str, dict[str, Any]]:
        """Per route, the requests it refused itself in the last `CARD_SECONDS` (no host was
        free or usable): `{"refused": n, "codes": {code: n}}`."""
        spec = WINDOWS["5m"]
        moment = self._clock() if now is None else now
        last = int(moment // spec.step) * spec.step
        steps = self.steps("routes", last - CARD_SECONDS + spec.step, last)
        by_route = merged(slot for _, slot in steps)
        return {
            route: {"refused": stats.refused, "codes": dict(sorted(stats.codes.items()))}
            for route, stats in sorted(by_route.items())
        }


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
