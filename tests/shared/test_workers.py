"""`CROSSBAR_WORKERS=N make run` (`manage.py crossbar_serve`), on daphne and on uvicorn:
refused without Redis; with it, N worker processes serve one port, each on its own socket
(SO_REUSEPORT) so that connections are spread over them, a dead worker is replaced, and SIGTERM
stops them all gracefully."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
from django.db import connection
from django.utils import timezone
from websockets.sync.client import ClientConnection, connect

from accounting.models import Request
from tests.conftest import ROOT, free_port, running_gateway, signed_in, wait_until
from tests.fakes.llama_server import FakeLlamaServer
from tests.fleet import MODEL, add_host, add_route, chat

URL = "/chat/v1/chat/completions"


def crossbar_serve(tmp_path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "manage.py", "crossbar_serve", "--port", str(free_port())],
        cwd=ROOT,
        env={**os.environ, "CROSSBAR_VAR_DIR": str(tmp_path), **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_workers_without_redis_are_refused_with_one_line_saying_why(tmp_path):
    done = crossbar_serve(tmp_path, CROSSBAR_WORKERS="2", CROSSBAR_REDIS_URL="")

    assert done.returncode != 0
    assert done.stderr.strip().splitlines() == [
        "CommandError: CROSSBAR_WORKERS=2 needs CROSSBAR_REDIS_URL: several gateway processes "
        "share their slots, queues and leases through Redis (docs/replicas.md)"
    ]


def test_a_redis_url_of_another_kind_is_refused_with_one_line_without_the_url(tmp_path):
    done = crossbar_serve(tmp_path, CROSSBAR_REDIS_URL="http://user:secret@cache.internal")

    assert done.returncode != 0
    assert done.stderr.strip().splitlines() == [
        "CommandError: CROSSBAR_REDIS_URL must start with redis://, rediss:// or unix://"
    ]


@pytest.mark.parametrize("value", ["0", "two", "65", "-1"])
def test_a_bad_number_of_workers_is_refused_with_one_line(tmp_path, value):
    done = crossbar_serve(tmp_path, CROSSBAR_WORKERS=value, CROSSBAR_REDIS_URL="redis://x")

    assert done.returncode != 0
    assert done.stderr.strip().splitlines() == [
        f"CommandError: CROSSBAR_WORKERS must be a whole number of processes from 1 to 64, "
        f"not {value!r}"
    ]


def workers(log: str) -> dict[int, int]:
    """The pid of each worker the supervisor started last, by worker number."""
    return {int(n): int(pid) for n, pid in re.findall(r"worker (\d+) started \(pid (\d+)\)", log)}


def served(url: str) -> int:
    """A chat request on a fresh connection; its status."""
    return httpx.post(f"{url}{URL}", json=chat(), timeout=30).status_code


def listening_sockets(port: int) -> int:
    """How many sockets listen on 127.0.0.1:`port` (what `ss -ltn` lists), from /proc/net/tcp."""
    local = f"0100007F:{port:04X}"
    lines = Path("/proc/net/tcp").read_text().splitlines()[1:]
    return sum(1 for line in lines if line.split()[1:2] == [local] and line.split()[3] == "0A")


def served_by(log: str) -> dict[int, int]:
    """How many chat requests each worker logged, by worker number."""
    lines = re.findall(r"worker (\d+) INFO crossbar\.proxy route=chat ", log)
    return {int(n): lines.count(n) for n in set(lines)}


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("server", ["daphne", "uvicorn"])
def test_two_workers_share_the_connections_a_dead_one_is_replaced_and_sigterm_stops_both(
    django_db_setup, tmp_path, fake, redis_url, server
):
    add_route("chat", [add_host("gpu1", fake.url)])
    since = timezone.now()  # rows of this test only, whatever another gateway writes late
    rows = Request.objects.filter(started__gte=since)
    grace = "120"  # stopping must not wait for it: nothing is in flight
    with running_gateway(
        tmp_path,
        CROSSBAR_SERVER=server,
        CROSSBAR_WORKERS="2",
        CROSSBAR_REDIS_URL=redis_url,
        CROSSBAR_SHUTDOWN_GRACE=grace,
    ) as gateway:
        pids = wait_until(lambda: len(workers(gateway.log())) == 2 and workers(gateway.log()))
        port = int(gateway.url.rsplit(":", 1)[1])
        wait_until(lambda: listening_sockets(port) == 2, what="a listening socket per worker")
        # Each connection goes to one worker's socket, by a hash of its addresses: twenty
        # connections all landing on one of two workers would be a one-in-500,000 chance.
        assert [served(gateway.url) for _ in range(20)] == [200] * 20
        wait_until(lambda: rows.count() == 20, timeout=30, what="the twenty rows")
        shares = served_by(gateway.log())

        os.kill(pids[1], signal.SIGKILL)
        wait_until(
            lambda: workers(gateway.log()).get(1, pids[1]) != pids[1],
            timeout=30,
            what="a new worker 1",
        )
        assert [served(gateway.url) for _ in range(3)] == [200] * 3

        gateway.process.send_signal(signal.SIGTERM)
        exit_code = gateway.process.wait(timeout=60)

    assert sorted(shares) == [1, 2] and sum(shares.values()) == 20
    assert exit_code == 0
    assert f"worker 1 (pid {pids[1]}) exited with signal SIGKILL" in gateway.log()
    assert "all workers stopped" in gateway.log()
    assert sorted(rows.values_list("status", flat=True)) == [200] * 23
    for pid in [*pids.values(), *workers(gateway.log()).values()]:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # no worker left behind
    # Several processes on one SQLite file work, but PostgreSQL is what they want: said at start.
    warned = "CROSSBAR_WORKERS=2 on SQLite: the workers take turns on one database file"
    assert (warned in gateway.log()) == (connection.vendor == "sqlite")


def dashboard_sockets(gateway, how_many: int, stack: ExitStack) -> list[ClientConnection]:
    """`how_many` dashboard sockets of one signed-in operator, each on a connection of its own
    (the kernel hands each to either worker, by a hash of its addresses), closed with `stack`."""
    browser = signed_in(gateway)
    cookie = "; ".join(f"{name}={value}" for name, value in browser.cookies.items())
    browser.close()
    url = gateway.url.replace("http://", "ws://") + "/dashboard/ws/"
    headers = {"Cookie": cookie, "Origin": gateway.url}
    return [
        stack.enter_context(connect(url, additional_headers=headers, open_timeout=30))
        for _ in range(how_many)
    ]


def fleet_state(socket: ClientConnection, *, fresh: bool = False) -> Any:
    """The last `state` message the socket holds (None: none); `fresh`: after those, wait for
    the next one."""
    last = None
    while True:
        try:
            message = json.loads(socket.recv(timeout=0))
        except TimeoutError:
            break
        last = message if message["type"] == "state" else last
    while fresh and last is None:
        message = json.loads(socket.recv(timeout=10))
        last = message if message["type"] == "state" else None
    return last


def in_flight(message: dict, host: str) -> int:
    (shown,) = [entry for entry in message["hosts"] if entry["name"] == host]
    return sum(model["in_flight"] for model in shown["models"])


@pytest.mark.django_db(transaction=True)
def test_with_two_workers_every_dashboard_stays_open_and_shows_the_whole_fleet(
    django_db_setup, tmp_path, admin_user, redis_url
):
    with FakeLlamaServer(slots=2, first_token_delay=120) as slow:
        add_route("chat", [add_host("gpu1", slow.url, models={MODEL: (2, 0)})])
        with running_gateway(
            tmp_path,
            CROSSBAR_WORKERS="2",
            CROSSBAR_REDIS_URL=redis_url,
            CROSSBAR_STREAM_IDLE_TIMEOUT="120",  # the host's first token is 120 s away
        ) as gw:
            wait_until(lambda: len(workers(gw.log())) == 2, what="two workers")
            port = int(gw.url.rsplit(":", 1)[1])
            wait_until(lambda: listening_sockets(port) == 2, what="a listening socket per worker")
            # One request running, on whichever worker took its connection: every dashboard,
            # on either worker, shows it (one view of the fleet, not of the serving worker).
            with httpx.stream("POST", f"{gw.url}{URL}", json=chat(stream=True), timeout=60):
                wait_until(lambda: slow.in_flight == 1, what="the request at the host")
                with ExitStack() as stack:
                    sockets = dashboard_sockets(gw, 8, stack)  # all on one worker: 1 in 128
                    # Open past a channel layer's blocking read (5 s) and its socket's timeout,
                    # twice over: a socket closed meanwhile raises ConnectionClosed.
                    until = time.monotonic() + 12
                    while time.monotonic() < until:
                        for socket in sockets:
                            fleet_state(socket)
                        time.sleep(0.5)  # the dashboard's pace; the sockets are read above
                    shown = [fleet_state(socket, fresh=True) for socket in sockets]
                    assert [in_flight(message, "gpu1") for message in shown] == [1] * 8

    assert "Traceback" not in gw.log()
    assert "TimeoutError" not in gw.log()
