"""The one reader of the fleet's configuration from the database."""

from __future__ import annotations

from django.db import close_old_connections

from routing.config.shape import Fleet, HostConfig, ModelConfig, RouteConfig
from routing.core.clients import ClientSpec
from routing.core.cors import parse_origins


def load_fleet() -> Fleet:
    """Read hosts, models and routes from the database. Sync: call through sync_to_async."""
    from hosts.models import Host
    from routing.models import ConfigRevision, Route

    close_old_connections()  # a connection broken by a database restart is replaced, not reused
    revision = ConfigRevision.current()
    hosts = {
        host.name: HostConfig(
            name=host.name,
            url=host.url.rstrip("/"),
            weight=host.weight,
            enabled=host.enabled,
            draining=host.draining,
            api_key=host.api_key,
            models={
                m.name: ModelConfig(m.name, m.upstream_name, max(1, m.parallel), m.queue_max)
                for m in host.models.all()
            },
        )
        for host in Host.objects.prefetch_related("models")
    }
    routes = {
        route.name: RouteConfig(
            name=route.name,
            default_model=route.default_model,
            lease_ttl=float(route.lease_ttl),
            strict=route.sticky == Route.Sticky.STRICT,
            enabled=route.enabled,
            hosts=tuple(rh.host.name for rh in route.route_hosts.all()),
            wait_status=route.wait_status,
            queue_timeout=float(route.queue_timeout),
            lease_patience=route.lease_patience,
            fallback=route.fallback.name if route.fallback else "",
            fallback_after=route.fallback_after,
            fallback_model=route.fallback_model,
            pass_credentials=route.pass_credentials,
            map_unknown_models=route.map_unknown_models,
            manage_models=route.manage_models,
            cors_origins=parse_origins(route.cors_origins),
            open_host_controls=route.open_host_controls,
        )
        for route in Route.objects.select_related("fallback").prefetch_related(
            "route_hosts__host"
        )
    }
    return Fleet(hosts=hosts, routes=routes, revision=revision, clients=_load_clients())


def _load_clients() -> dict[str, ClientSpec]:
    from accounting.models import ClientKey

    return {
        key.key_hash: ClientSpec(
            name=key.name,
            routes=frozenset(key.route_names),
            max_concurrent=key.max_concurrent,
            per_minute=key.requests_per_minute,
        )
        for key in ClientKey.objects.filter(enabled=True)
    }


def current_revision() -> int:
    from routing.models import ConfigRevision

    close_old_connections()
    return ConfigRevision.current()
