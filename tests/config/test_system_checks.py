"""Configuration problems in the database show up in `manage.py check`."""

from __future__ import annotations

import io
import shlex
import subprocess
from pathlib import Path

import pytest
from django.core.checks import Warning, run_checks
from django.core.management import call_command
from django.core.management.base import SystemCheckError
from django.db import DatabaseError

from routing import checks
from tests.helpers.fleet import add_host, add_route
from tests.helpers.machine import ROOT

pytestmark = pytest.mark.django_db


def crossbar_checks() -> list:
    return [
        message
        for message in run_checks(databases=["default"])
        if (message.id or "").startswith("crossbar.")
    ]


def make_run_commands() -> list[list[str]]:
    """The commands `make run` runs before the server starts, as the Makefile spells them."""
    recipe = subprocess.run(
        ["make", "--no-print-directory", "-n", "--assume-old=.venv/.installed", "run"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    commands = [
        shlex.split(line.split("manage.py", 1)[1].split("||")[0])
        for line in recipe.splitlines()
        if "manage.py" in line
    ]
    return commands[:-1]  # the last serves until stopped


def test_a_sound_configuration_raises_nothing() -> None:
    gpu1 = add_host("gpu1", "http://10.0.0.5:8080", models={"llama3": (4, 8)})
    add_route("chat", [gpu1], default_model="llama3")

    assert crossbar_checks() == []


def test_each_problem_is_reported_with_its_key_and_code() -> None:
    gpu1 = add_host("gpu1", "http://10.0.0.5:8080", models={"qwen": (1, 0)})
    add_route("chat", [gpu1], default_model="llama3")
    add_route("idle", [])

    assert crossbar_checks() == [
        Warning(
            "Default model “llama3” is not served by any of route “chat”'s hosts: gpu1.",
            obj="routes.chat.default_model",
            id="crossbar.E004",
        ),
        Warning(
            "Route “idle” has no hosts; every request to it will fail.",
            obj="routes.idle.hosts",
            id="crossbar.W001",
        ),
    ]


def test_manage_py_check_shows_the_problems_and_fails_only_when_asked() -> None:
    add_route("idle", [])
    stderr = io.StringIO()

    call_command("check", "--database", "default", stderr=stderr)

    assert "routes.idle.hosts: (crossbar.W001) Route “idle” has no hosts" in stderr.getvalue()
    with pytest.raises(SystemCheckError):
        call_command("check", "--database", "default", fail_level="WARNING", stderr=io.StringIO())


def test_make_runs_commands_say_a_route_without_hosts_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`make run` runs four commands, each running the system checks unless told not to."""
    add_route("idle", [])
    monkeypatch.setenv("CROSSBAR_CONFIG", str(tmp_path / "absent.toml"))
    said = io.StringIO()
    for command in make_run_commands():
        # call_command skips the checks unless told; a command line may say so itself.
        checked: dict[str, object] = {"stdout": said, "stderr": said}
        if "--skip-checks" not in command:
            checked["skip_checks"] = False
        call_command(command[0], *command[1:], **checked)

    assert said.getvalue().count("Route “idle” has no hosts") == 1


def test_a_database_without_tables_reports_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_tables() -> None:
        raise DatabaseError("no such table: hosts_host")

    monkeypatch.setattr(checks, "config_from_db", no_tables)

    assert checks.check_configuration(databases=["default"]) == []
