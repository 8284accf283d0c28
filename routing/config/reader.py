"""The one reader of the fleet's configuration from the database."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from django.db import DatabaseError, close_old_connections, connection

from routing.config.shape import FleetConfig, HostConfig, PlacedModelConfig, RouteConfig
from routing.core.clients import ClientSpec
from routing.core.cors import parse_origins
from routing.core.fairness import Priority

if TYPE_CHECKING:  # the specs read Django's models, which load once the apps are ready
    from hosts.models import Host
    from routing.config.validation import HostSpec, RouteSpec


def load_fleet() -> FleetConfig:
    """Read hosts, models and routes from the database. Sync: call through sync_to_async."""
    from hosts.models import Host
    from routing.config.validation import HostSpec, RouteSpec
    from routing.models import ConfigRevision, Route

    close_old_connections()  # a connection broken by a database restart is replaced, not reused
    revision = ConfigRevision.current()
    hosts = {
        host.name: _with_placement(served_host(HostSpec.from_host(host), host.api_key), host)
        for host in Host.objects.prefetch_related("models")
    }
    routes = {
        route.name: served_route(RouteSpec.from_route(route))
        for route in Route.objects.select_related("fallback").prefetch_related("route_hosts__host")
    }
    return FleetConfig(
        hosts=hosts,
        routes=routes,
        revision=revision,
        clients=_load_clients(),
        placed=_load_placed(),
    )


# A host's `loads_on_demand` as written (Host.LoadsOnDemand) to as served; "" (unknown): None.
_SAID = {"yes": True, "no": False}


def served_host(spec: HostSpec, api_key: str) -> HostConfig:
    """The host as the gateway serves it (`api_key`: the key its `api_key_env` names)."""
    return HostConfig(
        name=spec.name,
        url=spec.url.rstrip("/"),
        weight=spec.weight,
        enabled=spec.enabled,
        draining=spec.draining,
        api_key=api_key,
        models={
            model.name: replace(model, parallel=max(1, model.parallel)) for model in spec.models
        },
        loads_on_demand=_SAID.get(spec.loads_on_demand),
    )


def _with_placement(served: HostConfig, host: Host) -> HostConfig:
    """The host with fleet model placement's rules for it, which only the admin sets (the
    configuration file leaves them as they are), and the models pinned on it."""
    return replace(
        served,
        swap_budget=host.swap_budget,
        min_residency=host.min_residency,
        memory_gb=host.memory_gb,
        pinned=frozenset(model.name for model in host.models.all() if model.pinned),
    )


def _load_placed() -> dict[str, PlacedModelConfig]:
    from hosts.models import PlacedModel

    return {
        placed.name: PlacedModelConfig(
            name=placed.name,
            min_loaded=placed.min_loaded,
            max_loaded=placed.max_loaded,
            hosts=frozenset(host.name for host in placed.hosts.all()) or None,
            idle_unload=placed.idle_unload,
            size_gb=placed.size_gb,
        )
        for placed in PlacedModel.objects.prefetch_related("hosts")
    }


def served_route(spec: RouteSpec) -> RouteConfig:
    """The route as the gateway serves it."""
    from routing.models import Route

    return RouteConfig(
        name=spec.name,
        default_model=spec.default_model,
        lease_ttl=float(spec.lease_ttl),
        strict=spec.sticky == Route.Sticky.STRICT,
        enabled=spec.enabled,
        hosts=tuple(spec.hosts),
        wait_status=spec.wait_status,
        queue_timeout=float(spec.queue_timeout),
        lease_patience=spec.lease_patience,
        fallback=spec.fallback,
        fallback_after=spec.fallback_after,
        fallback_model=spec.fallback_model,
        pass_credentials=spec.pass_credentials,
        map_unknown_models=spec.map_unknown_models,
        manage_models=spec.manage_models,
        cors_origins=parse_origins(spec.cors_origins),
        open_host_controls=spec.open_host_controls,
    )


def _load_clients() -> dict[str, ClientSpec]:
    from accounting.models import ClientKey

    return {
        key.key_hash: ClientSpec(
            name=key.name,
            routes=frozenset(key.route_names),
            max_concurrent=key.max_concurrent,
            per_minute=key.requests_per_minute,
            priority=Priority(key.priority),
            weight=key.weight,
            tokens_per_day=key.tokens_per_day,
            tokens_per_month=key.tokens_per_month,
        )
        for key in ClientKey.objects.filter(enabled=True)
    }


def current_revision() -> int:
    """The `ConfigRevision` stamp, read on the connection this thread keeps. The runtime's
    watcher asks every CROSSBAR_CONFIG_POLL seconds, and a new connection each time (what
    `close_old_connections` does at Django's default CONN_MAX_AGE of 0) cost more than the
    query: SQLite's file opened, its pragmas, Django's functions registered on it. Sync."""
    from routing.models import ConfigRevision

    try:
        return ConfigRevision.current()
    except DatabaseError:
        # The database may have closed a kept connection (a restart, an idle timeout): once
        # more on a new one; a second failure is the caller's.
        connection.close()
        return ConfigRevision.current()
