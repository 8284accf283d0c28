"""The fleet as a TOML file: read one into specs, write specs back as one.

The format is described in docs/config.md. Keys and their types are the spec fields in
`routing.config.validation`; a key left out takes the model field's default. This module checks only
what is about the file itself (types, unknown keys, environment variables); whether the values
make a sound configuration is `config_problems()`'s question. It never touches the database.
"""

from __future__ import annotations

import difflib
import tomllib
from collections.abc import Collection, Mapping
from typing import Any

import tomli_w
from django.db import models

from hosts.models import Host, HostModel
from routing.config.shape import ModelConfig
from routing.config.validation import (
    HostSpec,
    Problem,
    RouteSpec,
    entry_key,
    single_fields,
    single_values,
)
from routing.models import Route

_ACCEPTED: dict[str, tuple[type, ...]] = {
    "str": (str,),
    "int": (int,),
    "float": (int, float),
    "float | None": (int, float),  # or AUTO, which the spec holds as None
    "bool": (bool,),
}
_EXPECTED = {
    "str": "a string",
    "int": "an integer",
    "float": "a number",
    "float | None": 'a number or "auto"',
    "bool": "true or false",
    "tuple[str, ...]": 'a list of names, e.g. ["chat", "fast"]',
}
# How the file spells a number left to the gateway (a route's `lease_patience`): None in a spec.
AUTO = "auto"

DUMP_HEADER = "# crossbar configuration, written by `manage.py crossbar_config dump`."
DISCOVER_HEADER = (
    "# crossbar hosts, as `manage.py crossbar_config discover` read them from the hosts."
)
_LOAD_IT = (
    "# Load it with `manage.py crossbar_config load FILE`; the format is described in "
    "docs/config.md.\n"
)
UNEXPORTED_KEY = "# An API key set in the admin is not exported; loading this file keeps it."


def parse_config(text: str) -> tuple[list[HostSpec], list[RouteSpec], list[Problem]]:
    """The hosts and routes a TOML document describes, and what is wrong with it as a file.

    A value of the wrong type is reported and replaced by the field's default, so the specs
    can still be checked as a whole. Raises `tomllib.TOMLDecodeError` when it is not TOML.
    """
    reader = _Reader()
    data = tomllib.loads(text)
    reader.refuse_unknown_keys(data, {"hosts", "routes"}, "")
    hosts = [reader.host(table, index) for index, table in reader.tables(data, "hosts", "hosts")]
    routes = [
        reader.route(table, index) for index, table in reader.tables(data, "routes", "routes")
    ]
    return hosts, routes, reader.problems


def api_key_problems(hosts: list[HostSpec], environ: Mapping[str, str]) -> list[Problem]:
    """Hosts whose `api_key_env` names a variable that is unset or empty in `environ`."""
    return [
        Problem(
            entry_key("hosts", host.name, index) + ".api_key_env",
            f"Environment variable {host.api_key_env} is not set.",
        )
        for index, host in enumerate(hosts)
        if host.api_key_env and not environ.get(host.api_key_env)
    ]


def dump_config(
    hosts: list[HostSpec],
    routes: list[RouteSpec],
    unexported_keys: Collection[str] = (),
    header: str = DUMP_HEADER,
) -> str:
    """The configuration as TOML that `parse_config` reads back into the same specs.

    API keys are never written: a host whose key came from an environment variable names the
    variable, and a host named in `unexported_keys` (its key was set in the admin) gets a
    comment saying a key is set. Empty strings and lists are left out, since they are the default.
    `header` is the first comment line: who wrote the file.
    """
    lines = [f"{header}\n{_LOAD_IT}"]
    for host in hosts:
        table = _table("hosts", single_values(host, HostSpec))
        if host.name in unexported_keys:
            table.insert(1, UNEXPORTED_KEY)
        lines += table
        for model in host.models:
            lines += ["", *_table("hosts.models", single_values(model, ModelConfig), "  ")]
        lines.append("")
    for route in routes:
        lines += [*_table("routes", {**single_values(route, RouteSpec), "hosts": route.hosts}), ""]
    return "\n".join(lines)


def _table(name: str, values: Mapping[str, object], indent: str = "") -> list[str]:
    """One `[[name]]` table, written out in full (tomli_w would inline the short ones)."""
    lines = [f"{indent}[[{name}]]"]
    lines += [
        f"{indent}{key} = {toml_literal(value)}"
        for key, value in values.items()
        if value != "" and value != ()
    ]
    return lines


