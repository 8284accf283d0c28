"""The database in trouble: the proxy path needs no database, so requests keep flowing while
it is locked or down, and the recorder writes their rows once it is back (within its bound).
The `ledger` checks one row per request after each test."""

from __future__ import annotations

import os
import shlex
import sqlite3
import time
from pathlib import Path

import pytest
from django.db import connection

from tests.helpers.database import postgres, start_options
from tests.helpers.fleet import add_host, add_route, chat

pytestmark = pytest.mark.django_db(transaction=True)
URL = "/chat/v1/chat/completions"


def requests_for(seconds: float, ledger) -> list[int]:
    """Send requests one after another for `seconds`; their statuses."""
    statuses: list[int] = []
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        body = chat(f"question {len(statuses)}", stream=len(statuses) % 2 == 0, max_tokens=3)
        statuses.append(ledger.client.post(URL, json=body, timeout=10).status_code)
        time.sleep(0.05)
    return statuses


def test_requests_flow_while_another_writer_holds_sqlite_and_their_rows_follow(
    chat_route, gateway, ledger
):
    if connection.vendor != "sqlite":
        pytest.skip("the suite runs on PostgreSQL")
    locker = sqlite3.connect(connection.settings_dict["NAME"], isolation_level=None)
    locker.execute("BEGIN IMMEDIATE")  # the write lock, as a long migration or a backup holds it
    try:
        statuses = requests_for(3.0, ledger)
        written_meanwhile = ledger.rows().count()  # readers are not blocked (WAL)
    finally:
        locker.execute("ROLLBACK")
        locker.close()

    assert statuses and set(statuses) == {200}
    assert written_meanwhile == 0
    assert ledger.statuses() == statuses  # every row, once the lock is gone


@pytest.mark.skipif(
    not (os.environ.get("CROSSBAR_PG_BIN") and os.environ.get("CROSSBAR_PG_DATA")),
    reason="needs a PostgreSQL this test may stop and start (CROSSBAR_PG_BIN, CROSSBAR_PG_DATA)",
)
@pytest.mark.restarts_database
def test_requests_flow_while_postgresql_is_down_and_their_rows_follow(
    chat_route, gateway, fake2, ledger
):
    if connection.vendor != "postgresql":
        pytest.skip("the suite runs on SQLite")
    options = start_options()
    log = Path(os.environ["CROSSBAR_PG_DATA"]) / "log"
    postgres("-m fast -w stop")
    try:
        statuses = requests_for(3.0, ledger)
    finally:
        postgres(f"-w -l {log} -o {shlex.quote(options)} start")
    connection.close()  # this process's connection died with the server

    assert statuses and set(statuses) == {200}
    assert ledger.statuses(timeout=30) == statuses
    # The config watcher came back too: an edit made now reaches the gateway.
    add_route("code", [add_host("gpu2", fake2.url)])
    gateway.sync(timeout=20)
    assert ledger.client.post("/code/v1/chat/completions", json=chat()).status_code == 200
    assert "cannot write to the database" in gateway.log()
