"""Prometheus metrics: what the gateway did (counted as requests finish) and what it holds
right now (read from the runtime when scraped), served at `/metrics`.

Request-level metrics come from the same `RequestRecord` the recorder gets:
`routing.proxy.record.finish` calls `observe(record)` once per request, on the loop. That costs a
few counter and histogram updates (prometheus-client's own locks, nothing else), one append to
the dashboard's tail of recent requests and one count in the dashboard's history rings.

State gauges (in flight, queued, slots, host state, leases, recorder backlog) are collected at
scrape time by `StateCollector`, from `routing.ops.live.host_lives` and the recorder, on the
event loop that serves the scrape; the runtime is never read from another thread.

Label values are bounded by the configuration: route, host, model and client names, status
codes, lease outcomes, and the gateway's own error codes (`code`, empty for success; at most
`MAX_CODES` distinct values, then `other`). Never a fingerprint, a client address or a key. A
request that reached no host keeps its model label empty, because the model is whatever the
client sent; a request to an unknown route (`unknown_route`) keeps its route label empty for
the same reason. A `queue_full` refusal counts in `crossbar_requests` once, on the first host
that was full, and in `crossbar_refusals` once on every host that was full.
"""

from __future__ import annotations

import asyncio
import hmac
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass

from django.conf import settings
from django.http import HttpRequest, HttpResponse
from django.views.decorators.http import require_safe
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from accounting.recorder import RequestRecord, get_recorder
from accounting.report import COLD_TURN_SHARE, is_cache_lost, is_cold_turn
from hosts.health import HostState
from hosts.live import HostLive
from routing.core.clients import bearer_token
from routing.core.recent import RecentRequests
from routing.ops import client_metrics, dashboard_share, history
from routing.ops.live import departed, host_lives
from routing.ops.model_metrics import model_metrics
from routing.runtime import Runtime, current_runtime, get_runtime

REGISTRY = CollectorRegistry()
ProcessCollector(registry=REGISTRY)
PlatformCollector(registry=REGISTRY)
GCCollector(registry=REGISTRY)

_PLACE = ["route", "host", "model"]
# Queue waits and first bytes are short or very long (a prompt of 100k tokens); whole requests
# run from milliseconds to the ten minutes of a long generation.
_WAIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_TTFB_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_TOTAL_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)

