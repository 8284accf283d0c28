"""Stopping the gateway (`manage.py crossbar_serve`, what `make run` runs) with SIGTERM, on
daphne and on uvicorn alike: `/health` answers 503 `draining` at once, on new connections as on
kept-alive ones, so a load balancer stops sending; what still comes meanwhile is served, not
refused; the streams in flight finish within the grace and write their rows; then the listener
closes and the process exits 0."""

from __future__ import annotations

import os
import shlex
import signal
import time
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest
from django.db import connection
from django.utils import timezone

from accounting.models import Request
from tests.helpers.database import postgres, start_options, write_lock
from tests.helpers.fleet import add_host, add_route, chat
from tests.helpers.gateway import running_gateway
from tests.helpers.waits import wait_until

pytestmark = pytest.mark.django_db(transaction=True)
URL = "/chat/v1/chat/completions"


def draining(client: httpx.Client | None, url: str) -> bool:
    """Whether `/health` answers 503 draining, asked on `client`'s kept connection (or a new
    one)."""
    response = client.get("/health") if client else httpx.get(f"{url}/health", timeout=5)
    return response.status_code == 503 and response.json() == {"status": "draining"}


def test_sigterm_drains_new_connections_hear_draining_and_the_stream_in_flight_finishes(
    django_db_setup, tmp_path, fake
):
    started = timezone.now()
    fake.token_delay = 0.1
    add_route("chat", [add_host("gpu1", fake.url)])
    with running_gateway(tmp_path, CROSSBAR_SHUTDOWN_GRACE="30") as gateway:
        gateway.sync()
        body = chat(stream=True, max_tokens=20)
        with httpx.stream("POST", f"{gateway.url}{URL}", json=body, timeout=30) as response:
            lines = response.iter_lines()
            next(line for line in lines if line.startswith("data: "))

            gateway.process.send_signal(signal.SIGTERM)

            wait_until(lambda: draining(None, gateway.url), what="/health draining")
            # A balancer that has not probed yet still sends: served, not refused.
            late = httpx.post(f"{gateway.url}{URL}", json=chat("late"), timeout=30)
            rest = [line for line in lines if line.startswith("data: ")]
        exit_code = gateway.process.wait(timeout=30)

    assert late.status_code == 200
    assert len(rest) == 20 - 1 + 1 and rest[-1] == "data: [DONE]"
    assert exit_code == 0
    # Written when the interpreter exited: the stream ended a moment before.
    rows = Request.objects.filter(started__gte=started)  # an earlier test's may still land
    assert sorted(rows.values_list("streamed", "status", "error")) == [
        (False, 200, ""),
        (True, 200, ""),
    ]
    assert rows.get(streamed=True).completion_tokens == 20
    assert "SIGTERM: draining (/health answers 503); waiting up to 30 s for 1 requests" in (
        gateway.log()
    )
    with pytest.raises(httpx.ConnectError):  # the listener is closed
        httpx.get(f"{gateway.url}/health", timeout=2)


def test_a_stream_longer_than_the_grace_is_cut_when_it_runs_out(django_db_setup, tmp_path, fake):
    started = timezone.now()
    fake.token_delay = 0.1
    add_route("chat", [add_host("gpu1", fake.url)])
    with running_gateway(tmp_path, CROSSBAR_SHUTDOWN_GRACE="1") as gateway:
        gateway.sync()
        body = chat(stream=True, max_tokens=300)
        with httpx.stream("POST", f"{gateway.url}{URL}", json=body, timeout=30) as response:
            lines = response.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            gateway.process.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            with pytest.raises(httpx.TransportError):  # cut mid-answer
                list(lines)
        exit_code = gateway.process.wait(timeout=30)
        stopped_after = time.monotonic() - signalled

    assert exit_code == 0
    assert stopped_after < 20  # the grace, not the stream's 30 s
    wait_until(lambda: fake.disconnects == 1, what="the host to see the request cancelled")
    (row,) = Request.objects.filter(started__gte=started)  # an earlier test's may still land
    assert row.status == 499
    assert "grace of 1 s over; cutting 1 requests" in gateway.log()


def test_health_answers_draining_on_a_kept_alive_connection_while_the_stream_finishes(
    django_db_setup, tmp_path, fake
):
    started = timezone.now()
    fake.token_delay = 0.1
    add_route("chat", [add_host("gpu1", fake.url)])
    with running_gateway(tmp_path, CROSSBAR_SHUTDOWN_GRACE="30") as gateway:
        gateway.sync()
        # A load balancer probing over its kept-alive connection.
        with httpx.Client(base_url=gateway.url, timeout=10) as balancer:
            before = balancer.get("/health")
            body = chat(stream=True, max_tokens=20)
            with httpx.stream("POST", f"{gateway.url}{URL}", json=body, timeout=30) as response:
                lines = response.iter_lines()
                next(line for line in lines if line.startswith("data: "))

                gateway.process.send_signal(signal.SIGTERM)
                wait_until(lambda: draining(balancer, gateway.url), what="/health draining")
                rest = [line for line in lines if line.startswith("data: ")]
        exit_code = gateway.process.wait(timeout=30)

    assert (before.status_code, before.json()["status"]) == (200, "ok")
    assert rest[-1] == "data: [DONE]" and len(rest) == 20
    assert exit_code == 0
    (row,) = Request.objects.filter(started__gte=started)  # an earlier test's may still land
    assert (row.status, row.completion_tokens) == (200, 20)


