"""`make run` refuses what it cannot serve before it touches the database, and says so when
the gateway was not started."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import subprocess
from pathlib import Path

from tests.helpers.machine import ROOT, free_port

NOT_STARTED = "make run: the gateway was not started (the error is above)"


def make_run(var_dir, **env: str) -> subprocess.CompletedProcess[str]:
    """`make run` on a new SQLite database in `var_dir` (the virtualenv taken as it is)."""
    environment = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
    environment.update(
        {
            "CROSSBAR_VAR_DIR": str(var_dir),
            "CROSSBAR_BIND": f"127.0.0.1:{free_port()}",
            "CROSSBAR_ADMIN_PASSWORD": "password",
            "CROSSBAR_CONFIG": str(var_dir / "absent.toml"),
            **env,
        }
    )
    return subprocess.run(
        ["make", "--no-print-directory", "--assume-old=.venv/.installed", "run"],
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
    )


def tables(database: Path) -> list[str]:
    if not database.exists():
        return []
    with contextlib.closing(sqlite3.connect(database)) as db:
        return [name for (name,) in db.execute("SELECT name FROM sqlite_master")]


def test_an_unknown_server_is_refused_before_the_database_is_touched(tmp_path):
    done = make_run(tmp_path, CROSSBAR_SERVER="gunicorn")

    assert done.returncode != 0
    assert "CommandError: CROSSBAR_SERVER is daphne or uvicorn, not 'gunicorn'" in done.stderr
    assert NOT_STARTED in done.stderr
    assert tables(tmp_path / "crossbar.sqlite3") == []  # no migration ran


def test_a_broken_crossbar_toml_says_the_gateway_was_not_started(tmp_path):
    broken = tmp_path / "crossbar.toml"
    broken.write_text('[[hosts]]\nname = "gpu1"\nurl = \n')

    done = make_run(tmp_path, CROSSBAR_CONFIG=str(broken))

    assert done.returncode != 0
    lines = done.stderr.splitlines()
    error = lines[lines.index(NOT_STARTED) - 1]  # the reason, then what it meant
    assert error.startswith("CommandError: ") and "crossbar.toml is not valid TOML" in error
