"""Configuration problems: the one place that finds them.

A configuration is described as plain specs (hosts with their models, routes with their host
names in order). The TOML loader, `crossbar_config check`, the system checks and the route admin
all ask `config_problems()` (or, for one route, `route_problems()`) what is wrong with it, so a
configuration is judged by the same rules wherever it comes from.

Single values are judged by the model fields themselves (their validators, choices and lengths),
so a value the admin refuses is refused here with the same words. The rules below add what no
single field can see: names used twice, two hosts at one address, routes naming hosts or
fallbacks that do not exist, default models no host of the route serves, fallbacks that fall
back again. What the hosts themselves say (their slots) is `routing.config.slots`'s question.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from django.core.exceptions import ValidationError
from django.db import models
from django.db.models import Prefetch

from accounting.models import ClientKey, no_such_route
from hosts.address import url_clash
from hosts.models import Host, HostModel
from routing.config.shape import ModelConfig
from routing.models import Route, RouteHost

# Problem codes; the system checks report them as `crossbar.<code>`.
INVALID_VALUE = "E001"
DUPLICATE_NAME = "E002"
UNKNOWN_HOST = "E003"
DEFAULT_MODEL_NOT_SERVED = "E004"
UNKNOWN_FALLBACK = "E005"
FALLBACK_CHAIN = "E006"
FALLBACK_MODEL_NOT_SERVED = "E007"
UNKNOWN_KEY_ROUTE = "E008"
CATCH_ALL_WITHOUT_DEFAULT = "E009"
SHARED_URL = "E010"
NAME_CLASH = "E012"  # E011 is routing.config.slots's
ROUTE_WITHOUT_HOSTS = "W001"


@dataclass(slots=True)
class HostSpec:
    """A host and its models. Field names are `Host`'s; the API key itself is never held."""

    name: str
    url: str
    weight: float
    enabled: bool
    draining: bool
    api_key_env: str
    notes: str
    shares_url: bool = False
    loads_on_demand: str = ""  # Host.LoadsOnDemand: "", "yes" or "no"
    models: list[ModelConfig] = field(default_factory=list)

    @classmethod
    def from_host(cls, host: Host) -> HostSpec:
        return cls(
            **single_values(host, cls),
            models=[
                ModelConfig(**single_values(model, ModelConfig)) for model in host.models.all()
            ],
        )


@dataclass(slots=True)
class RouteSpec:
    """A route and the names of its hosts in tie-break order. Field names are `Route`'s.

    `fallback` is the fallback route's name, "" for none.
    """

    name: str
    default_model: str
    lease_ttl: int
    sticky: str
    enabled: bool
    wait_status: bool
    queue_timeout: int
    lease_patience: float | None  # None: auto ("auto" in the file)
    fallback: str
    fallback_after: float
    fallback_model: str
    pass_credentials: bool = False
    map_unknown_models: bool = False
    manage_models: bool = False
    cors_origins: str = ""
    open_host_controls: bool = False
    hosts: list[str] = field(default_factory=list)

    @classmethod
    def from_route(cls, route: Route, hosts: list[str] | None = None) -> RouteSpec:
        """The route's spec; `hosts` stands in for its saved hosts (an unsaved route has none)."""
        if hosts is None:
            hosts = [route_host.host.name for route_host in route.route_hosts.all()]
        values = single_values(route, cls)
        values["fallback"] = route.fallback.name if route.fallback else ""
        return cls(**values, hosts=hosts)


@dataclass(frozen=True, slots=True)
class Problem:
    """One thing wrong with a configuration.

    `key` says where, in the TOML file's terms (`routes.chat.default_model`); `code` says which
    rule found it: codes starting with E are errors, with W warnings.
    """

    key: str
    message: str
    code: str = INVALID_VALUE

    @property
    def is_error(self) -> bool:
        return self.code.startswith("E")

    def __str__(self) -> str:
        level = "error" if self.is_error else "warning"
        return f"{level}: {self.key}: {self.message}"


def without_echoes(said: Sequence[Problem], judged: Sequence[Problem]) -> list[Problem]:
    """`judged` but for the problems at or above a key `said` already has: a value the file got
    wrong stands in as its default, and judging that default (`parallel 4, but the host has 2
    slots`) would quote a number the operator never wrote."""
    return [
        problem
        for problem in judged
        if not any(s.key == problem.key or s.key.startswith(problem.key + ".") for s in said)
    ]


def config_problems(hosts: list[HostSpec], routes: list[RouteSpec]) -> list[Problem]:
    """Everything wrong with a whole configuration, errors and warnings, rule by rule."""
    hosts_by_name = {host.name: host for host in hosts}
    return [
        *_host_problems(hosts),
        *_invalid_values(Route, routes, "routes"),
        *_duplicate_names("Route", [route.name for route in routes], "routes"),
        *(problem for route in routes for problem in route_problems(route, hosts_by_name)),
        *_fallback_problems(routes),
        *_fallback_model_problems(routes, hosts_by_name),
    ]


