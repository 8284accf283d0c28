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
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

from accounting.models import Request
from tests.fakes.llama_server import FakeLlamaServer
from tests.helpers.fleet import MODEL, add_host, add_route, chat
from tests.helpers.gateway import running_gateway, signed_in
from tests.helpers.machine import ROOT, free_port
from tests.helpers.waits import wait_until

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


def operator_headers(gateway) -> dict[str, str]:
    """The headers of a signed-in operator's dashboard socket."""
    browser = signed_in(gateway)
    cookie = "; ".join(f"{name}={value}" for name, value in browser.cookies.items())
    browser.close()
    return {"Cookie": cookie, "Origin": gateway.url}


def dashboard_sockets(
    gateway, how_many: int, stack: ExitStack, headers: dict[str, str] | None = None
) -> list[ClientConnection]:
    """`how_many` dashboard sockets of one signed-in operator, each on a connection of its own
    (the kernel hands each to either worker, by a hash of its addresses), closed with `stack`."""
    url = gateway.url.replace("http://", "ws://") + "/dashboard/ws/"
    headers = headers or operator_headers(gateway)
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


class Dashboard:
    """One open dashboard: its last `state`, the finished requests it was sent so far, and
    the 5-minute chart's points as its `history` messages left them."""

    def __init__(self, socket: ClientConnection) -> None:
        self.socket = socket
        self.state: dict[str, Any] = {}
        self.requests: list[dict[str, Any]] = []
        self.points: dict[int, dict[str, Any]] = {}
        self.closed = False

    def read(self) -> None:
        """Take in every message waiting, then wait for the next `state`."""
        try:
            while True:
                try:
                    message = json.loads(self.socket.recv(timeout=0 if self.state else 10))
                except TimeoutError:
                    break
                self._take(message)
            while True:  # a state sent after those read above: its figures are current
                message = json.loads(self.socket.recv(timeout=10))
                self._take(message)
                if message["type"] == "state":
                    break
        except ConnectionClosed:
            self.closed = True

    def _take(self, message: dict[str, Any]) -> None:
        if message["type"] == "state":
            self.state = message
            self.requests += message["requests"]
        elif message["type"] == "history" and message["window"] == "5m":
            if message["replace"]:
                self.points = {}
            self.points.update((point["t"], point) for point in message["points"])

    @property
    def process(self) -> str:
        return self.state["process"]

    def running_by(self) -> list[str]:
        """The process each request of the running table runs in."""
        return sorted(entry.get("process", "?") for entry in self.state["running"])

    def card(self, host: str) -> int:
        return self.state["cards"].get(host, {}).get("requests", 0)

    def charted(self) -> int:
        """The requests the 5-minute chart counts, every outcome."""
        return sum(sum(point["requests"].values()) for point in self.points.values())


def shows_running(dashboard: Dashboard, requests: int) -> bool:
    dashboard.read()
    return len(dashboard.state["running"]) == requests


def charts(dashboard: Dashboard, requests: int) -> bool:
    dashboard.read()
    return dashboard.charted() == requests


def dashboards_on_every_worker(gw, stack: ExitStack, workers_wanted: int = 2) -> list[Dashboard]:
    """Dashboards of one operator, a connection each, opened until every worker serves one."""
    headers = operator_headers(gw)
    opened = [Dashboard(socket) for socket in dashboard_sockets(gw, 4, stack, headers)]
    for _ in range(24):
        for dashboard in opened:
            dashboard.read()
        if len({dashboard.state.get("process") for dashboard in opened}) >= workers_wanted:
            return opened
        opened.append(Dashboard(dashboard_sockets(gw, 1, stack, headers)[0]))
    pytest.fail("28 dashboard connections, none of them on the other worker")


@pytest.mark.django_db(transaction=True)
def test_with_two_workers_every_dashboard_shows_both_workers_requests_until_one_dies(
    django_db_setup, tmp_path, admin_user, redis_url
):
    with FakeLlamaServer(slots=16) as host, ExitStack() as stack:
        add_route("chat", [add_host("gpu1", host.url, models={MODEL: (16, 0)})])
        gw = stack.enter_context(
            running_gateway(
                tmp_path,
                CROSSBAR_WORKERS="2",
                CROSSBAR_REDIS_URL=redis_url,
                CROSSBAR_STREAM_IDLE_TIMEOUT="120",  # the held streams' first token never comes
            )
        )
        pids = wait_until(lambda: len(workers(gw.log())) == 2 and workers(gw.log()))
        port = int(gw.url.rsplit(":", 1)[1])
        wait_until(lambda: listening_sockets(port) == 2, what="a listening socket per worker")
        # Finished requests, each on a connection of its own, until both workers served some.
        finished = 0
        while len(served_by(gw.log())) < 2:
            assert finished < 40, "forty connections, all to one worker"
            assert served(gw.url) == 200
            finished += 1
            wait_until(lambda n=finished: sum(served_by(gw.log()).values()) == n, what="its line")
        shares = served_by(gw.log())
        # Streams held at the host, each on a connection of its own.
        host.first_token_delay = 120
        held = 0

        def hold_one() -> None:
            nonlocal held
            body = chat(f"{held}", stream=True)  # a conversation each: none waits for another
            stream = stack.enter_context(httpx.stream("POST", f"{gw.url}{URL}", json=body))
            assert stream.status_code == 200
            held += 1
            wait_until(lambda: host.in_flight == held, what="the stream at the host")

        for _ in range(4):
            hold_one()
        dashboards = dashboards_on_every_worker(gw, stack)
        while len(set(dashboards[0].running_by())) < 2:
            assert held < 16, f"sixteen streams, the dashboard shows {dashboards[0].running_by()}"
            hold_one()
            wait_until(lambda: shows_running(dashboards[0], held), timeout=30, what="the stream")

        # Every dashboard, whichever worker serves it, shows the whole fleet.
        def everyone_shows_all() -> bool:
            for dashboard in dashboards:
                dashboard.read()
            return all(
                dashboard.state["running_total"] == held
                and len(dashboard.running_by()) == held
                and dashboard.card("gpu1") == finished
                and dashboard.charted() == finished
                for dashboard in dashboards
            )

        wait_until(everyone_shows_all, timeout=30, what="every dashboard to show both workers")
        for dashboard in dashboards:
            assert len(dashboard.requests) == finished
            assert {entry["status"] for entry in dashboard.requests} == {200}
        running = dashboards[0].running_by()

        # A worker killed: its running requests and its finished ones leave every dashboard.
        victim = 1
        os.kill(pids[victim], signal.SIGKILL)
        survivor = f"worker {3 - victim}"
        kept = running.count(survivor)
        left = [dashboard for dashboard in dashboards if dashboard.process == survivor]
        headers = operator_headers(gw)
        left += [Dashboard(socket) for socket in dashboard_sockets(gw, 2, stack, headers)]

        def only_the_survivor_shows() -> bool:
            for dashboard in left:
                dashboard.read()
            return all(
                dashboard.closed  # opened on the victim just before it died
                or (
                    dashboard.running_by() == [survivor] * kept
                    and dashboard.state["running_total"] == kept
                    and dashboard.card("gpu1") == shares[3 - victim]
                )
                for dashboard in left
            )

        wait_until(only_the_survivor_shows, timeout=30, what="the dead worker's part to leave")
        fresh = Dashboard(dashboard_sockets(gw, 1, stack, headers)[0])
        wait_until(lambda: charts(fresh, shares[3 - victim]), timeout=30, what="the chart")
        assert len(fresh.requests) == shares[3 - victim]

    assert "Traceback" not in gw.log()
