"""`/<route>/v1/models` and `/<route>/models`: what the route serves, as its hosts describe it.

The list holds each model the route serves (`FleetConfig.route_models`, in route order), under the
name clients send. Every enabled host of the route is asked for the same path and query at once
(so `?reload=1` reaches a router-mode host, which re-reads its presets first), and a model's
entry is the one its host reports (llama-server's `aliases`, `tags`, `meta`, a router's
`status`), matched by any of the model's names (its own, its upstream name, its aliases) and
the host's for it (its id, its aliases), with `id` the name clients send here and the host's
`aliases`; a model the route knows by several of its aliases is listed once, as the host lists
it. A model its host does not report is listed from the configuration alone, with its
configured aliases (a single-model llama-server answers to any model name), except on a
router-mode host that answered (its entries say each model's `status`): a router serves only
what it lists, so a model it dropped (a preset reload, a deletion) is left out, and what it
lists beyond the configuration (a preset added, then `?reload=1`) is listed too, as it lists
it: what it can load now. A model a single-model host reports that the route does not serve
is not listed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence

import httpx
from django.conf import settings

from routing.config.shape import HostConfig, ModelConfig, RouteConfig
from routing.runtime import Runtime

Entry = dict[str, object]


async def model_list(runtime: Runtime, route: RouteConfig, path: str, query: str) -> Entry:
    """The route's model list in OpenAI's shape, `{"object": "list", "data": [...]}`."""
    hosts = [
        host
        for name in route.hosts
        if (host := runtime.fleet.hosts.get(name)) is not None and host.enabled
    ]
    wait = settings.CROSSBAR["HEALTH_TIMEOUT"]
    reported = await asyncio.gather(
        *(_reported(runtime.client, host, path, query, wait) for host in hosts)
    )
    return {"object": "list", "data": merge(list(zip(hosts, reported, strict=True)))}


def merge(hosts: Sequence[tuple[HostConfig, Sequence[Entry] | None]]) -> list[Entry]:
    """Each configured model once, first host first: the entry its host reports (renamed to
    the configured name), else a plain one, unless its host is a router that answered
    without it; then what the routers that answered can load beyond it. `None`: the host
    gave no list."""
    listed: dict[str, Entry] = {}
    for host, entries in hosts:
        by_name = _by_name(entries or ())
        router = any(isinstance(entry.get("status"), dict) for entry in entries or ())
        shown: set[int] = set()  # the host's entries listed already (one model, many aliases)
        for name, model in _own_name_first(host, by_name):
            if name in listed:
                continue
            entry = next(
                (by_name[n] for n in (model.upstream_name or name, *model.aliases) if n in by_name),
                None,
            )
            if entry is not None:
                if id(entry) not in shown:
                    shown.add(id(entry))
                    listed[name] = {**entry, "id": name}
            elif not router:
                listed[name] = _plain(model)
        if router:
            for entry in entries or ():
                own = entry.get("id")
                if id(entry) not in shown and isinstance(own, str) and own not in listed:
                    shown.add(id(entry))
                    listed[own] = entry
    return list(listed.values())


def _plain(model: ModelConfig) -> Entry:
    """A model its host does not describe, as llama-server lists one (its aliases with it)."""
    entry: Entry = {"id": model.name, "object": "model", "created": 0, "owned_by": "crossbar"}
    if model.aliases:
        entry["aliases"] = list(model.names)
    return entry


def _own_name_first(
    host: HostConfig, by_name: Mapping[str, Entry]
) -> list[tuple[str, ModelConfig]]:
    """The host's configured models, those named as the host names them first: a model the
    route knows by several of its aliases is listed once, under the host's own id when the
    route serves that name."""
    models = list(host.models.items())
    return sorted(
        models,
        key=lambda item: (
            by_name.get(item[1].upstream_name or item[0], {}).get("id")
            != (item[1].upstream_name or item[0])
        ),
    )


def _by_name(entries: Sequence[Entry]) -> Mapping[str, Entry]:
    """A host's entries by every name it answers to: the id, then its aliases."""
    names: dict[str, Entry] = {}
    for entry in entries:
        aliases = entry.get("aliases")
        for name in [entry.get("id"), *(aliases if isinstance(aliases, list) else [])]:
            if isinstance(name, str):
                names.setdefault(name, entry)
    return names


async def _reported(
    client: httpx.AsyncClient, host: HostConfig, path: str, query: str, wait: float
) -> list[Entry] | None:
    """The entries of the host's own list at `path`; None when it gives none in time."""
    url = host.url + path + (f"?{query}" if query else "")
    headers = {"Authorization": f"Bearer {host.api_key}"} if host.api_key else {}
    try:
        response = await client.get(url, headers=headers, timeout=wait)
        document = response.json() if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None
    data = document.get("data") if isinstance(document, dict) else None
    if not isinstance(data, list):
        return None
    return [entry for entry in data if isinstance(entry, dict)]