def test_a_gateway_stopped_by_sigterm_logs_stopped_as_its_last_line(
    django_db_setup, tmp_path, fake
):
    add_route("chat", [add_host("gpu1", fake.url)])
    with running_gateway(tmp_path) as gateway:
        gateway.sync()
        gateway.process.send_signal(signal.SIGTERM)
        exit_code = gateway.process.wait(timeout=30)
        lines = [line for line in gateway.log().splitlines() if "crossbar.serve" in line]

    assert exit_code == 0
    assert lines and lines[-1].endswith("stopped")


def rows_spooled(url: str) -> tuple[int, float]:
    """How many rows wait in the spool, as `/health` and `/metrics` say."""
    health = httpx.get(f"{url}/health", timeout=5).json()
    metrics = httpx.get(f"{url}/metrics", timeout=5).text
    gauge = next(
        line for line in metrics.splitlines() if line.startswith("crossbar_recorder_spooled")
    )
    return health["rows_spooled"], float(gauge.split()[-1])


def test_rows_the_database_cannot_take_at_a_stop_are_spooled_the_exit_says_so_and_the_next_start_writes_them(  # noqa: E501
    django_db_setup, tmp_path, fake
):
    started = timezone.now()
    var = tmp_path / "var"  # the gateway's var directory, where the spool is
    add_route("chat", [add_host("gpu1", fake.url)])
    with ExitStack() as lock:
        lock.enter_context(write_lock())  # SQLite's write lock, or the table's on PostgreSQL
        with running_gateway(tmp_path, CROSSBAR_VAR_DIR=str(var)) as gateway:
            gateway.sync()
            for n in range(6):
                body = chat(f"question {n}", stream=n % 2 == 0, max_tokens=3)
                assert httpx.post(f"{gateway.url}{URL}", json=body, timeout=30).status_code == 200
            gateway.process.send_signal(signal.SIGTERM)
            exit_code = gateway.process.wait(timeout=60)
        spooled = [
            line for path in (var / "spool").rglob("*") if path.is_file() for line in path.open()
        ]

        with running_gateway(tmp_path, CROSSBAR_VAR_DIR=str(var)) as again:
            wait_until(lambda: rows_spooled(again.url) == (6, 6), what="the spooled rows claimed")
            lock.close()  # the database takes writes again
            wait_until(lambda: rows_spooled(again.url) == (0, 0), 30, what="the rows written")
            again.process.send_signal(signal.SIGTERM)
            second_exit = again.process.wait(timeout=30)

    assert exit_code != 0
    assert "6 rows kept in" in gateway.log() and "written at the next start" in gateway.log()
    assert len(spooled) == 6
    rows = Request.objects.filter(started__gte=started)
    assert (
        sorted(rows.values_list("streamed", "status", "completion_tokens"))
        == [(False, 200, 3)] * 3 + [(True, 200, 3)] * 3
    )
    assert "6 rows written from the spool" in again.log()
    assert second_exit == 0
    assert not [path for path in (var / "spool").rglob("*") if path.is_file()]


@pytest.mark.skipif(
    not (os.environ.get("CROSSBAR_PG_BIN") and os.environ.get("CROSSBAR_PG_DATA")),
    reason="needs a PostgreSQL this test may stop and start (CROSSBAR_PG_BIN, CROSSBAR_PG_DATA)",
)
@pytest.mark.restarts_database
def test_rows_answered_while_postgresql_is_down_are_spooled_at_a_stop_and_written_at_the_next_start(  # noqa: E501
    django_db_setup, tmp_path, fake
):
    if connection.vendor != "postgresql":
        pytest.skip("the suite runs on SQLite")
    started = timezone.now()
    var = tmp_path / "var"
    add_route("chat", [add_host("gpu1", fake.url)])
    options = start_options()
    with running_gateway(tmp_path, CROSSBAR_VAR_DIR=str(var)) as gateway:
        gateway.sync()
        postgres("-m fast -w stop")
        try:
            for n in range(6):
                body = chat(f"question {n}", max_tokens=3)
                assert httpx.post(f"{gateway.url}{URL}", json=body, timeout=30).status_code == 200
            gateway.process.send_signal(signal.SIGTERM)
            exit_code = gateway.process.wait(timeout=60)
        finally:
            log = Path(os.environ["CROSSBAR_PG_DATA"]) / "log"
            postgres(f"-w -l {log} -o {shlex.quote(options)} start")
    connection.close()  # this process's connection died with the server

    assert exit_code != 0
    assert "6 rows kept in" in gateway.log()
    with running_gateway(tmp_path, CROSSBAR_VAR_DIR=str(var)) as again:
        rows = Request.objects.filter(started__gte=started)
        wait_until(lambda: rows.count() == 6, 30, what="the spooled rows")
        assert rows_spooled(again.url) == (0, 0)
    assert not [path for path in (var / "spool").rglob("*") if path.is_file()]
