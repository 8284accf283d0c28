"""The record of one proxied request: built once, when it ends, from plain values.

The request's lifecycle (`routing.proxy.lifecycle`) learns its facts step by step (route,
client, model, host, ...) as a `Trail` of plain values, and how it ended as an `Outcome`;
`finish` writes exactly one accounting row from the two, counts the metrics and logs one line.
The lifecycle is the one owner of the request's end, so `finish` runs once by construction; it
never touches the database (the recorder's thread writes the row).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, NamedTuple

from accounting.recorder import RequestRecord, get_recorder
from accounting.rows import within_columns
from routing.core.clock import loop_time as clock
from routing.core.fairness import Work
from routing.core.named_slots import NamedSlot
from routing.core.patience import Priced
from routing.core.placement import Placement
from routing.core.prefixes import NO_PREFIX, Prefix
from routing.core.tee import Usage
from routing.ops import metrics

log = logging.getLogger("crossbar.proxy")

NO_USAGE = Usage(None, None, None)


@dataclass(slots=True, frozen=True)
class Arrival:
    """When a request arrived: wall clock for the row, the request's `clock` for durations."""

    started: datetime = field(default_factory=lambda: datetime.now(UTC))
    t0: float = field(default_factory=clock)

    def elapsed_ms(self) -> int:
        return int((clock() - self.t0) * 1000)


class Trail(NamedTuple):
    """What is known of a request so far: plain values, no resources (the lifecycle holds
    those). Immutable: each step makes the next (`_replace`).

    A named tuple rather than a frozen dataclass: a request makes seven or so, and a frozen
    dataclass of this size costs 15 µs to build or `replace` (each field set through
    `object.__setattr__`), five times a tuple's; together 2% of a streamed request's CPU."""

    arrival: Arrival
    route: str = ""  # the route the client asked for
    client: str = ""  # the client key's name
    model: str = ""
    fingerprint: str = ""
    host: str = ""
    lease: str = ""
    placement: str = "none"
    fallback: str = ""
    queued_ms: int = 0
    ttfb_ms: int | None = None
    streamed: bool = False
    refused_by: tuple[str, ...] = ()  # the hosts that were full when the route refused it
    prefix: Prefix = NO_PREFIX  # the prompt in blocks (routing/core/prefixes.py)
    predicted_blocks: int | None = None  # the prefix index's guess of the host's cached blocks
    reported_blocks: int | None = None  # the host's word (its cached tokens, in blocks)
    patience: Priced | None = None  # priced patience's choice, when it priced the wait
    named_slot: NamedSlot | None = None  # the slot named on the host (`LiveFleet.id_slot`)
    load_waited: float | None = None  # seconds it waited for its model's load (proxy/loading)

    def placed(self, placement: Placement) -> Trail:
        """Where the request runs. `route` stays the route the client asked for; a wait for
        its model's load is placement `loaded`, and counts in its queued time."""
        loaded = self.load_waited
        return self._replace(
            host=placement.host,
            lease=str(placement.lease),
            placement=str(placement.reason) if loaded is None else "loaded",
            model=placement.model,
            fallback=placement.fallback,
            queued_ms=int((placement.waited + (loaded or 0.0)) * 1000),
            patience=placement.patience,
        )


@dataclass(slots=True, frozen=True)
class Outcome:
    """How a request ended, as its row says it: the status, the error and its code (empty for
    none), the host's token counts, and the host's time evaluating the prompt (`prompt_ms`)."""

    status: int
    error: str = ""
    code: str = ""
    usage: Usage = NO_USAGE
    prompt_ms: float | None = None

    def work(self) -> Work:
        """What the host did for the request (`work_done`)."""
        return work_done(self.usage)

    def tokens(self) -> int:
        """What the request spent of its key's budgets: prompt tokens (cached ones included)
        plus generated tokens, as its row counts them; an unknown count spends none."""
        return (self.usage.prompt_tokens or 0) + (self.usage.completion_tokens or 0)


def work_done(usage: Usage) -> Work:
    """What a host did for a request, from the counts its row gets: prompt tokens it evaluated
    (those it found cached apart) and tokens it generated; none unsaid."""
    prompt, cached = usage.prompt_tokens or 0, usage.cached_tokens or 0
    return Work(max(0, prompt - cached), cached, usage.completion_tokens or 0)


def refused_by(trail: Trail, hosts: tuple[str, ...]) -> Trail:
    """A request the route refused because `hosts` were full: the refusal is the route's, so
    its row names no host (no host failed it) and lists the full ones in `refused_by`."""
    return trail._replace(host="", refused_by=hosts)


def finish(trail: Trail, outcome: Outcome) -> None:
    """The request's row, its metrics, its log line."""
    status, error, usage = outcome.status, outcome.error, outcome.usage
    total_ms = trail.arrival.elapsed_ms()
    record = within_columns(
        RequestRecord(
            route=trail.route,
            fingerprint=trail.fingerprint,
            model=trail.model,
            host=trail.host,
            started=trail.arrival.started,
            queued_ms=trail.queued_ms,
            ttfb_ms=trail.ttfb_ms,
            total_ms=total_ms,
            status=status,
            streamed=trail.streamed,
            lease=trail.lease,
            prompt_tokens=usage.prompt_tokens,
            cached_tokens=usage.cached_tokens,
            completion_tokens=usage.completion_tokens,
            error=error,
            client=trail.client,
            fallback=trail.fallback,
            placement=trail.placement,
            code=outcome.code,
            refused_by=" ".join(trail.refused_by),
            predicted_cached_blocks=trail.predicted_blocks,
            reported_cached_blocks=trail.reported_blocks,
            **_patience_fields(trail.patience),
        )
    )  # before the metrics count a host's absurd figure
    get_recorder().record(record)
    metrics.observe(record)
    log.info(
        "route=%s model=%s host=%s status=%d placement=%s lease=%s queued_ms=%d total_ms=%d "
        "fp=%s%s%s",
        trail.route or "-",
        trail.model or "-",
        trail.host or "-",
        status,
        trail.placement,
        trail.lease or "-",
        trail.queued_ms,
        total_ms,
        trail.fingerprint[:8] or "-",
        f" patience={said(trail.patience)}" if trail.patience is not None else "",
        f" error={error!r}" if error else "",
    )


def said(priced: Priced) -> str:
    """A choice as the log line and `X-Crossbar-Patience` say it: `spill stay_ms=5200
    spill_ms=800` (`-` for a price it did not have)."""
    stay, spill = (_ms(price) for price in (priced.stay, priced.spill))
    return f"{priced.choice} stay_ms={_shown(stay)} spill_ms={_shown(spill)}"


def _shown(ms: int | None) -> str:
    return "-" if ms is None else str(ms)


def _patience_fields(priced: Priced | None) -> dict[str, Any]:
    """The row's patience fields for a choice (empty ones for none)."""
    if priced is None:
        return {"patience": "", "patience_stay_ms": None, "patience_spill_ms": None}
    return {
        "patience": str(priced.choice),
        "patience_stay_ms": _ms(priced.stay),
        "patience_spill_ms": _ms(priced.spill),
    }


# The row's columns hold up to this (PostgreSQL's integer): a price from a host measured
# absurdly slow must not make the database refuse the row.
_MAX_MS = 2**31 - 1


def _ms(seconds: float | None) -> int | None:
    return None if seconds is None else min(round(seconds * 1000), _MAX_MS)
