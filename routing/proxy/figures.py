"""Priced patience's loop for one request: its prices when it waits, the host's figures when
it ends (routing/core/patience.py).

Every request that held a slot teaches the runtime's `Figures` how long the slot was held,
and every answer with timings how fast its host evaluated the prompt, whatever its route's
patience: a route switched to auto finds its hosts priced already. Only a route with
`lease_patience` auto gets a `Pricing`.
"""

from __future__ import annotations

from routing.config.shape import RouteConfig
from routing.core.clock import loop_time as clock
from routing.core.patience import Pricing
from routing.core.tee import Usage
from routing.proxy.ask import Ask
from routing.proxy.record import Trail
from routing.runtime import Runtime


def pricing(runtime: Runtime, route: RouteConfig, ask: Ask) -> Pricing | None:
    """The request's prices, for a route whose patience is auto; None for a fixed one."""
    if route.lease_patience is not None or ask.model is None:
        return None
    model, hosts = ask.model, runtime.fleet.hosts

    def slots(host: str) -> int:
        config = hosts.get(host)
        spec = config.models.get(model) if config is not None else None
        return spec.parallel if spec is not None else 1

    def running(host: str) -> list[float]:
        return runtime.running.holding(host, model)

    state = runtime.state

    def owners(host: str) -> int:
        return max(0, state.leases_held(host, model) - state.in_flight(host, model))

    def free(host: str) -> int:
        return state.free_for(host, model)

    return Pricing(
        runtime.figures, runtime.prefixes, model, ask.prefix, slots, running=running,
        owners=owners, free=free,
    )  # fmt: skip


def held(trail: Trail, runtime: Runtime) -> None:
    """The request's slot is being given back: how long it was held (from its grant)."""
    placed = trail.arrival.t0 + trail.queued_ms / 1000
    runtime.figures.held(trail.host, trail.model, clock() - placed)


def measured(
    trail: Trail, runtime: Runtime, usage: Usage, prompt_ms: float | None, status: int
) -> None:
    """The host's answer has ended: what its counts (and `prompt_ms`, its time evaluating the
    uncached part) say of the host's prompt speed and of the model's units per token. A failed
    answer teaches nothing."""
    if status < 400 and trail.host:
        runtime.figures.prompted(
            trail.host, trail.model, trail.prefix, usage.prompt_tokens, usage.cached_tokens,
            prompt_ms,
        )  # fmt: skip
