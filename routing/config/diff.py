"""What a load changes: the configuration in the database against the one a file describes.

`crossbar_config load --dry-run` prints these changes; a real load applies them and records
their one-line summary. Both come from `config_diff()`, so what a dry run promises is what the
load does. A load never changes a host's `draining` (the operator's switch, not the file's):
the diff leaves it out and `kept_draining()` says where the file disagrees.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

from routing.config.shape import ModelConfig
from routing.config.toml import toml_literal
from routing.config.validation import HostSpec, RouteSpec, single_values

ADD, CHANGE, REMOVE = "add", "change", "remove"
_PAST = {ADD: "added", CHANGE: "changed", REMOVE: "removed"}
_KINDS = ("host", "model", "route")
# Operational state: set in the admin or from the dashboard, never by a load of an existing host.
OPERATIONAL = frozenset({"draining"})


@dataclass(frozen=True, slots=True)
class Change:
    """One entry a load adds, changes or removes: `change model gpu1/llama3: parallel 2 -> 4`."""

    action: str
    kind: str
    name: str
    details: tuple[str, ...] = ()

    def __str__(self) -> str:
        text = f"{self.action} {self.kind} {self.name}"
        return f"{text}: {'; '.join(self.details)}" if self.details else text


def config_diff(
    current: tuple[list[HostSpec], list[RouteSpec]],
    hosts: list[HostSpec],
    routes: list[RouteSpec],
    prune: bool,
    key_changes: Mapping[str, str] | None = None,
) -> list[Change]:
    """The changes loading `hosts` and `routes` makes to `current`, in the file's order.

    Without `prune`, what the file does not name is kept; with it, it is removed (a removed
    host's models with it). `key_changes` says, per existing host, how the load changes its API
    key ("api key replaced"): the specs never hold keys, so the caller compares them.
    """
    key_changes = key_changes or {}
    old_hosts = {host.name: host for host in current[0]}
    old_routes = {route.name: route for route in current[1]}
    changes: list[Change] = []
    for host in hosts:
        old = old_hosts.get(host.name)
        if old is None:
            changes.append(Change(ADD, "host", host.name, (f"url {toml_literal(host.url)}",)))
            changes += [_added_model(host.name, model) for model in host.models]
            continue
        details = _differences(old, host, HostSpec, skip=OPERATIONAL)
        if host.name in key_changes:
            details.append(key_changes[host.name])
        if details:
            changes.append(Change(CHANGE, "host", host.name, tuple(details)))
        changes += _model_changes(old, host, prune)
    for route in routes:
        old_route = old_routes.get(route.name)
        if old_route is None:
            hosts_text = f"hosts {_names(route.hosts)}"
            changes.append(Change(ADD, "route", route.name, (hosts_text,)))
        elif details := _route_differences(old_route, route):
            changes.append(Change(CHANGE, "route", route.name, tuple(details)))
    if prune:
        named_routes = {route.name for route in routes}
        changes += [
            Change(REMOVE, "route", name) for name in old_routes if name not in named_routes
        ]
        named_hosts = {host.name for host in hosts}
        for name, old in old_hosts.items():
            if name not in named_hosts:
                changes.append(Change(REMOVE, "host", name))
                changes += [Change(REMOVE, "model", f"{name}/{m.name}") for m in old.models]
    return changes


def not_named(
    current: tuple[list[HostSpec], list[RouteSpec]], hosts: list[HostSpec], routes: list[RouteSpec]
) -> list[str]:
    """What the database has and the file does not name (`host spare`), which --prune removes."""
    named_hosts = {host.name: host for host in hosts}
    named_routes = {route.name for route in routes}
    left: list[str] = []
    for host in current[0]:
        if host.name not in named_hosts:
            left.append(f"host {host.name}")
            continue
        file_models = {model.name for model in named_hosts[host.name].models}
        left += [f"model {host.name}/{m.name}" for m in host.models if m.name not in file_models]
    left += [f"route {route.name}" for route in current[1] if route.name not in named_routes]
    return left


def kept_draining(
    current: tuple[list[HostSpec], list[RouteSpec]], hosts: list[HostSpec]
) -> list[str]:
    """A line per existing host whose `draining` the file would flip, which a load leaves."""
    old_hosts = {host.name: host for host in current[0]}
    return [
        f"note: host {host.name} stays {'draining' if old.draining else 'not draining'} "
        f"(the file says draining = {toml_literal(host.draining)}; a load leaves draining as "
        "the admin set it)"
        for host in hosts
        if (old := old_hosts.get(host.name)) is not None and old.draining != host.draining
    ]


def change_summary(changes: list[Change]) -> str:
    """`1 host added, 2 models changed`, hosts then models then routes; `nothing changed`."""
    counts = Counter((change.kind, change.action) for change in changes)
    parts = [
        f"{counts[kind, action]} {kind}{'s' * (counts[kind, action] != 1)} {_PAST[action]}"
        for kind in _KINDS
        for action in (ADD, CHANGE, REMOVE)
        if counts[kind, action]
    ]
    return ", ".join(parts) or "nothing changed"


def _model_changes(old: HostSpec, new: HostSpec, prune: bool) -> list[Change]:
    old_models = {model.name: model for model in old.models}
    changes: list[Change] = []
    for model in new.models:
        previous = old_models.get(model.name)
        if previous is None:
            changes.append(_added_model(new.name, model))
        elif details := _differences(previous, model, ModelConfig):
            changes.append(Change(CHANGE, "model", f"{new.name}/{model.name}", tuple(details)))
    if prune:
        named = {model.name for model in new.models}
        changes += [
            Change(REMOVE, "model", f"{new.name}/{name}")
            for name in old_models
            if name not in named
        ]
    return changes


def _added_model(host: str, model: ModelConfig) -> Change:
    details: tuple[str, ...] = (f"parallel {model.parallel}", f"queue_max {model.queue_max}")
    if model.aliases:
        details += (f"aliases {toml_literal(model.aliases)}",)
    return Change(ADD, "model", f"{host}/{model.name}", details)


def _route_differences(old: RouteSpec, new: RouteSpec) -> list[str]:
    details = _differences(old, new, RouteSpec)
    if old.hosts != new.hosts:
        details.append(f"hosts {_names(old.hosts)} -> {_names(new.hosts)}")
    return details


def _differences(
    old: HostSpec | ModelConfig | RouteSpec,
    new: HostSpec | ModelConfig | RouteSpec,
    spec: type[HostSpec | ModelConfig | RouteSpec],
    skip: frozenset[str] = frozenset(),
) -> list[str]:
    before, after = single_values(old, spec), single_values(new, spec)
    return [
        f"{name} {toml_literal(before[name])} -> {toml_literal(value)}"
        for name, value in after.items()
        if name not in skip and before[name] != value
    ]


def _names(names: list[str]) -> str:
    return "[" + ", ".join(names) + "]"
