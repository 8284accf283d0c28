"""A fleet file written for a test, and `manage.py crossbar_config` run on it."""

from __future__ import annotations

import io
from pathlib import Path

from django.core.management import call_command


def write(tmp_path: Path, text: str, name: str = "fleet.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def crossbar_config(*args: str) -> str:
    return call_command("crossbar_config", *args, stdout=io.StringIO())
