"""The twin's rows, counted as they are written: it stands in the recorder
(`accounting.recorder.use_recorder`), so what the table says comes from the rows the gateway
writes, as `requests_report` reads them from the database, without keeping a million of them."""

from __future__ import annotations

import statistics
from array import array
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from accounting.rows import RequestRecord

# The codes of a request the gateway refused (placement's answers), as against one a host failed.
REFUSALS = frozenset(
    {"queue_full", "no_healthy_host", "queue_timeout", "host_removed", "pinned_host_down"}
)


@dataclass(frozen=True, slots=True)
class ModelFigures:
    """One model's part of a run (a run serving several: `Tally(by_model=True)`), and the
    loads its hosts made of it."""

    model: str
    requests: int
    served: int
    refused: int  # refused or failed
    ttfb: tuple[float, float]  # p50, p95 of the served
    loads: int = 0
    loading_s: float = 0.0


@dataclass(frozen=True, slots=True)
class ClientFigures:
    """One client's part of a run (a run told who sends what: `Tally(clients=...)`)."""

    client: str
    requests: int
    served: int
    refused: int  # refused or failed
    queue_full: int  # of which refused at once, every line of the route full
    ttfb: tuple[float, float]  # p50, p95 of the served
    generated: int
    slot_s: float  # its requests' slot time: from the grant to the end, summed
    longest_wait_s: float  # the longest any request waited in a line (served, or timed out)


@dataclass(frozen=True, slots=True)
class Figures:
    """One run's figures, as the table prints them (times in seconds)."""

    requests: int
    served: int
    refused: int
    failed: int
    evaluated: int  # prompt tokens the hosts evaluated
    cached: int  # prompt tokens the hosts had cached
    generated: int
    ttfb: tuple[float, float, float]  # p50, p95, p99 of the served
    queued: tuple[float, float]  # p50, p95 of the served
    spills: int
    shares: tuple[float, ...]  # each host's part of the served requests, by host name
    by_model: tuple[ModelFigures, ...] = ()  # a run serving several models: each one's
    by_client: tuple[ClientFigures, ...] = ()  # a run told who sends what: each client's
    elapsed_s: float = 0.0  # from the first arrival's time 0 to the last request's end
    # Priced patience's waits in line that home ended (`Figures.waited`): how many, how many
    # of them were priced at nothing, and the median of the others' wait over its price.
    waits: int = 0
    priced_nothing: int = 0
    wait_over_price: float = 0.0

    def client(self, name: str) -> ClientFigures:
        return next(figures for figures in self.by_client if figures.client == name)

    @property
    def cache_fraction(self) -> float:
        total = self.evaluated + self.cached
        return self.cached / total if total else 0.0

    @property
    def loads(self) -> int:
        return sum(model.loads for model in self.by_model)

    @property
    def loading_s(self) -> float:
        return sum(model.loading_s for model in self.by_model)


class _Client:
    """One client's counts, as rows come."""

    __slots__ = (
        "requests", "refused", "queue_full", "ttfb_ms", "generated", "slot_ms", "waited_ms",
    )  # fmt: skip

    def __init__(self) -> None:
        self.requests = self.refused = self.queue_full = self.generated = 0
        self.slot_ms = self.waited_ms = 0
        self.ttfb_ms = array("q")

    def record(self, row: RequestRecord) -> None:
        self.requests += 1
        if row.status >= 400:
            self.refused += 1
            self.queue_full += row.code == "queue_full"
            if row.code == "queue_timeout":  # it waited its whole time in a line
                self.waited_ms = max(self.waited_ms, row.total_ms)
            return
        self.ttfb_ms.append(row.ttfb_ms or 0)
        self.generated += row.completion_tokens or 0
        self.slot_ms += row.total_ms - row.queued_ms
        self.waited_ms = max(self.waited_ms, row.queued_ms)

    def figures(self, name: str) -> ClientFigures:
        return ClientFigures(
            name, self.requests, len(self.ttfb_ms), self.refused, self.queue_full,
            _percentiles(self.ttfb_ms, (50, 95)),  # type: ignore[arg-type]
            self.generated, self.slot_ms / 1000, self.waited_ms / 1000,
        )  # fmt: skip


