"""A refusal in full: placement says *that* a request is refused, this says what, where, and
what to do, from the hosts' state at that moment (`routing.core.refusals`).

Called only on the way out of a refused request, so a served request pays nothing for it.
"""

from __future__ import annotations

from routing.config.shape import RouteConfig
from routing.core import refusals
from routing.core.errors import NoHealthyHost, PinnedHostDown, QueueFull, UnknownRoute
from routing.ops.live import standings
from routing.proxy.record import Trail, refused_by
from routing.runtime import Runtime


def explained(runtime: Runtime, route: RouteConfig, model: str | None, exc: Exception) -> Exception:
    """`exc` with its words and facts when it is a placement's refusal (QueueFull,
    NoHealthyHost, PinnedHostDown) that has none yet; any other exception as it is. No
    usable host where one that loads no model on demand has the model unloaded (or still
    loading) is `ModelNotLoaded`."""
    if getattr(exc, "detail", None):
        return exc  # explained already (a refusal passed on by a later step)
    if isinstance(exc, QueueFull):
        wanted = exc.model or model or ""
        return refusals.queue_full(route.name, wanted, standings(runtime, exc.hosts, wanted))
    if isinstance(exc, PinnedHostDown):
        found = standings(runtime, [exc.host], model)
        if not found:  # the host left the configuration meanwhile: nothing more to say
            return exc
        return refusals.pinned_host_down(route.name, model or "", found[0])
    if isinstance(exc, NoHealthyHost):
        hosts = runtime.fleet.hosts
        serving = [
            name
            for name in route.hosts
            if name in hosts and (model is None or model in hosts[name].models)
        ]
        found = standings(runtime, serving, model)
        if model is not None and any(standing.not_loaded for standing in found):
            # Up, but without the model loaded: a load serves it, not the host's health.
            return refusals.model_not_loaded(route.name, model, found)
        return refusals.no_healthy_host(route.name, model, found)
    return exc


def counted_where_it_happened(trail: Trail, exc: Exception) -> Trail:
    """The trail whose row counts `exc` where it happened: a queue_full on the route that
    refused it (no host; the full ones listed), an unknown route under the name the client
    sent."""
    if isinstance(exc, QueueFull):
        return refused_by(trail, exc.hosts)
    if isinstance(exc, UnknownRoute):
        return trail._replace(route=exc.name)
    return trail