def route_problems(route: RouteSpec, hosts: Mapping[str, HostSpec]) -> Iterator[Problem]:
    """What is wrong between one route and its hosts (`hosts` may hold others too)."""
    key = entry_key("routes", route.name)
    for name in route.hosts:
        if name not in hosts:
            yield Problem(
                f"{key}.hosts",
                f"Route “{route.name}” names host “{name}”, which does not exist.",
                UNKNOWN_HOST,
            )
    for name, count in Counter(route.hosts).items():
        if count > 1:
            yield Problem(f"{key}.hosts", f"Host “{name}” is listed {count} times.", DUPLICATE_NAME)
    if not route.hosts:
        yield Problem(
            f"{key}.hosts",
            f"Route “{route.name}” has no hosts; every request to it will fail.",
            ROUTE_WITHOUT_HOSTS,
        )
    known = [hosts[name] for name in dict.fromkeys(route.hosts) if name in hosts]
    served = {model.name for host in known for model in host.models}
    if route.default_model and known and route.default_model not in served:
        names = ", ".join(host.name for host in known)
        yield Problem(
            f"{key}.default_model",
            f"Default model “{route.default_model}” is not served by any of route "
            f"“{route.name}”'s hosts: {names}.",
            DEFAULT_MODEL_NOT_SERVED,
        )
    yield from _route_name_clashes(route, known, key)
    if route.map_unknown_models and not route.default_model:
        yield Problem(
            f"{key}.map_unknown_models",
            f"Route “{route.name}” maps unknown model names to its default model, but has none.",
            CATCH_ALL_WITHOUT_DEFAULT,
        )


def routes_left_without(
    hosts: list[HostSpec], routes: list[RouteSpec], draining: Collection[str]
) -> dict[str, list[str]]:
    """The enabled routes that have a usable host (enabled, not draining) and would have none
    once the hosts named in `draining` drain: {route name: those of them it has, in order}."""
    usable = {host.name for host in hosts if host.enabled and not host.draining}
    left: dict[str, list[str]] = {}
    for route in routes:
        own = [name for name in dict.fromkeys(route.hosts) if name in usable]
        if route.enabled and own and all(name in draining for name in own):
            left[route.name] = own
    return left


def config_from_db() -> tuple[list[HostSpec], list[RouteSpec]]:
    """The configuration in the database, as specs (four queries)."""
    hosts = Host.objects.prefetch_related("models")
    routes = Route.objects.select_related("fallback").prefetch_related(
        Prefetch("route_hosts", queryset=RouteHost.objects.select_related("host"))
    )
    return [HostSpec.from_host(host) for host in hosts], [
        RouteSpec.from_route(route) for route in routes
    ]


def client_key_problems(keys: Mapping[str, list[str]], routes: list[RouteSpec]) -> list[Problem]:
    """Client keys (name: route names) limited to routes that do not exist."""
    known = {route.name for route in routes}
    return [
        Problem(
            f"{entry_key('client_keys', key)}.routes", no_such_route(key, name), UNKNOWN_KEY_ROUTE
        )
        for key, names in keys.items()
        for name in dict.fromkeys(names)
        if name not in known
    ]


def client_keys_from_db() -> dict[str, list[str]]:
    """Every client key's name and route names, enabled or not."""
    return {key.name: key.route_names for key in ClientKey.objects.all()}


def entry_key(prefix: str, name: str, index: int | None = None) -> str:
    """The dotted TOML key of the entry `name` under `prefix`: `hosts.gpu1`, `hosts."a.b"`.

    A nameless entry is called by its position (`hosts[2]`) when `index` is given.
    """
    if not name and index is not None:
        return f"{prefix}[{index}]"
    part = name if re.fullmatch(r"[A-Za-z0-9_-]+", name) else json.dumps(name, ensure_ascii=False)
    return f"{prefix}.{part}" if prefix else part


def _host_problems(hosts: list[HostSpec]) -> Iterator[Problem]:
    yield from _invalid_values(Host, hosts, "hosts")
    yield from _duplicate_names("Host", [host.name for host in hosts], "hosts")
    for index, host in enumerate(hosts):
        # Said at each host that does not share its URL on purpose: either may be the one to
        # remove, and a host that does share it is not the one in the wrong.
        if not host.shares_url and (clash := url_clash(host, hosts)):
            yield Problem(entry_key("hosts", host.name, index) + ".url", clash, SHARED_URL)
        key = entry_key("hosts", host.name, index) + ".models"
        yield from _invalid_values(HostModel, host.models, key)
        yield from _duplicate_names("Model", [model.name for model in host.models], key)
        yield from _alias_clashes(host.models, key, f"host “{host.name}”")