class Tally:
    """Counts rows as the recorder would write them; with `by_model`, each model's too; with
    `clients` (a conversation's fingerprint: its client), each client's. A row names its
    client key's name when the request presented a key; a request without one (every request
    of a run without keys) is its conversation's client, by the row's fingerprint."""

    def __init__(self, by_model: bool = False, clients: Mapping[str, str] | None = None) -> None:
        self.requests = self.served = self.refused = self.failed = 0
        self.evaluated = self.cached = self.generated = self.spills = 0
        self.ttfb_ms = array("q")
        self.queued_ms = array("q")
        self.hosts: Counter[str] = Counter()
        self.codes: Counter[str] = Counter()
        self.spooled = 0  # the recorder's attribute the status page reads
        self.by_model = by_model
        self.model_requests: Counter[str] = Counter()
        self.model_refused: Counter[str] = Counter()
        self.model_ttfb_ms: dict[str, array[int]] = {}
        self.clients = clients
        self.by_client: dict[str, _Client] = {}
        self.elapsed_s = 0.0

    def record(self, row: RequestRecord) -> None:
        self.requests += 1
        if self.clients is not None:
            name = row.client or self.clients.get(row.fingerprint, "")
            counts = self.by_client.get(name)
            if counts is None:
                counts = self.by_client[name] = _Client()
            counts.record(row)
        if self.by_model:
            self.model_requests[row.model] += 1
            if row.status >= 400:
                self.model_refused[row.model] += 1
            else:
                self.model_ttfb_ms.setdefault(row.model, array("q")).append(row.ttfb_ms or 0)
        if row.status >= 400:
            self.codes[row.code] += 1
            if row.code in (
                "queue_full",
                "no_healthy_host",
                "queue_timeout",
                "host_removed",
                "pinned_host_down",
            ):
                self.refused += 1
            else:
                self.failed += 1
            return
        self.served += 1
        prompt, cached = row.prompt_tokens or 0, row.cached_tokens or 0
        self.evaluated += prompt - cached
        self.cached += cached
        self.generated += row.completion_tokens or 0
        self.ttfb_ms.append(row.ttfb_ms or 0)
        self.queued_ms.append(row.queued_ms)
        self.hosts[row.host] += 1
        if row.placement == "spilled":
            self.spills += 1

    def figures(self, hosts: list[str]) -> Figures:
        served = self.served or 1
        return Figures(
            self.requests, self.served, self.refused, self.failed, self.evaluated, self.cached,
            self.generated,
            _percentiles(self.ttfb_ms, (50, 95, 99)),  # type: ignore[arg-type]
            _percentiles(self.queued_ms, (50, 95)),  # type: ignore[arg-type]
            self.spills, tuple(self.hosts[name] / served for name in hosts),
            tuple(self._model(model) for model in sorted(self.model_requests)),
            tuple(self.by_client[name].figures(name) for name in sorted(self.by_client)),
            self.elapsed_s,
        )  # fmt: skip

    def _model(self, model: str) -> ModelFigures:
        ttfb = self.model_ttfb_ms.get(model, array("q"))
        return ModelFigures(
            model, self.model_requests[model], len(ttfb), self.model_refused[model],
            _percentiles(ttfb, (50, 95)),  # type: ignore[arg-type]
        )  # fmt: skip


def _percentiles(values: array[int], points: tuple[int, ...]) -> tuple[float, ...]:
    """Nearest-rank percentiles, in seconds (0 for none)."""
    if not values:
        return tuple(0.0 for _ in points)
    ordered = sorted(values)
    last = len(ordered) - 1
    return tuple(ordered[min(last, (len(ordered) * p + 99) // 100 - 1)] / 1000 for p in points)


def with_waits(figures: Figures, waits: Sequence[tuple[float, float]]) -> Figures:
    """`figures` with priced patience's waits in line, each (priced, had) in seconds: the wait
    the line was priced at as the request joined it (before the lateness correction), and the
    wait it had until home gave it a slot."""
    ratios = sorted(had / priced for priced, had in waits if priced > 0)
    middle = statistics.median(ratios) if ratios else 0.0
    nothing = sum(1 for priced, _ in waits if priced <= 0)
    return replace(figures, waits=len(waits), priced_nothing=nothing, wait_over_price=middle)
