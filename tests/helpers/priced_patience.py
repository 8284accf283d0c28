"""Priced patience through the gateway: a route over two fresh one-slot hosts, and a turn that
spills at once from a busy home to the free host whose cold start is priced sooner."""

from __future__ import annotations

import uuid
from datetime import datetime

import httpx
from django.utils import timezone

from accounting.models import Request
from tests.fakes.llama_server import FakeLlamaServer
from tests.helpers.asking import holding, slow
from tests.helpers.fleet import MODEL, add_host, add_route, chat
from tests.helpers.waits import wait_until


def fresh_hosts(fake: FakeLlamaServer, fake2: FakeLlamaServer) -> tuple[str, str]:
    """A route `chat` (patience left to its default: auto) over two new one-slot hosts."""
    home, other = (f"{name}-{uuid.uuid4().hex[:8]}" for name in ("home", "other"))
    add_route(
        "chat",
        [
            add_host(home, fake.url, models={MODEL: (1, 4)}),
            add_host(other, fake2.url, models={MODEL: (1, 4)}),
        ],
    )
    return home, other


def spilled_at_once(
    url: str, fake: FakeLlamaServer, fake2: FakeLlamaServer, home: str, other: str
) -> tuple[httpx.Response, Request]:
    """Home serves slowly (its first answer takes some 1 s: the service its line is priced
    with, less what the request holding home's slot has held by then, which on a busy machine
    can be half a second), the other host is free and evaluates the short prompt in well
    under a millisecond: the next turn, with home busy, spills at once. Returns its response
    and its row."""
    fake.token_delay = 0.1
    first = httpx.post(url, json=chat("mine", max_tokens=10), timeout=10)
    assert first.headers["x-crossbar-host"] == home
    theirs = httpx.post(url, json=chat("theirs", max_tokens=2), timeout=10)
    assert theirs.headers["x-crossbar-host"] == other  # the other host's figures
    since = timezone.now()

    with holding(url, slow("mine", tokens=30), fake):  # home busy for some 3 s
        spilled = httpx.post(url, json=chat("mine", max_tokens=2), timeout=10)

    rows = Request.objects.filter(started__gte=since, host=other)
    wait_until(rows.exists, what="the spilled request's row")
    return spilled, rows.get()


def waited_row(home: str, since: datetime) -> Request:
    """The row of the one request since `since` that waited in `home`'s line and was served
    there (written by the recorder's thread: waited for)."""
    rows = Request.objects.filter(started__gte=since, host=home, queued_ms__gt=0)
    wait_until(rows.exists, what="the row of the request that waited")
    return rows.get()
