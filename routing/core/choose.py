"""Rank a route's hosts for a request: which to try first."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Candidate", "RankKey", "rank_key", "ranked"]

# What orders a route's eligible hosts, smallest first (see `ranked`).
RankKey = tuple[bool, bool, bool, float, int, int, int]


@dataclass(slots=True, frozen=True)
class Candidate:
    """What the chooser knows about one host of a route, for one model.

    ``loaded``: the model is resident on the host. ``can_serve``: the host's configuration lists
    the model. ``free`` and ``queued`` are the limiter's counts for this (host, model);
    ``leases`` the conversations the host holds. ``evicts_busy``: the host loads models on
    demand (router mode), this one is not loaded, and loading it would unload a model with
    requests in flight or conversations leased. ``crowded``: the host has as many conversations
    leased for the model as it has slots for it, so a new one there would overwrite one of
    theirs in its KV cache (a llama-server keeps one prompt per slot). ``answers``: a request
    for the model sent there is served; False for a host that does not load models on demand
    (a router started with ``--no-models-autoload``) and has not loaded this one: it would
    answer 400 "model is not loaded" (or, while it loads, 503 "Loading model"), so it is not
    eligible.
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
    crowded: bool = False
    answers: bool = True

    @property
    def eligible(self) -> bool:
        return (
            self.healthy and not self.draining and (self.loaded or self.can_serve) and self.answers
        )


def ranked(candidates: Sequence[Candidate]) -> list[str]:
    """The eligible hosts, best first. Pure; never raises.

    Eligible: healthy, not draining, the model loaded or listed, and a host that would answer
    a request for it (``answers``). Hosts with the model loaded
    come before hosts that merely list it, and among those, hosts with room to load it before
    hosts where loading it would unload a busy model; then hosts with room for one more
    conversation's cache before crowded ones (placement still takes a free slot on a crowded
    host before a place in a line elsewhere); then the highest ``free * weight``; ties go to
    the host holding fewer leases (so conversations arriving one at a time spread), then to
    the shorter queue, then to route order. A full host (``free == 0``) is still ranked: its
    request may queue there.
    """
    keyed = [(rank_key(c, index), c.host) for index, c in enumerate(candidates) if c.eligible]
    keyed.sort()
    return [host for _, host in keyed]


def rank_key(candidate: Candidate, index: int) -> RankKey:
    """Where an eligible candidate goes in `ranked`'s order (`index`: its place in the route).
    Unique per host of a route, since the index ends it."""
    return (
        not candidate.loaded,
        candidate.evicts_busy,
        candidate.crowded,
        -candidate.free * candidate.weight,
        candidate.leases,
        candidate.queued,
        index,
    )