def toml_literal(value: object) -> str:
    """`value` as TOML writes it: `"gpu1"`, `2.0`, `true`, `["a", "b"]`, None as `"auto"`."""
    if value is None:
        value = AUTO
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_literal(item) for item in value) + "]"
    return tomli_w.dumps({"v": value}).removeprefix("v = ").rstrip("\n")


class _Reader:
    """Turns TOML tables into specs, collecting what is wrong on the way."""

    def __init__(self) -> None:
        self.problems: list[Problem] = []

    def host(self, table: dict[str, object], index: int) -> HostSpec:
        key = _entry_key("hosts", table, index)
        values = self.values(table, HostSpec, Host, key, nested="models")
        # As the admin does (Host.clean), so a dump shows the URL the gateway uses.
        values["url"] = str(values["url"]).rstrip("/")
        host_models = []
        for i, model in self.tables(table, "models", f"{key}.models"):
            model_key = _entry_key(f"{key}.models", model, i)
            host_models.append(ModelConfig(**self.values(model, ModelConfig, HostModel, model_key)))
        return HostSpec(**values, models=host_models)

    def route(self, table: dict[str, object], index: int) -> RouteSpec:
        key = _entry_key("routes", table, index)
        values = self.values(table, RouteSpec, Route, key, nested="hosts")
        hosts = table.get("hosts", [])
        if not isinstance(hosts, list) or not all(isinstance(name, str) for name in hosts):
            self.problem(f"{key}.hosts", "Expected a list of host names.")
            hosts = []
        return RouteSpec(**values, hosts=hosts)

    def tables(
        self, parent: Mapping[str, object], name: str, key: str
    ) -> list[tuple[int, dict[str, object]]]:
        value = parent.get(name, [])
        if isinstance(value, list) and all(isinstance(item, dict) for item in value):
            return list(enumerate(value))
        self.problem(key, f"Expected an array of tables ([[{key}]]).")
        return []

    def values(
        self,
        table: dict[str, object],
        spec: type[HostSpec | ModelConfig | RouteSpec],
        model: type[models.Model],
        key: str,
        nested: str = "",
    ) -> dict[str, Any]:
        """The spec's single values from `table`, each of its field's type (checked here)."""
        fields = single_fields(spec)
        self.refuse_unknown_keys(table, {*fields, nested} - {""}, key)
        values: dict[str, Any] = {}
        for name, type_name in fields.items():
            value = table.get(name)
            if value == AUTO and type_name.endswith("| None"):
                values[name] = None
                continue
            # bool is an int to Python, never to this file.
            if type_name == "tuple[str, ...]":
                if isinstance(value, list) and all(isinstance(item, str) for item in value):
                    values[name] = tuple(value)
                    continue
            elif isinstance(value, _ACCEPTED[type_name]) and not (
                isinstance(value, bool) and type_name != "bool"
            ):
                values[name] = (
                    float(value)
                    if type_name.startswith("float") and isinstance(value, int)
                    else value
                )
                continue
            if name in table:
                self.problem(f"{key}.{name}", f"Expected {_EXPECTED[type_name]}.")
            # A required field defaults to "", which validation reports as blank; so does a
            # reference to another entry (a fallback route), which means none.
            model_field = model._meta.get_field(name)
            values[name] = (
                model_field.get_default()
                if isinstance(model_field, models.Field) and not model_field.is_relation
                else ""
            )
        return values

    def refuse_unknown_keys(self, table: Mapping[str, object], known: set[str], key: str) -> None:
        for name in table:
            if name in known:
                continue
            where = entry_key(key, name)
            if name == "api_key":
                self.problem(
                    where,
                    "API keys are not read from the file: put the key in an environment "
                    "variable and name the variable in api_key_env.",
                )
            else:
                close = difflib.get_close_matches(name, known, n=1)
                expected = f"xpected one of {', '.join(sorted(known))}."
                said = f"did you mean {close[0]}? E{expected}" if close else f"e{expected}"
                self.problem(where, f"Unknown key; {said}")

    def problem(self, key: str, message: str) -> None:
        self.problems.append(Problem(key, message))


def _entry_key(prefix: str, table: Mapping[str, object], index: int) -> str:
    name = table.get("name")
    return entry_key(prefix, name if isinstance(name, str) else "", index)
