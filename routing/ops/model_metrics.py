"""Fleet model placement's metrics, read from the runtime's model actor at scrape time
(routing/models_actor): the loads it began, by host, model and reason (`demand`, `pinned`,
`min_loaded`); how long its loads took (from the load's request to the host's `/models`
saying `loaded`, as the poller read it); and which models the hosts it places on hold loaded
now. Nothing without an actor (with CROSSBAR_REDIS_URL, none places models yet).

Labels are bounded by the configuration: host and model names, and decide's reasons."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.metrics_core import Metric

from routing.core.model_placement import Status
from routing.models_actor.decisions import LOAD_BUCKETS
from routing.models_actor.fleet_view import pairs
from routing.runtime import Runtime


def model_metrics(runtime: Runtime) -> Iterator[Metric]:
    actor = runtime.models
    if actor is None:
        return
    decisions = actor.decisions
    loads = CounterMetricFamily(
        "crossbar_model_loads",
        "Model loads crossbar began on router-mode hosts, by the decision's reason.",
        labels=["host", "model", "reason"],
    )
    for (host, model, reason), count in sorted(decisions.loads.items()):
        loads.add_metric([host, model, reason], count)
    yield loads
    counts = zip(LOAD_BUCKETS, decisions.load_buckets, strict=True)
    buckets = [(f"{bound:g}", count) for bound, count in counts]
    buckets.append(("+Inf", decisions.load_count))
    yield HistogramMetricFamily(
        "crossbar_model_load_seconds",
        "Seconds a model load crossbar began took, until the host's /models said loaded.",
        buckets=buckets,
        sum_value=decisions.load_sum,
    )
    loaded = GaugeMetricFamily(
        "crossbar_model_loaded",
        "1 for each model loaded on a router-mode host crossbar places models on, 0 if not.",
        labels=["host", "model"],
    )
    for (host, model), pair in sorted(pairs(runtime.fleet, runtime.health).items()):
        loaded.add_metric([host, model], 1.0 if pair.status is Status.LOADED else 0.0)
    yield loaded
