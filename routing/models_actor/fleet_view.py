"""The fleet as the model actor sees it: which (host, model) pairs it may load and unload,
and what each router host says of them.

A pair is the actor's when its host is an enabled, undrained, eligible llama-server router
that loads no model on demand (`routing.live_fleet.loads_on_demand`: its /props says
`models_autoload: false`, or the operator's `loads_on_demand = no` where it says nothing), and
the host lists the model (under its upstream name or an alias). Hosts that load on demand load
for themselves; a plain llama-server cannot load anything.

Pure reads of the configuration and the health table; no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

from hosts.describe import Described, ModelState
from hosts.health import HealthTable
from routing.config.shape import FleetConfig, HostConfig
from routing.core.model_placement import ModelRules, Status
from routing.live_fleet import host_names, loads_on_demand

STATUS = {
    ModelState.LOADED: Status.LOADED,
    ModelState.LOADING: Status.LOADING,
    ModelState.UNLOADED: Status.UNLOADED,
    ModelState.FAILED: Status.FAILED,
}


@dataclass(frozen=True, slots=True)
class Pair:
    """A (host, model) pair the actor may act on: the name the host knows the model by, and
    the model's state there as the host's last `/models` said it."""

    host: str
    model: str  # crossbar's name
    upstream: str  # the host's name for it (sent in /models/load)
    status: Status
    slots: int  # the pair's `parallel`


class Seen(NamedTuple):
    """A pair as the actor last saw it, for the operator: its state (`loading` while a load
    begun here is under way), since when, and when it was last used (wall-clock seconds)."""

    status: Status
    since: float
    last_used: float


def placeable_hosts(config: FleetConfig, health: HealthTable) -> dict[str, Described]:
    """The hosts the actor acts on, with what they said of themselves last."""
    found = {}
    for name, host in config.hosts.items():
        described = health.get(name).described
        if (
            host.enabled
            and not host.draining
            and health.eligible(name)
            and described is not None
            and described.router
            and not loads_on_demand(host, described)
        ):
            found[name] = described
    return found


def pairs(config: FleetConfig, health: HealthTable) -> dict[tuple[str, str], Pair]:
    """Every pair the actor may act on, by (host, model)."""
    return pairs_on(config, placeable_hosts(config, health))


def pairs_on(config: FleetConfig, hosts: Mapping[str, Described]) -> dict[tuple[str, str], Pair]:
    """Every pair of `hosts` (`placeable_hosts`) the actor may act on, by (host, model)."""
    found = {}
    for name, described in hosts.items():
        for pair in _pairs_of(config.hosts[name], described):
            found[pair.host, pair.model] = pair
    return found


def _pairs_of(host: HostConfig, described: Described) -> list[Pair]:
    found = []
    for spec in host.models.values():
        upstream = next((n for n in host_names(spec) if n in described.models), None)
        if upstream is None:
            continue  # the host does not list it: it cannot load it
        status = STATUS[described.models[upstream]]
        found.append(Pair(host.name, spec.name, upstream, status, spec.parallel))
    return found


def models_max(host: HostConfig, described: Described) -> int:
    """How many models the router holds at once: its `--models-max` as it says it, else as
    many as it is configured with (no limit crossbar knows of)."""
    return described.max_models or max(1, len(host.models))


def rules_of(config: FleetConfig, model: str, idle_unload: float | None) -> ModelRules:
    """The operator's rules for `model` (its placed model's, else the defaults, with the
    gateway's `idle_unload`), with the hosts it was loaded on by hand."""
    pinned = frozenset(name for name, host in config.hosts.items() if model in host.pinned)
    placed = config.placed.get(model)
    if placed is None:
        return ModelRules(idle_unload=idle_unload, pinned=pinned)
    return ModelRules(
        min_loaded=placed.min_loaded,
        max_loaded=placed.max_loaded,
        hosts=placed.hosts,
        idle_unload=idle_unload_of(config, model, idle_unload),
        pinned=pinned,
    )


def idle_unload_of(config: FleetConfig, model: str, default: float | None) -> float | None:
    """The seconds `model` may stay loaded unused: its placed model's, else `default` (the
    gateway's); None (0 where the operator says it): never."""
    placed = config.placed.get(model)
    if placed is None or placed.idle_unload is None:
        return default
    return placed.idle_unload or None
