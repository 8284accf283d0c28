"""Building a fleet in the test database, as an operator would in the admin."""

from __future__ import annotations

from hosts.models import Host, HostModel
from routing.models import Route, RouteHost

MODEL = "test-model"
# What the gateway's health poller asks every host, every interval: not a client's request.
POLLS = frozenset({"/health", "/props", "/v1/models"})


def add_host(
    name: str,
    url: str,
    *,
    models: dict[str, tuple[int, int]] | None = None,
    upstream_names: dict[str, str] | None = None,
    **fields: object,
) -> Host:
    """A host serving `models` ({name: (parallel, queue_max)}; default test-model 4/4)."""
    host = Host.objects.create(name=name, url=url, **fields)
    for model, (parallel, queue_max) in (models or {MODEL: (4, 4)}).items():
        HostModel.objects.create(
            host=host,
            name=model,
            parallel=parallel,
            queue_max=queue_max,
            upstream_name=(upstream_names or {}).get(model, ""),
        )
    return host


def add_route(name: str, hosts: list[Host], **fields: object) -> Route:
    route = Route.objects.create(name=name, **fields)
    for position, host in enumerate(hosts):
        RouteHost.objects.create(route=route, host=host, position=position)
    return route


def chat(content: str = "hello", *, system: str | None = None, **extra: object) -> dict:
    """A chat completion body for the test model."""
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": content})
    return {"model": MODEL, "messages": messages, **extra}