REQUESTS = Counter(
    "crossbar_requests",
    "Requests answered, by route, host, model, HTTP status (499: the client left) and the "
    "gateway's error code (empty for success).",
    [*_PLACE, "status", "code"],
    registry=REGISTRY,
)
COLD_TURNS = Counter(
    "crossbar_cold_turns",
    f"Requests of a reused lease that found less than {COLD_TURN_SHARE:.0%} of their prompt "
    "cached: the host evicted the conversation (more slots, more --cache-ram or "
    "--slot-prompt-similarity 0.95 would keep it).",
    ["route", "host"],
    registry=REGISTRY,
)
CACHE_LOST = Counter(
    "crossbar_cache_lost",
    "Requests whose host had less of the prompt cached than the gateway's prefix index "
    "predicted, by more than one block: the host lost what it had been sent (evicted or "
    "restarted). Recurring on a host, it wants more slots, more --cache-ram or "
    "--slot-prompt-similarity 0.95 there.",
    ["host"],
    registry=REGISTRY,
)
# The index's hit rate is confirmed / predicted (how much of what it expected the host held);
# reported / predicted past 1 is what it did not know of. Blocks rather than requests, so a
# long prompt weighs as much as it costs to evaluate again. Only requests with both figures.
PREFIX_PREDICTED = Counter(
    "crossbar_prefix_predicted_blocks",
    "Prompt blocks the prefix index predicted the host held, on requests the host reported on.",
    ["host"],
    registry=REGISTRY,
)
PREFIX_REPORTED = Counter(
    "crossbar_prefix_reported_blocks",
    "Prompt blocks the host reported cached, on requests the prefix index predicted for.",
    ["host"],
    registry=REGISTRY,
)
PREFIX_CONFIRMED = Counter(
    "crossbar_prefix_confirmed_blocks",
    "Predicted prompt blocks the host reported cached (the lesser of predicted and reported).",
    ["host"],
    registry=REGISTRY,
)
QUEUE_WAIT = Histogram(
    "crossbar_queue_wait_seconds",
    "Time requests that reached a host waited for a slot.",
    _PLACE,
    buckets=_WAIT_BUCKETS,
    registry=REGISTRY,
)
TTFB = Histogram(
    "crossbar_ttfb_seconds",
    "Time from the request's arrival to the host's response head.",
    _PLACE,
    buckets=_TTFB_BUCKETS,
    registry=REGISTRY,
)
DURATION = Histogram(
    "crossbar_request_duration_seconds",
    "Time from the request's arrival to its last byte (or its failure).",
    _PLACE,
    buckets=_TOTAL_BUCKETS,
    registry=REGISTRY,
)
PROMPT_TOKENS = Counter(
    "crossbar_prompt_tokens", "Prompt tokens, the cached part included.", _PLACE, registry=REGISTRY
)
CACHED_TOKENS = Counter(
    "crossbar_cached_tokens", "Prompt tokens served from the KV cache.", _PLACE, registry=REGISTRY
)
COMPLETION_TOKENS = Counter(
    "crossbar_completion_tokens", "Tokens generated.", _PLACE, registry=REGISTRY
)
LEASES = Counter(
    "crossbar_lease_outcomes",
    "How requests found their host: new, reused, moved or spilled.",
    ["route", "host", "outcome"],
    registry=REGISTRY,
)
FALLBACKS = Counter(
    "crossbar_fallbacks",
    "Requests served by a route's fallback route.",
    ["route", "fallback"],
    registry=REGISTRY,
)
REFUSALS = Counter(
    "crossbar_refusals",
    "Requests the route refused while this host was full (slots and queue), as was every "
    "other usable host of the route: one refusal counts once on each such host (code "
    "queue_full). The refusal itself is the route's: crossbar_requests_total counts it with "
    "no host.",
    [*_PLACE, "code"],
    registry=REGISTRY,
)
for _counter in (client_metrics.REQUESTS, client_metrics.TOKENS):
    REGISTRY.register(_counter)
HEAD_TIMEOUTS = Counter(
    "crossbar_head_timeouts",
    "Connections closed (408) because a request's head did not arrive whole within "
    "CROSSBAR_HEAD_TIMEOUT: clients trickling header bytes, or sending none.",
    registry=REGISTRY,
)

# The dashboard's tail of finished requests.
recent: RecentRequests[RequestRecord] = RecentRequests()

MAX_CODES = 50
_CODE = re.compile(r"[a-z][a-z0-9_]{0,39}")
_codes: set[str] = set()
_codes_lock = threading.Lock()


def code_label(code: str) -> str:
    """The `code` label for a record's code: itself while the set of codes stays small."""
    if not code or code in _codes:
        return code
    if not _CODE.fullmatch(code):
        return "other"
    with _codes_lock:
        if len(_codes) >= MAX_CODES:
            return "other"
        _codes.add(code)
    return code


@dataclass(slots=True, frozen=True)
class _Series:
    """The labelled children of one (route, host, model), looked up once and kept."""

    queue_wait: Histogram
    ttfb: Histogram
    duration: Histogram
    prompt: Counter
    cached: Counter
    completion: Counter
    predicted_blocks: Counter  # the host's alone: the same children for each route and model
    reported_blocks: Counter
    confirmed_blocks: Counter


_series: dict[tuple[str, str, str], _Series] = {}


def _series_for(route: str, host: str, model: str) -> _Series:
    key = (route, host, model)
    series = _series.get(key)
    if series is None:
        # Two threads may build the same children at once; prometheus-client hands both the
        # same objects, so either may win the assignment.
        series = _series[key] = _Series(
            QUEUE_WAIT.labels(*key),
            TTFB.labels(*key),
            DURATION.labels(*key),
            PROMPT_TOKENS.labels(*key),
            CACHED_TOKENS.labels(*key),
            COMPLETION_TOKENS.labels(*key),
            PREFIX_PREDICTED.labels(host),
            PREFIX_REPORTED.labels(host),
            PREFIX_CONFIRMED.labels(host),
        )
    return series


