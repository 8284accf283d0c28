"""Hosts and routes as code: load a TOML file into the database, dump it back, check either.

The format is described in docs/config.md.
"""

from __future__ import annotations

import os
import tomllib
from collections import Counter
from dataclasses import replace
from pathlib import Path

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import models, transaction

from hosts.models import Host, HostModel
from routing.config.toml import api_key_problems, dump_config, parse_config
from routing.config.validation import (
    HostSpec,
    ModelSpec,
    Problem,
    RouteSpec,
    config_from_db,
    config_problems,
    single_values,
)
from routing.models import Route, RouteHost

OUTCOMES = ("created", "updated", "unchanged", "deleted")
KINDS = {Host: "hosts", HostModel: "models", Route: "routes"}

Tally = dict[str, Counter[str]]


class Command(BaseCommand):
    help = "Load, dump or check the hosts and routes as TOML (see docs/config.md)."
    # It judges the configuration itself; the system checks would only repeat its problems.
    requires_system_checks: list[str] = []

    def add_arguments(self, parser: CommandParser) -> None:
        actions = parser.add_subparsers(dest="action", required=True)
        load = actions.add_parser(
            "load", help="Create or update hosts and routes by name from FILE, all or nothing."
        )
        load.add_argument("file")
        load.add_argument(
            "--prune",
            action="store_true",
            help="Also delete the hosts, models and routes the file does not name.",
        )
        actions.add_parser("dump", help="Print the configuration as TOML that `load` reads.")
        check = actions.add_parser(
            "check", help="Report problems of the database, or of FILE on its own."
        )
        check.add_argument("file", nargs="?")

    def handle(self, *args: object, action: str, **options: object) -> str:
        if action == "load":
            return self.load_file(str(options["file"]), prune=bool(options["prune"]))
        if action == "dump":
            return self.dump_database()
        return self.check_config(options["file"] and str(options["file"]))

    def load_file(self, path: str, prune: bool) -> str:
        hosts, routes, problems = _read_config(path)
        problems += api_key_problems(hosts, os.environ)
        with transaction.atomic():
            # Judge what the database will hold afterwards, not the file alone: a file may
            # name hosts it does not define, and without --prune what it leaves out stays.
            problems += config_problems(*_merged(config_from_db(), hosts, routes, prune))
            _refuse_errors(f"{path}: nothing was changed", problems)
            tally = _apply(hosts, routes, prune)
        return "\n".join([_summary(tally), *map(str, problems)])

    def dump_database(self) -> str:
        hosts, routes = config_from_db()
        admin_keys = Host.objects.exclude(api_key="").filter(api_key_env="")
        return dump_config(hosts, routes, set(admin_keys.values_list("name", flat=True)))

    def check_config(self, path: str | None) -> str:
        if path:
            hosts, routes, problems = _read_config(path)
            problems += config_problems(hosts, routes)
        else:
            path, problems = "the database", config_problems(*config_from_db())
        _refuse_errors(path, problems)
        return "\n".join([*map(str, problems), f"{path}: {_count(problems)}"])


def _read_config(path: str) -> tuple[list[HostSpec], list[RouteSpec], list[Problem]]:
    try:
        return parse_config(Path(path).read_text(encoding="utf-8"))
    except OSError as error:
        raise CommandError(f"Cannot read {path}: {error.strerror}.") from None
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as error:
        raise CommandError(f"{path} is not valid TOML: {error}.") from None


def _refuse_errors(title: str, problems: list[Problem]) -> None:
    """Raise CommandError listing every problem when any of them is an error."""
    if any(problem.is_error for problem in problems):
        lines = [f"{title}; {_count(problems)}:", *(f"  {problem}" for problem in problems)]
        raise CommandError("\n".join(lines))


def _count(problems: list[Problem]) -> str:
    errors = sum(problem.is_error for problem in problems)
    warnings = len(problems) - errors
    return f"{errors} error{'s' * (errors != 1)}, {warnings} warning{'s' * (warnings != 1)}"


