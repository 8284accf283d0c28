"""Pick the host for a new lease among a route's candidates."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Candidate", "best"]


@dataclass(slots=True, frozen=True)
class Candidate:
    """What the chooser knows about one host of a route, for one model.

    ``loaded``: the model is resident on the host. ``can_serve``: the host's configuration lists
    the model. ``free`` and ``queued`` are the limiter's counts for this (host, model).
    """

    host: str
    healthy: bool
    draining: bool
    loaded: bool
    can_serve: bool
    free: int
    queued: int
    weight: float


def best(candidates: Sequence[Candidate]) -> str | None:
    """Return the host to lease, or None when no candidate is eligible.

    Eligible: healthy, not draining, and the model loaded or listed. Hosts with the model loaded
    win over hosts that merely list it. Among those, the highest ``free * weight`` wins; ties go
    to the lowest ``queued``, then to the earlier candidate (route order). A full host
    (``free == 0``) is still eligible: its request will queue. Pure; never raises.
    """
    loaded: Candidate | None = None
    listed: Candidate | None = None
    for candidate in candidates:
        if not candidate.healthy or candidate.draining:
            continue
        if candidate.loaded:
            if loaded is None or _beats(candidate, loaded):
                loaded = candidate
        elif candidate.can_serve and loaded is None:
            if listed is None or _beats(candidate, listed):
                listed = candidate
    winner = loaded if loaded is not None else listed
    return winner.host if winner is not None else None


def _beats(challenger: Candidate, holder: Candidate) -> bool:
    # Strict comparisons keep the earlier candidate on a full tie.
    challenger_score = challenger.free * challenger.weight
    holder_score = holder.free * holder.weight
    if challenger_score != holder_score:
        return challenger_score > holder_score
    return challenger.queued < holder.queued
