"""The test database in trouble: its request table locked from another connection, PostgreSQL
stopped and started again (pg_ctl, as the superuser)."""

from __future__ import annotations

import os
import shlex
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from django.db import connection, transaction


@contextmanager
def write_lock() -> Iterator[None]:
    """Hold the request table's write lock from another connection while the block runs."""
    locked, release = threading.Event(), threading.Event()

    def hold() -> None:
        try:
            with transaction.atomic(), connection.cursor() as cursor:
                if connection.vendor == "postgresql":
                    cursor.execute("LOCK TABLE accounting_request IN EXCLUSIVE MODE")
                else:
                    cursor.execute("DELETE FROM accounting_request WHERE id = -1")
                locked.set()
                release.wait(60)
        finally:
            connection.close()

    thread = threading.Thread(target=hold)
    thread.start()
    try:
        assert locked.wait(5), "could not take the write lock"
        yield
    finally:
        release.set()
        thread.join()


def postgres(command: str) -> None:
    """Run a pg_ctl command as the PostgreSQL superuser, waiting up to 300 s: a stop's
    checkpoint on two busy cores may take longer than pg_ctl's own minute."""
    pg_ctl = f"{os.environ['CROSSBAR_PG_BIN']}/pg_ctl -D {os.environ['CROSSBAR_PG_DATA']} -t 300"
    line = f"{pg_ctl} {command} >/dev/null"
    if os.getuid() == 0:
        subprocess.run(["su", "postgres", "-s", "/bin/sh", "-c", line], check=True)
    else:
        subprocess.run(line, shell=True, check=True)


def start_options() -> str:
    """The options the server runs with now (pg_ctl start does not remember them)."""
    data = os.environ["CROSSBAR_PG_DATA"]
    args = shlex.split((Path(data) / "postmaster.opts").read_text())[1:]
    if "-D" in args:
        at = args.index("-D")
        del args[at : at + 2]
    return shlex.join(args)
