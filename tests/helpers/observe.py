"""Waiting until the gateway has seen something, read where an operator reads it.

A test that changes the world (a host goes down, a request queues, a model loads) waits for the
gateway to know it before going on: on a gauge of `/metrics`, on the health polls a fake host
answered, or on the state the dashboard's socket sends. Each wait is bounded and fails the test,
saying what it waited for.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from websockets.sync.client import ClientConnection, connect

from tests.fakes.llama_server import FakeLlamaServer
from tests.helpers.gateway import Gateway, signed_in
from tests.helpers.waits import wait_until


def series(url: str, names: Collection[str]) -> dict[str, float]:
    """The non-zero samples of the gateway's `/metrics` called one of `names`, by series
    (the name and its sorted labels)."""
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return {
        f"{sample.name}{sorted(sample.labels.items())}": sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name in names and sample.value
    }


def gauge(url: str, name: str, **labels: str) -> float:
    """One gauge of the gateway's /metrics; 0 when the series is absent."""
    return series(url, (name,)).get(f"{name}{sorted(labels.items())}", 0.0)


def slot_naming(url: str) -> dict[str, float]:
    """`crossbar_slot_naming` by "host/model", zeros too: 1 while the gateway names the
    host's slots, 0 once it stopped (routing/live_fleet.py `slot_naming`)."""
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return {
        f"{sample.labels['host']}/{sample.labels['model']}": sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "crossbar_slot_naming"
    }


def wait_for_gauge(url: str, name: str, value: float, timeout: float = 10.0, **labels: str) -> None:
    """Wait until the gauge `name{labels}` reads `value`."""
    wait_until(
        lambda: gauge(url, name, **labels) == value,
        timeout,
        what=f"{name}{sorted(labels.items())} to read {value}",
    )


def wait_for_host_state(url: str, host: str, state: str) -> None:
    """Wait until the gateway holds `host` in `state` (unknown, up, loading, down)."""
    wait_for_gauge(url, "crossbar_host_state", 1, host=host, state=state)


def wait_for_health_poll(fake: FakeLlamaServer, timeout: float = 10.0) -> None:
    """Wait until the gateway has taken in a health poll of `fake` asked after this call.

    The poller asks each host `/health`, then (when it asks them) `/props` and `/v1/models`,
    records the answers, and only then sleeps and starts that host's next round. So the first
    `/health` seen after this call opens a round that sees the host as it is now, and the next
    one proves that round recorded. (A router's `/v1/models` is asked every round; another
    host's only when it comes up and every minute: hosts.poller.)
    """
    start = len(fake.requests_to("/health"))
    wait_until(
        lambda: len(fake.requests_to("/health")) >= start + 2,
        timeout,
        what="the gateway to take in a health poll of the host",
    )


@contextmanager
def dashboard(gateway: Gateway) -> Iterator[ClientConnection]:
    """The dashboard's socket, as a signed-in operator's browser opens it (the user must
    exist: pytest-django's `admin_user`)."""
    browser = signed_in(gateway)
    cookie = "; ".join(f"{name}={value}" for name, value in browser.cookies.items())
    browser.close()
    url = gateway.url.replace("http://", "ws://") + "/dashboard/ws/"
    headers = {"Cookie": cookie, "Origin": gateway.url}
    with connect(url, additional_headers=headers, open_timeout=10) as socket:
        yield socket


def state_where(socket: ClientConnection, wanted: Callable[[dict[str, Any]], bool]) -> dict:
    """The first `state` message `wanted` accepts; fails after 20 s."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        message = json.loads(socket.recv(timeout=10))
        if message.get("type") == "state" and wanted(message):
            return message
    pytest.fail("no dashboard state as wanted within 20 s")
