"""The record of one proxied request: built once, when it ends, from plain values.

The view learns a request's facts step by step (route, client, model, host, ...) and hands them,
frozen in a `Trail`, to whatever ends the request: its own error answer, or the body that
streams the host's answer. `finish` then writes exactly one accounting row, counts the metrics
and logs one line. Each request has one owner of its end, so `finish` runs once by
construction; it never touches the database (the recorder's thread writes the row).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, NamedTuple

from accounting.recorder import RequestRecord, get_recorder
from accounting.rows import within_columns
from routing.core.clients import Admitted
from routing.core.named_slots import NamedSlot
from routing.core.patience import Priced
from routing.core.placement import Placement
from routing.core.prefixes import NO_PREFIX, Prefix
from routing.core.running import RunningRequest
from routing.core.tee import Usage
from routing.ops import metrics

log = logging.getLogger("crossbar.proxy")

NO_USAGE = Usage(None, None, None)


@dataclass(slots=True, frozen=True)
class Arrival:
    """When a request arrived: wall clock for the row, a monotonic clock for durations."""

    started: datetime = field(default_factory=lambda: datetime.now(UTC))
    t0: float = field(default_factory=time.perf_counter)

    def elapsed_ms(self) -> int:
        return int((time.perf_counter() - self.t0) * 1000)


class Trail(NamedTuple):
    """What is known of a request so far. Immutable: each step makes the next (`_replace`).

    A named tuple rather than a frozen dataclass: a request makes seven or so, and a frozen
    dataclass of this size costs 15 µs to build or `replace` (each field set through
    `object.__setattr__`), five times a tuple's; together 2% of a streamed request's CPU."""

    arrival: Arrival
    route: str = ""  # the route the client asked for
    client: str = ""  # the client key's name
    client_pass: Admitted | None = None  # given back when the request ends
    model: str = ""
    fingerprint: str = ""
    host: str = ""
    lease: str = ""
    placement: str = "none"
    fallback: str = ""
    queued_ms: int = 0
    ttfb_ms: int | None = None
    streamed: bool = False
    running: RunningRequest | None = None  # its line in the dashboard's running requests
    refused_by: tuple[str, ...] = ()  # the hosts that were full when the route refused it
    prefix: Prefix = NO_PREFIX  # the prompt in blocks (routing/core/prefixes.py)
    predicted_blocks: int | None = None  # the prefix index's guess of the host's cached blocks
    reported_blocks: int | None = None  # the host's word (its cached tokens, in blocks)
    patience: Priced | None = None  # priced patience's choice, when it priced the wait
    named_slot: NamedSlot | None = None  # the slot named on the host (`LiveFleet.id_slot`)

    def placed(self, placement: Placement) -> Trail:
        """Where the request runs. `route` stays the route the client asked for."""
        if self.running is not None:
            self.running.table.placed(
                self.running, placement.host, int(placement.waited * 1000), placement.model
            )
        return self._replace(
            host=placement.host,
            lease=str(placement.lease),
            placement=str(placement.reason),
            model=placement.model,
            fallback=placement.fallback,
            queued_ms=int(placement.waited * 1000),
            patience=placement.patience,
        )


def refused_by(trail: Trail, hosts: tuple[str, ...]) -> Trail:
    """A request the route refused because `hosts` were full: the refusal is the route's, so
    its row names no host (no host failed it) and lists the full ones in `refused_by`."""
    return trail._replace(host="", refused_by=hosts)


def finish(
    trail: Trail, status: int, error: str = "", code: str = "", usage: Usage = NO_USAGE
) -> None:
    """End the request: its row, its metrics, its log line; the client key's pass back."""
    if trail.client_pass is not None:
        trail.client_pass.release()
    if trail.running is not None:
        trail.running.table.finish(trail.running)
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
            code=code,
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
