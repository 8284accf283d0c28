"""The gateway's live state of each host, built from the runtime in one place.

`host_lives` is the only reader of the runtime's health, lease and limiter tables for display:
the dashboard, `/metrics` and the host admin all see what it returns; `standings` reads the
same tables for the few hosts a refusal names, and `host_loads` the counts alone for the
history's sample every second. `live_host_states` is the
host admin's provider, safe to call from another thread.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from hosts.health import HostState
from hosts.live import HostLive, HostLoad, HostStates, ModelLive
from routing.config.reader import load_fleet
from routing.core.limiter import PairSnapshot
from routing.core.pairs import Pair
from routing.core.refusals import Standing
from routing.live_fleet import not_loaded
from routing.runtime import Runtime, current_runtime
from routing.signals import config_generation


def host_lives(runtime: Runtime) -> tuple[HostLive, ...]:
    """Every configured host with its models, sorted by name. Call on the runtime's loop."""
    health = runtime.health.snapshot()
    held = runtime.state.leases_by_host()
    pairs = {Pair(snap.host, snap.model): snap for snap in runtime.state.snapshot()}
    routed = {name for route in runtime.fleet.routes.values() for name in route.hosts}
    hosts = []
    for name, host in sorted(runtime.fleet.hosts.items()):
        known = health.get(name)
        models = []
        for model in sorted(host.models.values(), key=lambda m: m.name):
            pair = pairs.get(Pair(name, model.name))
            models.append(
                ModelLive(
                    name=model.name,
                    in_flight=pair.in_flight if pair else 0,
                    parallel=model.parallel,
                    queued=pair.queued if pair else 0,
                    queue_max=model.queue_max,
                    slot_naming=runtime.live.slot_naming(name, model.name),
                    shared_slot_lost=runtime.live.shared_slot_lost(name, model.name),
                )
            )
        hosts.append(
            HostLive(
                name=name,
                enabled=host.enabled,
                draining=host.draining,
                state=known.state if known else HostState.UNKNOWN,
                reason=known.reason if known else "",
                since=known.since if known else None,
                leases=held.get(name, 0),
                models=tuple(models),
                slots=known.described.slots if known and known.described else None,
                in_a_route=name in routed,
            )
        )
    return tuple(hosts)


def departed(runtime: Runtime) -> list[PairSnapshot]:
    """The (host, model) pairs no longer configured (a host deleted or renamed, a model
    taken off a host) where requests still hold slots or wait: they end where they run, and
    until then the count says so, so that a slot never given back there still shows."""
    hosts = runtime.fleet.hosts
    return [
        pair
        for pair in runtime.state.snapshot()
        if (pair.in_flight or pair.queued)
        and (pair.host not in hosts or pair.model not in hosts[pair.host].models)
    ]


def host_loads(runtime: Runtime) -> list[HostLoad]:
    """Every configured host's requests in flight and queued, over its models, as `host_lives`
    counts them; a fraction of its cost, for a sample every second of every host (200 hosts:
    a tenth of an idle gateway's upkeep went to building `host_lives` for it)."""
    state = runtime.state
    return [
        HostLoad(
            name,
            sum(state.in_flight(name, model) for model in host.models),
            sum(state.queued(name, model) for model in host.models),
        )
        for name, host in runtime.fleet.hosts.items()
    ]


def live_host_states() -> HostStates:
    """Each host's live state, read on the runtime's own loop; safe from any thread.

    Blocks the calling thread (an admin view's) for at most a second, once the fleet is read;
    {} when no gateway runs in this process. From another thread, a configuration change this
    process made is loaded first, as a request would: the page after an admin action shows
    the state the action made.
    """
    runtime = current_runtime()
    if runtime is None or runtime.loop.is_closed():
        return {}
    try:
        running_here = asyncio.get_running_loop() is runtime.loop
    except RuntimeError:
        running_here = False
    if running_here:
        return {host.name: host for host in host_lives(runtime)}
    # Read here, in the caller's thread: a sync view holds the thread `Runtime.reload` would
    # read the fleet in, so the loop cannot read it while this thread waits for the answer.
    generation = config_generation()
    fleet = load_fleet() if runtime.stale() else None

    async def read() -> tuple[HostLive, ...]:
        if fleet is not None:
            await runtime.adopt(generation, fleet)
        return host_lives(runtime)

    lives = asyncio.run_coroutine_threadsafe(read(), runtime.loop).result(timeout=1)
    return {host.name: host for host in lives}


def standings(runtime: Runtime, hosts: Iterable[str], model: str | None) -> list[Standing]:
    """The named hosts as a refusal describes them (`routing.core.refusals`), for `model`
    (None: over all their models), in the order given; hosts no longer configured are left
    out. Only a refused request calls this: it costs a few lookups per host. The counts are
    the fleet state's (with shared state: this process's view, refreshed every tick)."""
    found = []
    for name in hosts:
        host = runtime.fleet.hosts.get(name)
        if host is None:
            continue
        health = runtime.health.get(name)
        if model is None:
            specs = list(host.models.values())
        else:
            specs = [host.models[model]] if model in host.models else []
        state = runtime.state
        found.append(
            Standing(
                host=name,
                health=str(health.state),
                since=health.since,
                reason=health.reason,
                enabled=host.enabled,
                draining=host.draining,
                in_flight=sum(state.in_flight(name, spec.name) for spec in specs),
                parallel=sum(spec.parallel for spec in specs),
                queued=sum(state.queued(name, spec.name) for spec in specs),
                queue_max=sum(spec.queue_max for spec in specs),
                not_loaded=not_loaded(host, model, health) if model is not None else "",
            )
        )
    return found
