"""Hosts and routes as code: load a TOML file into the database, dump it back, check either.

The format is described in docs/config.md.
"""

from __future__ import annotations

import hashlib
import os
import tomllib
from dataclasses import replace
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import models, transaction

from hosts.describe import Unreachable
from hosts.models import Host, HostModel
from routing.config.diff import (
    OPERATIONAL,
    Change,
    change_summary,
    config_diff,
    kept_draining,
    not_named,
)
from routing.config.discover import discovered
from routing.config.shape import ModelConfig
from routing.config.slots import compare_slots
from routing.config.toml import DISCOVER_HEADER, api_key_problems, dump_config, parse_config
from routing.config.validation import (
    HostSpec,
    Problem,
    RouteSpec,
    client_key_problems,
    client_keys_from_db,
    config_from_db,
    config_problems,
    single_values,
    without_echoes,
)
from routing.models import ConfigFileLoad, Route, RouteHost

KEPT = "kept what the file does not name (--prune removes it)"


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
        load.add_argument(
            "--dry-run",
            action="store_true",
            help="Print what the load would add, change (old -> new) and remove; write nothing.",
        )
        load.add_argument(
            "--if-changed",
            action="store_true",
            help="Load only if the file's content differs from its last load (what `make run` "
            "does).",
        )
        actions.add_parser("dump", help="Print the configuration as TOML that `load` reads.")
        discover = actions.add_parser(
            "discover",
            help="Ask llama-servers what they serve and print them as TOML hosts for `load`.",
        )
        discover.add_argument("urls", nargs="+", metavar="URL")
        discover.add_argument(
            "--config",
            metavar="FILE",
            help="The configuration file the hosts go into: a host it (or the database) has at "
            "a URL keeps its name and settings.",
        )
        discover.add_argument(
            "--api-key-env",
            default="",
            help="The environment variable holding the hosts' API key, if they need one.",
        )
        check = actions.add_parser(
            "check", help="Report problems of the database, or of FILE on its own."
        )
        check.add_argument("file", nargs="?")

    def handle(self, *args: object, action: str, **options: Any) -> str:
        if action == "load":
            return self.load_file(
                str(options["file"]),
                prune=bool(options["prune"]),
                dry_run=bool(options["dry_run"]),
                if_changed=bool(options["if_changed"]),
            )
        if action == "dump":
            return self.dump_database()
        if action == "discover":
            return self.discover(
                list(options["urls"]), str(options["api_key_env"]), options["config"]
            )
        return self.check_config(options["file"] and str(options["file"]))

    def load_file(self, path: str, prune: bool, dry_run: bool, if_changed: bool) -> str:
        data = _read_bytes(path)
        digest = hashlib.sha256(data).hexdigest()
        where = str(Path(path).resolve())
        last = ConfigFileLoad.last_of(where) if if_changed and not dry_run else None
        if last is not None and last.sha256 == digest:
            return f"{path} unchanged since {last.loaded:%Y-%m-%d %H:%M:%S} UTC: not loaded"
        hosts, routes, said = _parse(path, data)
        judged = api_key_problems(hosts, os.environ)
        # Asked before the transaction, so a slow host never holds the database; with the
        # models the load keeps, since the host gets the sum of them all.
        loaded_hosts = _merged(config_from_db(), hosts, routes, prune)[0][: len(hosts)]
        judged += self.compare_slots(loaded_hosts, _api_keys(hosts))
        with transaction.atomic():
            current = config_from_db()
            # Judge what the database will hold afterwards, not the file alone: a file may
            # name hosts it does not define, and without --prune what it leaves out stays.
            judged += config_problems(*_merged(current, hosts, routes, prune))
            problems = [*said, *without_echoes(said, judged)]
            _refuse_errors(f"{path}: nothing was changed", problems)
            changes = config_diff(current, hosts, routes, prune, _key_changes(hosts))
            notes = kept_draining(current, hosts)
            kept = [] if prune else not_named(current, hosts, routes)
            if dry_run:
                return _dry_run_report(path, changes, kept, [*notes, *map(str, problems)])
            _apply(hosts, routes, prune)
            summary = change_summary(changes)
            ConfigFileLoad.objects.create(path=where, sha256=digest, summary=summary)
        # A host left out of the file still serves: "nothing changed" alone would hide it.
        if kept:
            notes.insert(0, f"{KEPT}: {', '.join(kept)}")
        return "\n".join([f"loaded {path}: {summary}", *notes, *map(str, problems)])

    def dump_database(self) -> str:
        hosts, routes = config_from_db()
        admin_keys = Host.objects.exclude(api_key="").filter(api_key_env="")
        return dump_config(hosts, routes, set(admin_keys.values_list("name", flat=True)))

    def discover(self, urls: list[str], api_key_env: str, config: str | None) -> str:
        api_key = os.environ.get(api_key_env, "") if api_key_env else ""
        # The file's hosts first: the output goes into it, so its names are the ones to keep.
        known = (_read_config(config)[0] if config else []) + config_from_db()[0]
        hosts, failures = [], []
        for url in urls:  # each URL, whatever the others did: one down box hides no other
            try:
                host = discovered(url, api_key, known)
            except Unreachable as exc:
                failures.append(f"cannot discover {url}: {exc}")
                continue
            host.api_key_env = api_key_env or host.api_key_env
            hosts.append(host)
        toml = dump_config(hosts, [], header=DISCOVER_HEADER)
        if not failures:
            return toml
        if hosts:
            self.stdout.write(toml)
        if len(urls) == 1:
            raise CommandError(failures[0])
        others = " (the hosts above are the others)" if hosts else ""
        title = f"{len(failures)} of {len(urls)} URLs not discovered{others}:"
        raise CommandError("\n".join([title, *(f"  {failure}" for failure in failures)]))

    def check_config(self, path: str | None) -> str:
        said: list[Problem] = []
        if path:
            hosts, routes, said = _read_config(path)
            judged = config_problems(hosts, routes)
            keys = {h.name: os.environ.get(h.api_key_env, "") for h in hosts if h.api_key_env}
        else:
            hosts, routes = config_from_db()
            judged = config_problems(hosts, routes)
            judged += client_key_problems(client_keys_from_db(), routes)
            keys = dict(Host.objects.exclude(api_key="").values_list("name", "api_key"))
            path = "the database"
        judged += self.compare_slots(hosts, keys)
        problems = [*said, *without_echoes(said, judged)]
        _refuse_errors(path, problems)
        return "\n".join([*map(str, problems), f"{path}: {_count(problems)}"])

    def compare_slots(self, hosts: list[HostSpec], api_keys: dict[str, str]) -> list[Problem]:
        """The hosts' `parallel` against their slots; a note on stderr per host not compared
        (what was judged goes to stdout, what could not be judged is said beside it)."""
        problems, notes = compare_slots(hosts, api_keys)
        for note in notes:
            self.stderr.write(note, self.style.WARNING)  # Django's default for stderr is red
        return problems


