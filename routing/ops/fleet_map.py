"""The fleet map: where each model the model actor places is loaded or loading, since when,
idle since when, and why it is there; the models loaded nowhere with the reason no load
could place them. A pure function of what the actor saw (`ModelActor.seen`) and its last
decisions (`Decisions.last`), for the dashboard.

Why a model is on a host is the reason of the load that began its state there (`demand`,
`min_loaded`, `pinned`): a state the actor did not begin (an operator's load, a model loaded
before the gateway started, or loaded again by hand after crossbar's copy went) is "by hand /
found loaded". A state began with crossbar's load when the load (while loading) or its end
(once loaded) was decided within `SLACK` of the state's start: both are read at the same turn
of the actor's loop, so any gap is the two clocks', far under a second.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from routing.core.model_placement import Status
from routing.models_actor.decisions import Decided, reason_kind
from routing.models_actor.fleet_view import Seen

BY_HAND = "by hand / found loaded"
SLACK = 1.0  # seconds
PairKey = tuple[str, str]


@dataclass(frozen=True, slots=True)
class Placed:
    """One host a model is loaded or loading on; times in wall-clock seconds. `idle_since` is
    None while the model is busy there (a request running or queued) or still loading."""

    host: str
    status: str  # loaded | loading
    since: float
    idle_since: float | None
    why: str  # demand | min_loaded | pinned | BY_HAND
    reason: str  # the load's reason in full; "" by hand

    def as_json(self) -> dict[str, Any]:
        return {
            "host": self.host,
            "status": self.status,
            "since": _iso(self.since),
            "idle_since": _iso(self.idle_since),
            "why": self.why,
            "reason": self.reason,
        }


@dataclass(frozen=True, slots=True)
class ModelRow:
    """A model's row: its hosts, or none with the last reason a load could not place it."""

    model: str
    hosts: tuple[Placed, ...]
    unplaced: Decided | None

    def as_json(self) -> dict[str, Any]:
        unplaced = self.unplaced
        return {
            "model": self.model,
            "hosts": [placed.as_json() for placed in self.hosts],
            "unplaced": unplaced.reason if unplaced else "",
            "unplaced_at": _iso(unplaced.at if unplaced else None),
        }


def fleet_map(
    seen: Mapping[PairKey, Seen],
    last: Mapping[tuple[str, str, str], Decided],
    busy: Collection[PairKey],
) -> list[ModelRow]:
    """One row per model of `seen` (by name; hosts by name): `seen` the actor's pairs, `last`
    its last decision of each kind per pair, `busy` the pairs with requests running or
    queued."""
    rows = []
    for model in sorted({m for (_, m) in seen}):
        hosts = tuple(
            _placed(host, model, pair, last, (host, model) in busy)
            for (host, m), pair in sorted(seen.items())
            if m == model and pair.status in (Status.LOADED, Status.LOADING)
        )
        unplaced = None if hosts else last.get(("unplaced", "", model))
        rows.append(ModelRow(model, hosts, unplaced))
    return rows


def decision_log(recent: Collection[Decided], count: int) -> list[dict[str, Any]]:
    """The last `count` decisions, newest first, JSON-ready."""
    newest = list(recent)[-count:][::-1] if count > 0 else []
    return [
        {"at": _iso(d.at), "kind": d.kind, "host": d.host, "model": d.model, "reason": d.reason}
        for d in newest
    ]


def _placed(
    host: str, model: str, pair: Seen, last: Mapping[tuple[str, str, str], Decided], busy: bool
) -> Placed:
    loading = pair.status is Status.LOADING
    load = _load_that_began(host, model, pair, last)
    return Placed(
        host=host,
        status="loading" if loading else "loaded",
        since=pair.since,
        idle_since=None if busy or loading else pair.last_used,
        why=reason_kind(load.reason) if load else BY_HAND,
        reason=load.reason if load else "",
    )


def _load_that_began(
    host: str, model: str, pair: Seen, last: Mapping[tuple[str, str, str], Decided]
) -> Decided | None:
    """Crossbar's load that began the pair's state, None when crossbar did not begin it."""
    load = last.get(("load", host, model))
    if load is None:
        return None
    began = load if pair.status is Status.LOADING else last.get(("loaded", host, model))
    if began is None or began.at < load.at or abs(began.at - pair.since) > SLACK:
        return None
    return load


def _iso(at: float | None) -> str | None:
    return None if at is None else datetime.fromtimestamp(at, UTC).isoformat(timespec="seconds")
