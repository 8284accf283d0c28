"""The dashboard of several gateway processes: each process's share in Redis, and the fleet's
view merged from every live process's share, whichever process serves the page.

What only a process knows is its own: the requests running in it (`runtime.running`), the
requests it finished (`metrics.recent`), and what it counted in the history's rings. With
shared state (`CROSSBAR_REDIS_URL`), every process publishes that on the tick it already runs
(`Shared.on_tick`, every second), into one hash of its own, `P dash:<proc>`, that expires
`CROSSBAR_REDIS_HOLD_TTL` seconds after its last tick: a process that dies drops out of every
dashboard within that time, as its slots do. The process serving a dashboard reads every
live process's hash at most once a second, however many dashboards it serves (`FleetView`).
Without Redis nothing here runs: one process is the whole fleet, as before.

Why a share, not the rows: the rows arrive up to a second late (the recorder's batches), a
database that is down would blank the dashboard, and reading five minutes of rows twice a
second per dashboard is three aggregate queries each time; a share is one script a second.

- **Running now and recent requests**: every process's, merged (oldest first; by when they
  finished), each entry naming its `process` ("worker 2", or host and pid for a replica).
- **History** (cards, route refusals, the 5-minute and hour charts, the 24 hours' last hour):
  each process counts what it serves a second time into a history of its own (`own`, a
  `History` that is never rebuilt from the rows and is sampled on the tick) and publishes its
  steps. For the steps from when the longest-running live process started (`cut`), the view is
  the sum of every live process's steps: counts add up, so requests, errors, tokens and cache
  hits are exact; TTFB percentiles are read from the merged bucket counts, as exact as one
  process's (within a bucket); in flight and queue depth are means over every process's
  samples (each samples the shared counts, the whole fleet's). The steps before `cut` are the
  serving process's own rings, rebuilt from the rows (every process's rows): so every process
  shows the same figures, and a request is never counted twice. A dead process's requests
  leave the 5-minute and hour windows with it; the 24 hours read them from the rows once they
  are an hour old.

Cost, per process (2 hosts; a host adds about 60 bytes per ring step): a tick publishes one
script of the step in progress of each ring (two or three fields, ~0.5 kB), its running
requests (~0.2 kB each, at most `MAX_RUNNING`) and, when requests finished since the last tick,
its tail of recent requests (at most 50, ~12 kB). A process serving dashboards reads, once a
second, one script: for each other process, the same few fields (the whole hash once, when it
first sees a process: ~60 kB at 2 hosts). So a few kB and two commands a second per process,
whatever the number of dashboards open, and nothing faster than the tick.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import time
import weakref
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from accounting.recorder import RequestRecord
from routing.core.recent import RecentRequests
from routing.ops.history import history
from routing.ops.history_rings import CARD_SECONDS, HOUR_RING_SPARE, History
from routing.ops.history_steps import WINDOWS, Stats, Steps
from routing.ops.live import host_loads
from routing.runtime import Runtime

log = logging.getLogger("crossbar.dashboard")

MAX_RUNNING = 200  # rows of the running-requests table sent; the rest are counted on the page
READ_EVERY = 1.0  # seconds a read of the other processes' shares is kept
# Each ring as published: its step and how far back a reader may ask for it.
RINGS = {
    "5m": (WINDOWS["5m"].step, CARD_SECONDS),
    "1h": (WINDOWS["1h"].step, WINDOWS["1h"].seconds + HOUR_RING_SPARE),
    "routes": (WINDOWS["5m"].step, CARD_SECONDS),
}
_worker = os.environ.get("CROSSBAR_WORKER")
# How a running request names the process it runs in.
PROCESS = f"worker {_worker}" if _worker else f"{socket.gethostname()} pid {os.getpid()}"

# What this process counted itself, for its share; None without shared state.
own: History | None = None


def observe(record: RequestRecord) -> None:
    """Count a finished request in this process's share (with shared state only)."""
    if own is not None:
        own.observe(record)