def observe(record: RequestRecord) -> None:
    """Count one finished request. Cheap, thread-safe, never touches the database."""
    # A model no host served may be any name a client sent; the model of a refusal is one the
    # full hosts serve.
    model = record.model if record.host or record.refused_by else ""
    status = str(record.status)
    code = code_label(record.code)
    # An unknown route's name is whatever the client sent: its row keeps it, a label may not.
    route = "" if record.code == "unknown_route" else record.route
    REQUESTS.labels(route, record.host, model, status, code).inc()
    series = _series_for(route, record.host, model)
    if record.refused_by:
        for host in record.refused_by.split():
            REFUSALS.labels(route, host, model, code).inc()
    elif record.host:
        series.queue_wait.observe(record.queued_ms / 1000)
    if record.ttfb_ms is not None:
        series.ttfb.observe(record.ttfb_ms / 1000)
    series.duration.observe(record.total_ms / 1000)
    if record.prompt_tokens:
        series.prompt.inc(record.prompt_tokens)
    if record.cached_tokens:
        series.cached.inc(record.cached_tokens)
    if record.completion_tokens:
        series.completion.inc(record.completion_tokens)
    if record.lease:
        LEASES.labels(record.route, record.host, record.lease).inc()
        if is_cold_turn(record.lease, record.prompt_tokens, record.cached_tokens):
            COLD_TURNS.labels(record.route, record.host).inc()
    predicted, reported = record.predicted_cached_blocks, record.reported_cached_blocks
    if predicted is not None and reported is not None:
        series.predicted_blocks.inc(predicted)
        series.reported_blocks.inc(reported)
        series.confirmed_blocks.inc(min(predicted, reported))
        if is_cache_lost(predicted, reported):
            CACHE_LOST.labels(record.host).inc()
    if record.fallback:
        FALLBACKS.labels(record.route, record.fallback).inc()
    if record.client:
        client_metrics.observe(record, status)
    recent.add(record)
    history.history.observe(record)
    dashboard_share.observe(record)
    _start_sampling()


def _start_sampling() -> None:
    """Make sure the dashboard's history samples the hosts, from the first request on, and,
    with shared state, that this process shares what the dashboard shows."""
    runtime = current_runtime()
    if runtime is None or runtime.loop.is_closed():
        return
    if history.sampling(runtime) and dashboard_share.sharing(runtime):
        return
    try:
        here = asyncio.get_running_loop() is runtime.loop
    except RuntimeError:
        here = False
    if here:
        start_history(runtime)
    else:
        runtime.loop.call_soon_threadsafe(start_history, runtime)


def start_history(runtime: Runtime) -> None:
    """Sample `runtime`'s hosts for the dashboard's history, and with shared state publish
    this process's share (routing/ops/dashboard_share.py). Call on the runtime's loop."""
    history.ensure_sampler(runtime)
    dashboard_share.share_fleet(runtime, recent)


class StateCollector:
    """The gateway's state at scrape time: slots, queues, host health, leases, the recorder,
    model placement. Reads `current_runtime()`; call `collect` on its loop (the view does)."""

    def collect(self) -> Iterator[Metric]:
        runtime = current_runtime()
        if runtime is not None:
            yield from _runtime_state(runtime)
        recorder = get_recorder()
        yield GaugeMetricFamily(
            "crossbar_recorder_backlog",
            "Accounting rows waiting to be written to the database.",
            value=recorder.backlog,
        )
        yield GaugeMetricFamily(
            "crossbar_recorder_spooled",
            "Accounting rows in the spool on local disk, waiting for the database (kept at "
            "a stop, written at the next start).",
            value=recorder.spooled,
        )
        yield CounterMetricFamily(
            "crossbar_recorder_dropped",
            "Accounting rows lost: backlog full, refused by the database, or unwritten at stop.",
            value=recorder.dropped,
        )
        yield CounterMetricFamily(
            "crossbar_recorder_written", "Accounting rows written.", value=recorder.written
        )


def _runtime_state(runtime: Runtime) -> Iterator[Metric]:
    lives = host_lives(runtime)
    yield from _pair_state(runtime, lives)
    yield from _host_state(lives)
    yield from model_metrics(runtime)
    yield from client_metrics.state(runtime)

    if runtime.shared is not None:
        yield GaugeMetricFamily(
            "crossbar_shared_state_up",
            "1 while the shared state (Redis) answers; 0 while proxied requests get 503.",
            value=1 if runtime.shared.available else 0,
        )


