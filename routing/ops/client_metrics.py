"""Client keys' metrics: requests and tokens counted as requests finish, and at scrape time
what each key has in flight and has spent of its budgets (routing/core/budgets.py).

The counters are registered in `routing.ops.metrics`' registry, which calls `observe` once per
request and `state` on a scrape, on the runtime's loop. With shared state, the in-flight and
spend counts live in Redis and are left out: a scrape costs no round trip.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import Counter
from prometheus_client.core import GaugeMetricFamily, Metric

from accounting.recorder import RequestRecord
from routing.runtime import Runtime

REQUESTS = Counter(
    "crossbar_client_requests",
    "Requests sent with a client key, by the key's name and HTTP status.",
    ["client", "status"],
    registry=None,
)
TOKENS = Counter(
    "crossbar_client_tokens",
    "Tokens a client key spent, as its budgets count them: prompt tokens (cached ones "
    "included) plus generated tokens.",
    ["client"],
    registry=None,
)


def observe(record: RequestRecord, status: str) -> None:
    """Count a finished request of a client key (`record.client` not empty)."""
    REQUESTS.labels(record.client, status).inc()
    TOKENS.labels(record.client).inc((record.prompt_tokens or 0) + (record.completion_tokens or 0))


def state(runtime: Runtime) -> Iterator[Metric]:
    """Per key: requests in flight; per budgeted key, its budgets and its spend (UTC)."""
    in_flight = GaugeMetricFamily(
        "crossbar_client_in_flight", "Requests in flight per client key.", labels=["client"]
    )
    budget = GaugeMetricFamily(
        "crossbar_client_budget_tokens",
        "A client key's token budget per UTC day or month (period).",
        labels=["client", "period"],
    )
    spent = GaugeMetricFamily(
        "crossbar_client_budget_spent_tokens",
        "Tokens a client key spent in the current UTC day or month (period), as its budgets "
        "count them; absent with shared state (the count is in Redis).",
        labels=["client", "period"],
    )
    gate = runtime.clients
    now = gate.now()
    for spec in runtime.fleet.clients.values():
        for period, limit in (("day", spec.tokens_per_day), ("month", spec.tokens_per_month)):
            if limit is not None:
                budget.add_metric([spec.name, period], limit)
        if runtime.shared is None:
            in_flight.add_metric([spec.name], gate.in_flight(spec.name))
            spend = gate.ledger.spend(spec.name, now)
            if spec.budgeted:
                spent.add_metric([spec.name, "day"], spend.day)
                spent.add_metric([spec.name, "month"], spend.month)
    yield from (in_flight, budget, spent)