def running_entries(runtime: Runtime) -> list[dict[str, Any]]:
    """The requests running now, oldest first, at most `MAX_RUNNING` (no fingerprint); one
    that waits names the host whose line it is in (`line`) and its place there (`place`)."""
    return [
        {
            "n": row.number,
            "route": row.route,
            "model": row.model[:100],
            "host": row.host,
            "client": row.client,
            "elapsed_ms": row.elapsed_ms,
            "queued_ms": row.queued_ms,
            "tokens": row.tokens,
            "line": row.line,
            "place": row.place,
        }
        for row in runtime.running.snapshot(MAX_RUNNING)
    ]


def request_entry(number: int, record: RequestRecord) -> dict[str, Any]:
    """A finished request as the dashboard lists it (no fingerprint, no error details)."""
    return {
        "n": number,
        # Listed as they finish, so by the time they finished.
        "finished": (record.started + timedelta(milliseconds=record.total_ms)).isoformat(),
        "route": record.route,
        "model": record.model[:100],
        "host": record.host,
        "client": record.client,
        "status": record.status,
        "lease": record.lease,
        "total_ms": record.total_ms,
        "prompt_tokens": record.prompt_tokens,
        "completion_tokens": record.completion_tokens,
    }


@dataclass(slots=True)
class Part:
    """One process's share, as last read."""

    began: float = 0.0
    running: list[dict[str, Any]] = field(default_factory=list)  # "started": epoch seconds
    running_total: int = 0
    recent: list[tuple[int, dict[str, Any]]] = field(default_factory=list)
    steps: dict[str, dict[int, dict[str, Stats]]] = field(default_factory=dict)


