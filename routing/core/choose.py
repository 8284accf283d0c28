"""Rank a route's hosts for a request: which to try first."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Candidate", "ranked"]


@dataclass(slots=True, frozen=True)
class Candidate:
    """What the chooser knows about one host of a route, for one model.

    ``loaded``: the model is resident on the host. ``can_serve``: the host's configuration lists
    the model. ``free`` and ``queued`` are the limiter's counts for this (host, model);
    ``leases`` the conversations the host holds. ``evicts_busy``: the host loads models on
    demand (router mode), this one is not loaded, and loading it would unload a model with
    requests in flight or conversations leased.
    """

    host: str
    healthy: bool
    draining: bool
    loaded: bool
    can_serve: bool
    free: int
    queued: int
    weight: float
    leases: int = 0
    evicts_busy: bool = False

    @property
    def eligible(self) -> bool:
        return self.healthy and not self.draining and (self.loaded or self.can_serve)


def ranked(candidates: Sequence[Candidate]) -> list[str]:
    """The eligible hosts, best first. Pure; never raises.

    Eligible: healthy, not draining, and the model loaded or listed. Hosts with the model loaded
    come before hosts that merely list it, and among those, hosts with room to load it before
    hosts where loading it would unload a busy model; then the highest ``free * weight``; ties
    go to the
    host holding fewer leases (so conversations arriving one at a time spread), then to the
    shorter queue, then to route order. A full host (``free == 0``) is still ranked: its
    request may queue there.
    """
    eligible = [(index, c) for index, c in enumerate(candidates) if c.eligible]
    eligible.sort(
        key=lambda entry: (
            not entry[1].loaded,
            entry[1].evicts_busy,
            -entry[1].free * entry[1].weight,
            entry[1].leases,
            entry[1].queued,
            entry[0],
        )
    )
    return [candidate.host for _, candidate in eligible]