def _alias_clashes(models: Sequence[ModelConfig], key: str, where: str) -> Iterator[Problem]:
    """An alias that is another model's name or alias in `models` (one host's, or a route's):
    a request by that name would have two models, and two pools of slots, to choose from."""
    owner = {model.name: model.name for model in models}
    for index, model in enumerate(models):
        for alias in model.aliases:
            other = owner.setdefault(alias, model.name)
            if alias == model.name:
                said = "its own name"
            elif other == model.name:
                continue
            elif alias == other:
                said = f"model “{other}”'s name"
            else:
                said = f"an alias of model “{other}” too"
            yield Problem(
                f"{entry_key(key, model.name, index)}.aliases",
                f"Alias “{alias}” of model “{model.name}” is {said} on {where}.",
                NAME_CLASH,
            )


def _route_name_clashes(route: RouteSpec, hosts: list[HostSpec], key: str) -> Iterator[Problem]:
    """An alias on one host of the route that another of its hosts serves as another model
    (by name or alias). One host's own clashes are said at the host."""
    owners: dict[str, tuple[str, str]] = {}  # a name -> (its model, the host where it is)
    for host in hosts:
        for model in host.models:
            owners.setdefault(model.name, (model.name, host.name))
    for host in hosts:
        for model in host.models:
            for alias in model.aliases:
                other, where = owners.setdefault(alias, (model.name, host.name))
                if other != model.name and where != host.name:
                    kind = "model" if alias == other else "an alias of model"
                    yield Problem(
                        f"{key}.hosts",
                        f"“{alias}” is an alias of model “{model.name}” on host “{host.name}” "
                        f"and {kind} “{other}” on host “{where}”: route “{route.name}” would "
                        "serve two models by one name.",
                        NAME_CLASH,
                    )


def _fallback_problems(routes: list[RouteSpec]) -> Iterator[Problem]:
    routes_by_name = {route.name: route for route in routes}
    for route in routes:
        if not route.fallback:
            continue
        key = entry_key("routes", route.name) + ".fallback"
        target = routes_by_name.get(route.fallback)
        if route.fallback == route.name:
            yield Problem(key, f"Route “{route.name}” cannot fall back to itself.", FALLBACK_CHAIN)
        elif target is None:
            yield Problem(
                key,
                f"Route “{route.name}” falls back to route “{route.fallback}”, "
                "which does not exist.",
                UNKNOWN_FALLBACK,
            )
        elif target.fallback:
            # The gateway falls back once; a fallback of the fallback would never be used.
            yield Problem(
                key,
                f"Route “{route.name}” falls back to route “{target.name}”, which falls back "
                f"to “{target.fallback}” in turn; a fallback may not have a fallback of its own.",
                FALLBACK_CHAIN,
            )


def _fallback_model_problems(
    routes: list[RouteSpec], hosts: Mapping[str, HostSpec]
) -> Iterator[Problem]:
    """A fallback model that no host of the fallback route serves would fail every switch."""
    routes_by_name = {route.name: route for route in routes}
    for route in routes:
        target = routes_by_name.get(route.fallback)
        if not route.fallback_model or target is None:
            continue
        known = [hosts[name] for name in dict.fromkeys(target.hosts) if name in hosts]
        if known and route.fallback_model not in {m.name for h in known for m in h.models}:
            yield Problem(
                entry_key("routes", route.name) + ".fallback_model",
                f"Fallback model “{route.fallback_model}” is not served by any of route "
                f"“{target.name}”'s hosts: {', '.join(host.name for host in known)}.",
                FALLBACK_MODEL_NOT_SERVED,
            )


def _invalid_values(
    model: type[models.Model], specs: Sequence[HostSpec | ModelConfig | RouteSpec], key: str
) -> Iterator[Problem]:
    for index, spec in enumerate(specs):
        prefix = entry_key(key, spec.name, index)
        for name, value in single_values(spec, type(spec)).items():
            model_field = model._meta.get_field(name)
            if not isinstance(model_field, models.Field) or model_field.is_relation:
                continue  # a reference to another entry; the rules above judge those
            try:
                model_field.clean(value, None)
            except ValidationError as error:
                yield Problem(f"{prefix}.{name}", " ".join(error.messages))


def _duplicate_names(kind: str, names: list[str], key: str) -> Iterator[Problem]:
    for name, count in Counter(names).items():
        if name and count > 1:
            yield Problem(
                entry_key(key, name) + ".name",
                f"{kind} name “{name}” is used {count} times.",
                DUPLICATE_NAME,
            )


def single_fields(spec: type[HostSpec | ModelConfig | RouteSpec]) -> dict[str, str]:
    """The spec's fields that hold one value (not the nested lists), with their type names."""
    return {f.name: str(f.type) for f in fields(spec) if f.name not in ("models", "hosts")}


def single_values(obj: object, spec: type[HostSpec | ModelConfig | RouteSpec]) -> dict[str, Any]:
    """`obj`'s values (a spec's or a model instance's) for the spec's single-value fields.

    Any: `obj` holds values of the spec's field types (a model field or a spec field each).
    """
    return {name: getattr(obj, name) for name in single_fields(spec)}