def _merged(
    current: tuple[list[HostSpec], list[RouteSpec]],
    hosts: list[HostSpec],
    routes: list[RouteSpec],
    prune: bool,
) -> tuple[list[HostSpec], list[RouteSpec]]:
    """The configuration `apply` leaves behind: the file's, plus what it keeps of `current`."""
    if prune:
        return hosts, routes
    current_hosts = {host.name: host for host in current[0]}
    kept_hosts = [host for host in current[0] if host.name not in {h.name for h in hosts}]
    kept_routes = [route for route in current[1] if route.name not in {r.name for r in routes}]
    hosts = [
        replace(host, models=host.models + _kept_models(current_hosts[host.name], host))
        if host.name in current_hosts
        else host
        for host in hosts
    ]
    return hosts + kept_hosts, routes + kept_routes


def _kept_models(current: HostSpec, loaded: HostSpec) -> list[ModelSpec]:
    names = {model.name for model in loaded.models}
    return [model for model in current.models if model.name not in names]


def _apply(hosts: list[HostSpec], routes: list[RouteSpec], prune: bool) -> Tally:
    """Write the specs into the database by name; the caller holds the transaction."""
    tally: Tally = {kind: Counter() for kind in KINDS.values()}
    existing_hosts = {host.name: host for host in Host.objects.prefetch_related("models")}
    for spec in hosts:
        host = existing_hosts.get(spec.name) or Host(name=spec.name)
        values = single_values(spec, HostSpec)
        if spec.api_key_env:
            values["api_key"] = os.environ[spec.api_key_env]
        elif host.api_key_env:
            # The file brought this key in, so the file takes it away; a key set in the
            # admin (no api_key_env) is never touched by a load.
            values["api_key"] = ""
        tally["hosts"][_save(host, values)] += 1
        existing_models = {model.name: model for model in host.models.all()}
        for model_spec in spec.models:
            model = existing_models.get(model_spec.name) or HostModel(host=host)
            tally["models"][_save(model, single_values(model_spec, ModelSpec))] += 1
        if prune:
            names = [model.name for model in spec.models]
            _delete(host.models.exclude(name__in=names), tally)

    existing_routes = {route.name: route for route in Route.objects.select_related("fallback")}
    outcomes: dict[str, str] = {}
    for spec in routes:
        route = existing_routes.setdefault(spec.name, Route(name=spec.name))
        values = single_values(spec, RouteSpec)
        del values["fallback"]
        outcomes[spec.name] = _save(route, values)
        if _set_route_hosts(route, spec.hosts) and outcomes[spec.name] == "unchanged":
            outcomes[spec.name] = "updated"
    # Only now: a fallback may be a route the file creates further down.
    for spec in routes:
        fallback = existing_routes[spec.fallback] if spec.fallback else None
        changed = _save(existing_routes[spec.name], {"fallback": fallback}) == "updated"
        if changed and outcomes[spec.name] == "unchanged":
            outcomes[spec.name] = "updated"
    tally["routes"].update(outcomes.values())

    if prune:
        _delete(Route.objects.exclude(name__in=[route.name for route in routes]), tally)
        _delete(Host.objects.exclude(name__in=[host.name for host in hosts]), tally)
    return tally


def _save(obj: models.Model, values: dict[str, object]) -> str:
    """Save `obj` with `values` if it is new or any of them differ; say which it was."""
    created = obj.pk is None
    changed = {name: value for name, value in values.items() if getattr(obj, name) != value}
    if not (created or changed):
        return "unchanged"
    for name, value in changed.items():
        setattr(obj, name, value)
    obj.save()
    return "created" if created else "updated"


def _set_route_hosts(route: Route, names: list[str]) -> bool:
    """Give the route exactly these hosts in this order; say whether anything changed."""
    current = route.route_hosts.select_related("host")
    if [route_host.host.name for route_host in current] == names:
        return False
    current.delete()
    hosts = Host.objects.in_bulk(names, field_name="name")
    for position, name in enumerate(names):
        RouteHost.objects.create(route=route, host=hosts[name], position=position)
    return True


def _delete(queryset: models.QuerySet, tally: Tally) -> None:
    # QuerySet.delete() sends post_delete per row, so the gateway hears of every deletion.
    _, deleted = queryset.delete()
    for model, kind in KINDS.items():
        tally[kind]["deleted"] += deleted.get(model._meta.label, 0)


def _summary(tally: Tally) -> str:
    """`hosts: 2 created, 1 unchanged; models: ...; routes: ...`"""
    parts = []
    for kind, counts in tally.items():
        numbers = [f"{counts[outcome]} {outcome}" for outcome in OUTCOMES if counts[outcome]]
        parts.append(f"{kind}: {', '.join(numbers) or 'none'}")
    return "; ".join(parts)
