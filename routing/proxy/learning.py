"""What a request's answer teaches the runtime once it has ended, in one call for the lifecycle.

Three loops close here: the hosts' figures learn the host's prompt speed (`figures.measured`),
the prefix index what the host holds now and how far its guess was off
(`prefix_check.settled`), and the named slots how the conversation's slot did
(`LiveFleet.named_answered`). A failed answer teaches none of them anything but the index's
correction; a request the gateway answered itself teaches nothing.
"""

from __future__ import annotations

from accounting.rows import fits
from routing.core.tee import Usage
from routing.proxy.figures import measured
from routing.proxy.prefix_check import settled
from routing.proxy.record import Outcome, Trail
from routing.runtime import Runtime


def learnt(trail: Trail, runtime: Runtime, outcome: Outcome) -> Trail:
    """Teach `runtime` what the answer of the request of `trail` says; its trail for the row
    (with the blocks the host reported cached)."""
    usage, status = as_stored(outcome.usage), outcome.status
    measured(trail, runtime, usage, outcome.prompt_ms, status)
    trail = settled(trail, runtime, usage, status)
    named = trail.named_slot
    if named is not None and status < 400:
        runtime.live.named_answered(
            named, usage.prompt_tokens, usage.cached_tokens,
            trail.predicted_blocks, trail.reported_blocks,
        )  # fmt: skip
    return trail


def as_stored(usage: Usage) -> Usage:
    """The counts as the row stores them: one beyond its column is none (the row's warning
    names the host), so an absurd count from a host teaches the figures and the prefix index
    nothing, as it tells the row nothing."""
    return Usage(
        fits("prompt_tokens", usage.prompt_tokens),
        fits("cached_tokens", usage.cached_tokens),
        fits("completion_tokens", usage.completion_tokens),
    )