class FleetView:
    """This process's share, published on its tick, and every live process's, read for the
    dashboards it serves. One per runtime with shared state; use it on the runtime's loop."""

    def __init__(self, runtime: Runtime, tail: RecentRequests[RequestRecord], own: History):
        assert runtime.shared is not None
        self.runtime = runtime
        self.tail = tail
        self.own = own
        shared = runtime.shared.shared
        self.proc = shared.proc
        self.ttl_ms = int(shared.hold_ttl * 1000)
        # Seconds after a step ends that another process's counts of it may still arrive: its
        # last tick in the step, a publish that waited up to the TTL, and this side's read.
        self.lag = int(shared.tick + shared.hold_ttl + READ_EVERY) + 1
        self._share = shared.script(_SHARE)
        self._read = shared.script(_READ)
        self._published: dict[str, set[int]] = {ring: set() for ring in RINGS}
        self._last_publish: float | None = None  # None: publish every step next time
        self._last_recent = -1
        self.parts: dict[str, Part] = {}
        self._read_at = -READ_EVERY
        self._reading: asyncio.Task[None] | None = None
        shared.on_tick(self.publish)

    # -- this process's share ---------------------------------------------------------------

    async def publish(self) -> None:
        """One tick: sample the hosts into `own`, then write what changed since the last tick.
        Raises StateUnavailable (the tick logs it once per outage)."""
        now = time.time()
        self.own.sample(host_loads(self.runtime), now)
        whole = self._last_publish is None
        fields, gone = self._changed_steps(now)
        fields["live"] = json.dumps(
            {
                "began": self.own.began,
                "running": [_with_start(entry, now) for entry in running_entries(self.runtime)],
                "running_total": len(self.runtime.running),
            }
        )
        tail = self.tail.since(0)
        newest = tail[-1][0] if tail else 0
        if newest != self._last_recent or whole:
            fields["recent"] = json.dumps(
                [[n, {**request_entry(n, record), "process": PROCESS}] for n, record in tail]
            )
        pairs = [item for pair in fields.items() for item in pair]
        existed = await self._share(self.proc, self.ttl_ms, len(gone), *gone, *pairs)
        self._last_publish, self._last_recent = now, newest
        if not existed and not whole:  # Redis lost it (restarted, or the key lapsed): all again
            self._last_publish = None
            await self.publish()

    def _changed_steps(self, now: float) -> tuple[dict[str, str], list[str]]:
        """The ring steps counted in since the last publish, and the fields past each ring."""
        fields: dict[str, str] = {}
        gone: list[str] = []
        for ring, (step, reach) in RINGS.items():
            last = int(now // step) * step
            first = last - reach
            since = first if self._last_publish is None else int(self._last_publish // step) * step
            for start, by_host in self.own.steps(ring, max(first, since), last):
                if by_host:
                    fields[f"{ring}:{start}"] = json.dumps(
                        {host: _encode(stats) for host, stats in by_host.items()}
                    )
                    self._published[ring].add(start)
            old = {start for start in self._published[ring] if start < first}
            self._published[ring] -= old
            gone += [f"{ring}:{start}" for start in old]
        return fields, gone

    # -- every process's share ---------------------------------------------------------

    async def read(self) -> None:
        """Read the other live processes' shares, unless read within `READ_EVERY` seconds;
        concurrent callers share one read. Raises StateUnavailable."""
        if time.monotonic() - self._read_at < READ_EVERY:
            return
        if self._reading is None or self._reading.done():
            self._reading = asyncio.ensure_future(self._read_now())
        await asyncio.shield(self._reading)

    async def _read_now(self) -> None:
        now = time.time()
        fresh = self._fresh_fields(now)
        known = list(self.parts)
        reply = await self._read(self.proc, len(known), *known, *fresh)
        parts: dict[str, Part] = {}
        for proc, whole, values in reply:
            if whole:
                got = dict(zip(values[::2], values[1::2], strict=True))
                part = parts[proc] = Part()
            else:
                got = dict(zip(["live", "recent", *fresh], values, strict=True))
                part = parts[proc] = self.parts[proc]
            _take(part, got, now)
        self.parts = parts
        self._read_at = time.monotonic()

    def _fresh_fields(self, now: float) -> list[str]:
        """The steps a live process may still change: those that ended within its TTL."""
        fields = []
        for ring, (step, _reach) in RINGS.items():
            last = int(now // step) * step
            first = int((now - step - self.ttl_ms / 1000) // step) * step
            fields += [f"{ring}:{start}" for start in range(first, last + 1, step)]
        return fields

    def running(self) -> tuple[list[dict[str, Any]], int]:
        """Every live process's running requests, oldest first (at most `MAX_RUNNING`), and
        how many run in all."""
        now = time.time()
        rows = [{**entry, "process": PROCESS} for entry in running_entries(self.runtime)]
        total = len(self.runtime.running)
        for part in self.parts.values():
            total += part.running_total
            for entry in part.running:
                row = {key: value for key, value in entry.items() if key != "started"}
                row["elapsed_ms"] = max(0, int((now - entry["started"]) * 1000))
                rows.append(row)
        rows.sort(key=lambda row: -row["elapsed_ms"])
        return rows[:MAX_RUNNING], total

    def finished_since(self, shown: dict[str, int]) -> list[dict[str, Any]]:
        """The requests every live process finished after the numbers in `shown` (by process,
        updated), by when they finished."""
        fresh = [
            {**request_entry(n, record), "process": PROCESS}
            for n, record in self.tail.since(shown.get(self.proc, 0))
        ]
        if fresh:
            shown[self.proc] = fresh[-1]["n"]
        for proc, part in self.parts.items():
            new = [entry for n, entry in part.recent if n > shown.get(proc, 0)]
            if new:
                shown[proc] = new[-1]["n"]
            fresh += new
        return sorted(fresh, key=lambda entry: entry["finished"])

    def fleet_steps(self, ring: str, steps: Steps) -> Steps:
        """`History.fleet_steps`: from the longest-running live process's start on, every live
        process's counts and samples (this one's from `own`); before it, this process's rings."""
        cut = min([self.own.began, *(part.began for part in self.parts.values())])
        step = RINGS[ring][0]
        live = [start for start, _ in steps if start + step > cut]
        if not live:
            return steps
        mine = dict(self.own.steps(ring, live[0], live[-1]))
        merged: Steps = []
        for start, by_host in steps:
            if start + step <= cut:
                merged.append((start, by_host))
                continue
            fleet: dict[str, Stats] = {}
            for part in [mine.get(start, {})] + [
                p.steps.get(ring, {}).get(start, {}) for p in self.parts.values()
            ]:
                for host, stats in part.items():
                    fleet.setdefault(host, Stats()).merge(stats)
            merged.append((start, fleet))
        return merged


def _with_start(entry: dict[str, Any], now: float) -> dict[str, Any]:
    """A running entry as published: when it started rather than how long ago."""
    return {**entry, "process": PROCESS, "started": now - entry["elapsed_ms"] / 1000}


def _take(part: Part, got: dict[str, Any], now: float) -> None:
    """Fold the fields read of one process's hash into its part."""
    if got.get("live"):
        live = json.loads(got["live"])
        part.began = live["began"]
        part.running = live["running"]
        part.running_total = live["running_total"]
    if got.get("recent"):
        part.recent = [(n, entry) for n, entry in json.loads(got["recent"])]
    for name, value in got.items():
        ring, _, start = name.partition(":")
        if ring in RINGS and value:
            decoded = {host: _decode(stats) for host, stats in json.loads(value).items()}
            part.steps.setdefault(ring, {})[int(start)] = decoded
    for ring, (step, reach) in RINGS.items():
        held = part.steps.get(ring, {})
        for old in [t for t in held if t < now - reach - step]:
            del held[old]


def _encode(stats: Stats) -> list[Any]:
    return [
        stats.outcomes, stats.codes, sorted(stats.ttfb.items()), stats.tokens, stats.prompt,
        stats.cached, stats.cold, stats.cache_lost, stats.refused, round(stats.flight_sum, 3),
        round(stats.queued_sum, 3), stats.samples, stats.queued_peak,
    ]  # fmt: skip


def _decode(value: list[Any]) -> Stats:
    stats = Stats()
    (stats.outcomes, stats.codes, ttfb, stats.tokens, stats.prompt, stats.cached, stats.cold,
     stats.cache_lost, stats.refused, stats.flight_sum, stats.queued_sum, stats.samples,
     stats.queued_peak) = value  # fmt: skip
    stats.ttfb = {int(index): n for index, n in ttfb}
    return stats


_views: weakref.WeakKeyDictionary[Runtime, FleetView] = weakref.WeakKeyDictionary()


def sharing(runtime: Runtime) -> bool:
    """Whether `runtime` shares what it needs to (always, without shared state)."""
    return runtime.shared is None or runtime in _views


def share_fleet(runtime: Runtime, tail: RecentRequests[RequestRecord]) -> FleetView | None:
    """The runtime's `FleetView`, made on first call (it publishes from then on, and the
    process's history reads the fleet through it); None without shared state. Call on the
    runtime's loop: at start, and wherever the history is first needed (cheap after)."""
    global own
    if runtime.shared is None:
        return None
    view = _views.get(runtime)
    if view is None:
        own = own or History()
        view = _views[runtime] = FleetView(runtime, tail, own)
        history.fleet_steps = view.fleet_steps
    return view


# ARGV: prefix, proc, TTL (ms), the number of fields to delete, those fields, then field and
# value pairs. Returns whether the hash was there (0: write every step again).
_SHARE = """
local P = ARGV[1]
local key = P .. 'dash:' .. ARGV[2]
local existed = redis.call('EXISTS', key)
local n = tonumber(ARGV[4])
for i = 5, 4 + n do redis.call('HDEL', key, ARGV[i]) end
for i = 5 + n, #ARGV, 2 do redis.call('HSET', key, ARGV[i], ARGV[i + 1]) end
redis.call('PEXPIRE', key, ARGV[3])
redis.call('SADD', P .. 'dash:procs', ARGV[2])
return existed
"""

# ARGV: prefix, the reader's proc, the number of procs it knows, those procs, then the step
# fields to read of each known proc. Returns, per other live proc, {proc, 1, HGETALL} for one
# the reader does not know, {proc, 0, HMGET live, recent, fields...} for one it does; a proc
# whose hash expired leaves the set.
_READ = """
local P = ARGV[1]
local known = {}
local n = tonumber(ARGV[3])
for i = 4, 3 + n do known[ARGV[i]] = true end
local fields = {'live', 'recent'}
for i = 4 + n, #ARGV do fields[#fields + 1] = ARGV[i] end
local out = {}
for _, proc in ipairs(redis.call('SMEMBERS', P .. 'dash:procs')) do
  local key = P .. 'dash:' .. proc
  if redis.call('EXISTS', key) == 0 then
    redis.call('SREM', P .. 'dash:procs', proc)
  elseif proc ~= ARGV[2] then
    if known[proc] then
      out[#out + 1] = {proc, 0, redis.call('HMGET', key, unpack(fields))}
    else
      out[#out + 1] = {proc, 1, redis.call('HGETALL', key)}
    end
  end
end
return out
"""