def _pair_state(runtime: Runtime, lives: tuple[HostLive, ...]) -> Iterator[Metric]:
    """Per host and model: slots in flight and configured, the queue and its places, whether
    slots are named, and the answers that found a named slot taken."""
    pairs = ["host", "model"]
    in_flight = GaugeMetricFamily("crossbar_in_flight", "Requests holding a slot.", labels=pairs)
    queued = GaugeMetricFamily("crossbar_queued", "Requests waiting for a slot.", labels=pairs)
    slots = GaugeMetricFamily(
        "crossbar_slots", "Slots (parallel) configured per host and model.", labels=pairs
    )
    queue_max = GaugeMetricFamily(
        "crossbar_queue_max", "Queue places configured per host and model.", labels=pairs
    )
    naming = GaugeMetricFamily(
        "crossbar_slot_naming",
        "1 while conversations are told their slots on the host (id_slot), 0 once it was found "
        "emptying one of them twice between named requests; absent where none is named.",
        labels=pairs,
    )
    shared_lost = CounterMetricFamily(
        "crossbar_shared_slot_lost",
        "Answers on a named slot another conversation used last that found only what the two "
        "prompts share, where the prefix index expected this conversation's own history: the "
        "host took the slot as it was (llama-server's --slot-prompt-similarity at its 0.1 "
        "default; 0.95 loads the conversation back from --cache-ram) or its --cache-ram no "
        "longer held the conversation. Counted since the host was last read (it came up or "
        "changed): a host restarted, with the setting changed or not, starts again from 0.",
        labels=pairs,
    )
    for host in lives:
        for model in host.models:
            labels = [host.name, model.name]
            shared_lost.add_metric(labels, model.shared_slot_lost)
            in_flight.add_metric(labels, model.in_flight)
            queued.add_metric(labels, model.queued)
            slots.add_metric(labels, model.parallel)
            queue_max.add_metric(labels, model.queue_max)
            if model.slot_naming is not None:
                naming.add_metric(labels, 1 if model.slot_naming else 0)
    for pair in departed(runtime):  # until their requests end: a leak there must show
        in_flight.add_metric([pair.host, pair.model], pair.in_flight)
        queued.add_metric([pair.host, pair.model], pair.queued)
    yield from (in_flight, queued, slots, queue_max, naming, shared_lost)


def _host_state(lives: tuple[HostLive, ...]) -> Iterator[Metric]:
    """Per host: its health state, whether it drains, the leases it holds."""
    state = GaugeMetricFamily(
        "crossbar_host_state",
        "1 for the host's current health state (unknown, up, loading, down), else 0.",
        labels=["host", "state"],
    )
    draining = GaugeMetricFamily(
        "crossbar_host_draining", "1 while the host drains.", labels=["host"]
    )
    leases = GaugeMetricFamily(
        "crossbar_leases_held", "Unexpired conversation leases on the host.", labels=["host"]
    )
    for host in lives:
        for each in HostState:
            state.add_metric([host.name, each.value], 1 if each == host.state else 0)
        draining.add_metric([host.name], 1 if host.draining else 0)
        leases.add_metric([host.name], host.leases)
    yield from (state, draining, leases)


REGISTRY.register(StateCollector())


def _authorized(request: HttpRequest, token: str) -> bool:
    presented = bearer_token(request.headers.get("Authorization"))
    return hmac.compare_digest(presented.encode(), token.encode())


@require_safe
async def metrics_view(request: HttpRequest) -> HttpResponse:
    """`/metrics` in Prometheus' text format; a bearer token when CROSSBAR_METRICS_TOKEN is set."""
    token = settings.CROSSBAR["METRICS_TOKEN"]
    if token and not _authorized(request, token):
        response = HttpResponse(
            "send the metrics token as Authorization: Bearer <token>\n",
            status=401,
            content_type="text/plain; charset=utf-8",
        )
        response["WWW-Authenticate"] = 'Bearer realm="crossbar metrics"'
        return response
    runtime = await get_runtime()
    await runtime.refresh()
    start_history(runtime)
    return HttpResponse(generate_latest(REGISTRY), content_type=CONTENT_TYPE_LATEST)