def _dry_run_report(path: str, changes: list[Change], kept: list[str], notes: list[str]) -> str:
    lines = [f"{path}: dry run, nothing written. A load would:"]
    lines += [f"  {change}" for change in changes] or ["  change nothing"]
    if kept:
        lines.append(f"  keep what the file does not name (--prune removes it): {', '.join(kept)}")
    return "\n".join([*lines, *notes, f"summary: {change_summary(changes)}"])


def _read_config(path: str) -> tuple[list[HostSpec], list[RouteSpec], list[Problem]]:
    return _parse(path, _read_bytes(path))


def _read_bytes(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as error:
        raise CommandError(f"Cannot read {path}: {error.strerror}.") from None


def _parse(path: str, data: bytes) -> tuple[list[HostSpec], list[RouteSpec], list[Problem]]:
    try:
        return parse_config(data.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as error:
        raise CommandError(f"{path} is not valid TOML: {error}.") from None


def _new_api_key(spec: HostSpec, host: Host) -> str:
    """The API key `host` has after loading `spec`."""
    if spec.api_key_env:
        return os.environ[spec.api_key_env]
    # The file brought this key in, so the file takes it away; a key set in the admin (no
    # api_key_env) is never touched by a load.
    return "" if host.api_key_env else host.api_key


def _api_keys(hosts: list[HostSpec]) -> dict[str, str]:
    """The key to send each host of a file when asking it for its slots: its variable's, else
    the one the database holds."""
    existing = Host.objects.in_bulk([spec.name for spec in hosts], field_name="name")
    return {
        spec.name: os.environ.get(spec.api_key_env, "")
        if spec.api_key_env
        else getattr(existing.get(spec.name), "api_key", "")
        for spec in hosts
    }


def _key_changes(hosts: list[HostSpec]) -> dict[str, str]:
    """How the load changes each existing host's API key, in words that never show a key."""
    existing = Host.objects.in_bulk([spec.name for spec in hosts], field_name="name")
    changes = {}
    for spec in hosts:
        host = existing.get(spec.name)
        if host is None or (new := _new_api_key(spec, host)) == host.api_key:
            continue
        changes[spec.name] = (
            "api key removed" if not new else "api key set" if not host.api_key else
            "api key replaced"
        )  # fmt: skip
    return changes


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


def _kept_models(current: HostSpec, loaded: HostSpec) -> list[ModelConfig]:
    names = {model.name for model in loaded.models}
    return [model for model in current.models if model.name not in names]


def _apply(hosts: list[HostSpec], routes: list[RouteSpec], prune: bool) -> None:
    """Write the specs into the database by name; the caller holds the transaction."""
    existing_hosts = {host.name: host for host in Host.objects.prefetch_related("models")}
    for spec in hosts:
        host = existing_hosts.get(spec.name)
        values = single_values(spec, HostSpec)
        if host is None:
            host = Host(name=spec.name)
        else:
            for name in OPERATIONAL:
                del values[name]
        values["api_key"] = _new_api_key(spec, host)
        _save(host, values)
        existing_models = {model.name: model for model in host.models.all()}
        for model_spec in spec.models:
            model = existing_models.get(model_spec.name) or HostModel(host=host)
            _save(model, single_values(model_spec, ModelConfig))
        if prune:
            host.models.exclude(name__in=[model.name for model in spec.models]).delete()

    existing_routes = {route.name: route for route in Route.objects.select_related("fallback")}
    for route_spec in routes:
        route = existing_routes.setdefault(route_spec.name, Route(name=route_spec.name))
        values = single_values(route_spec, RouteSpec)
        del values["fallback"]
        _save(route, values)
        _set_route_hosts(route, route_spec.hosts)
    # Only now: a fallback may be a route the file creates further down.
    for route_spec in routes:
        fallback = existing_routes[route_spec.fallback] if route_spec.fallback else None
        _save(existing_routes[route_spec.name], {"fallback": fallback})

    # QuerySet.delete() sends post_delete per row, so the gateway hears of every deletion.
    if prune:
        Route.objects.exclude(name__in=[route.name for route in routes]).delete()
        Host.objects.exclude(name__in=[host.name for host in hosts]).delete()


def _save(obj: models.Model, values: dict[str, object]) -> None:
    """Save `obj` with `values` if it is new or any of them differ (an unchanged row is not
    written, so the gateway is not told of a change that is none)."""
    changed = {name: value for name, value in values.items() if getattr(obj, name) != value}
    if obj.pk is not None and not changed:
        return
    for name, value in changed.items():
        setattr(obj, name, value)
    obj.save()


def _set_route_hosts(route: Route, names: list[str]) -> None:
    """Give the route exactly these hosts in this order."""
    current = route.route_hosts.select_related("host")
    if [route_host.host.name for route_host in current] == names:
        return
    current.delete()
    hosts = Host.objects.in_bulk(names, field_name="name")
    for position, name in enumerate(names):
        RouteHost.objects.create(route=route, host=hosts[name], position=position)
