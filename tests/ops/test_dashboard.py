"""The live dashboard: the page for staff only, and the WebSocket that feeds and drains."""

from __future__ import annotations

import asyncio
import socket
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from asgiref.sync import sync_to_async
from channels.testing import WebsocketCommunicator
from django.contrib.auth.models import Permission, User

from accounting.recorder import RequestRecord
from hosts.models import DRAINING, Host
from routing.ops import metrics
from routing.ops.dashboard import DashboardConsumer
from routing.runtime import close_runtime
from tests.helpers.conversation import Conversation
from tests.helpers.fleet import MODEL, add_host, add_route
from tests.helpers.gateway import signed_in
from tests.helpers.observe import dashboard, state_where

pytestmark = pytest.mark.django_db(transaction=True)


# -- the page ---------------------------------------------------------------------------------


def test_the_page_renders_for_staff_with_its_socket_and_drain_buttons(admin_client):
    add_route("chat", [add_host("gpu1", "http://10.0.0.5:8080")])

    response = admin_client.get("/dashboard/")

    assert response.status_code == 200
    page = response.content.decode()
    assert "Live dashboard" in page
    assert '"/dashboard/ws/"' in page
    assert 'data-can-drain="true"' in page


def test_anonymous_visitors_are_sent_to_the_admin_login(client):
    response = client.get("/dashboard/")

    assert response.status_code == 302
    assert response["Location"] == "/admin/login/?next=/dashboard/"


def test_signed_in_users_who_are_not_staff_are_sent_to_the_admin_login(client):
    User.objects.create_user("visitor", password="pw-visitor-1")
    client.login(username="visitor", password="pw-visitor-1")

    response = client.get("/dashboard/")

    assert response.status_code == 302
    assert response["Location"].startswith("/admin/login/")


def test_staff_without_the_right_to_change_hosts_see_no_drain_buttons(client):
    User.objects.create_user("watcher", password="pw-watcher-1", is_staff=True)
    client.login(username="watcher", password="pw-watcher-1")

    response = client.get("/dashboard/")

    assert response.status_code == 200
    assert 'data-can-drain="false"' in response.content.decode()


def test_the_real_server_serves_the_page_behind_the_login(gateway):
    response = httpx.get(f"{gateway.url}/dashboard/")

    assert response.status_code == 302
    assert response.headers["location"] == "/admin/login/?next=/dashboard/"


def websocket_handshake(url: str, cookie: str = "", origin: str = "") -> str:
    """Open a WebSocket on the real server by hand; return the status line it answers."""
    parts = urlsplit(url)
    origin = origin or url
    request = (
        f"GET /dashboard/ws/ HTTP/1.1\r\nHost: {parts.netloc}\r\nUpgrade: websocket\r\n"
        "Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
        f"Sec-WebSocket-Version: 13\r\nOrigin: {origin}\r\n"
        + (f"Cookie: {cookie}\r\n" if cookie else "")
        + "\r\n"
    )
    assert parts.port is not None, f"{url} names no port"
    with socket.create_connection((parts.hostname, parts.port), timeout=10) as sock:
        sock.sendall(request.encode())
        return sock.recv(4096).decode(errors="replace").split("\r\n", 1)[0]


def test_the_real_server_refuses_an_anonymous_websocket(gateway):
    assert " 403 " in websocket_handshake(gateway.url)


def signed_in_session(gateway) -> str:
    """Sign in as pytest-django's `admin_user` through the real server; the session cookie."""
    session = signed_in(gateway).cookies.get("sessionid") or ""
    assert session, "the login gave no session"
    return f"sessionid={session}"


def test_the_real_server_opens_the_websocket_for_a_signed_in_admin(gateway, admin_user):
    assert " 101 " in websocket_handshake(gateway.url, signed_in_session(gateway))


def test_a_page_of_another_site_cannot_open_the_websocket_with_the_admin_cookie(
    gateway, admin_user
):
    cookie = signed_in_session(gateway)

    assert " 403 " in websocket_handshake(gateway.url, cookie, origin="http://evil.example")


# -- the consumer -----------------------------------------------------------------------------


@pytest.fixture
async def connect():
    """Open a dashboard socket as a given user; closes sockets and the runtime afterwards."""
    opened: list[WebsocketCommunicator] = []

    async def open_as(user: Any) -> tuple[WebsocketCommunicator, bool]:
        communicator = WebsocketCommunicator(DashboardConsumer.as_asgi(), "/dashboard/ws/")
        communicator.scope["user"] = user
        connected, _ = await communicator.connect()
        if connected:
            opened.append(communicator)
        return communicator, connected

    yield open_as
    for communicator in opened:
        await communicator.disconnect()
    await close_runtime()


async def receive_until(communicator: WebsocketCommunicator, wanted):
    """The first message `wanted(message)` accepts; fail after 15 seconds (a host's first
    health poll falls anywhere in the first interval, 5 s by default: hosts.poller)."""
    async with asyncio.timeout(15):
        while True:
            message = await communicator.receive_json_from(timeout=5)
            if wanted(message):
                return message


def host_in(message: dict[str, Any], name: str) -> dict[str, Any] | None:
    if message.get("type") != "state":
        return None
    return next((host for host in message["hosts"] if host["name"] == name), None)


async def test_anonymous_and_non_staff_sockets_are_refused(connect):
    from django.contrib.auth.models import AnonymousUser

    visitor = await sync_to_async(User.objects.create_user)("visitor", password="x-1234567")

    _, anonymous = await connect(AnonymousUser())
    _, not_staff = await connect(visitor)

    assert not anonymous and not not_staff


async def test_staff_get_hosts_with_slots_and_the_requests_going_by(connect):
    staff = await sync_to_async(User.objects.create_superuser)("ops", password="x-1234567")
    gpu1 = await sync_to_async(add_host)("gpu1", "http://127.0.0.1:9", models={MODEL: (3, 2)})
    await sync_to_async(add_route)("chat", [gpu1])

    communicator, connected = await connect(staff)
    first = await receive_until(communicator, lambda m: host_in(m, "gpu1"))
    metrics.observe(
        RequestRecord(
            route="chat",
            fingerprint="f" * 64,
            model=MODEL,
            host="gpu1",
            started=datetime.now(UTC),
            queued_ms=0,
            ttfb_ms=12,
            total_ms=345,
            status=200,
            streamed=True,
            lease="new",
            prompt_tokens=7,
            cached_tokens=0,
            completion_tokens=5,
            client="team-a",
        )  # fmt: skip
    )
    later = await receive_until(
        communicator, lambda m: any(r["total_ms"] == 345 for r in m.get("requests", []))
    )

    assert connected
    host = host_in(first, "gpu1")
    assert host is not None
    assert host["models"] == [
        {
            "name": MODEL, "in_flight": 0, "parallel": 3, "queued": 0, "queue_max": 2,
            "slot_naming": None,  # not read yet: no slot to name
            "shared_slot_lost": 0,
        }
    ]  # fmt: skip
    assert host["draining"] is False and host["leases"] == 0
    assert host["state"] in ("unknown", "down")
    seen = next(r for r in later["requests"] if r["total_ms"] == 345)
    assert seen == seen | {
        "route": "chat", "model": MODEL, "host": "gpu1", "status": 200, "client": "team-a",
        "prompt_tokens": 7, "completion_tokens": 5,
    }  # fmt: skip
    assert "fingerprint" not in seen


async def test_drain_and_undrain_from_the_socket_reach_the_database_and_every_dashboard(connect):
    staff = await sync_to_async(User.objects.create_superuser)("ops", password="x-1234567")
    gpu1 = await sync_to_async(add_host)("gpu1", "http://127.0.0.1:9")
    gpu2 = await sync_to_async(add_host)("gpu2", "http://127.0.0.1:10")
    await sync_to_async(add_route)("chat", [gpu1, gpu2])
    mine, _ = await connect(staff)
    other, _ = await connect(staff)

    await mine.send_json_to({"type": "drain", "host": "gpu1", "on": True})
    drained = await receive_until(mine, lambda m: (h := host_in(m, "gpu1")) and h["draining"])
    notice = await receive_until(other, lambda m: m["type"] == "notice")
    in_db = await sync_to_async(lambda: Host.objects.get(name="gpu1").draining)()
    await mine.send_json_to({"type": "drain", "host": "gpu1", "on": False})
    await receive_until(mine, lambda m: (h := host_in(m, "gpu1")) and not h["draining"])

    assert host_in(drained, "gpu1")["draining"] is True  # type: ignore[index]  # None fails the test
    assert notice["text"] == f"ops started draining gpu1. {DRAINING}"
    assert in_db is True
    assert await sync_to_async(lambda: Host.objects.get(name="gpu1").draining)() is False


async def test_draining_a_routes_last_host_from_the_socket_asks_first_and_drains_once_confirmed(
    connect,
):
    staff = await sync_to_async(User.objects.create_superuser)("ops", password="x-1234567")
    gpu1 = await sync_to_async(add_host)("gpu1", "http://127.0.0.1:9")
    await sync_to_async(add_route)("chat", [gpu1])
    communicator, _ = await connect(staff)

    await communicator.send_json_to({"type": "drain", "host": "gpu1", "on": True})
    asked = await receive_until(communicator, lambda m: m["type"] == "confirm_drain")
    draining_before = await sync_to_async(lambda: Host.objects.get(name="gpu1").draining)()
    await communicator.send_json_to({"type": "drain", "host": "gpu1", "on": True,
                                     "confirmed": True})  # fmt: skip
    await receive_until(communicator, lambda m: (h := host_in(m, "gpu1")) and h["draining"])

    assert asked["host"] == "gpu1"
    assert "“chat”" in asked["lines"][0] and "last usable host" in asked["lines"][0]
    assert draining_before is False
    assert await sync_to_async(lambda: Host.objects.get(name="gpu1").draining)() is True


async def test_staff_without_the_right_to_change_hosts_cannot_drain(connect):
    watcher = await sync_to_async(User.objects.create_user)(
        "watcher", password="x-1234567", is_staff=True
    )
    await sync_to_async(add_host)("gpu1", "http://127.0.0.1:9")
    communicator, connected = await connect(watcher)

    await communicator.send_json_to({"type": "drain", "host": "gpu1", "on": True})
    notice = await receive_until(communicator, lambda m: m["type"] == "notice")

    assert connected
    assert notice["text"] == "You may not change hosts."
    assert await sync_to_async(lambda: Host.objects.get(name="gpu1").draining)() is False


async def test_a_staff_user_granted_the_permission_can_drain(connect):
    def user_with_permission() -> User:
        user = User.objects.create_user("oncall", password="x-1234567", is_staff=True)
        user.user_permissions.add(Permission.objects.get(codename="change_host"))
        return user

    oncall = await sync_to_async(user_with_permission)()
    await sync_to_async(add_host)("gpu1", "http://127.0.0.1:9")
    communicator, _ = await connect(oncall)

    await communicator.send_json_to({"type": "drain", "host": "gpu1", "on": True})
    await receive_until(communicator, lambda m: (h := host_in(m, "gpu1")) and h["draining"])

    assert await sync_to_async(lambda: Host.objects.get(name="gpu1").draining)() is True


# -- history, running requests and host cards -------------------------------------------------


def finished(host: str, **changes: Any) -> RequestRecord:
    values: dict[str, Any] = dict(
        route="chat", fingerprint="f" * 64, model=MODEL, host=host,
        started=datetime.now(UTC), queued_ms=0, ttfb_ms=30, total_ms=400, status=200,
        streamed=True, lease="reused", prompt_tokens=100, cached_tokens=10, completion_tokens=8,
    )  # fmt: skip
    values.update(changes)
    return RequestRecord(**values)


async def staff_on_dashboard(connect, host: str):
    staff = await sync_to_async(User.objects.create_superuser)("ops", password="x-1234567")
    added = await sync_to_async(add_host)(host, "http://127.0.0.1:9", models={MODEL: (2, 2)})
    await sync_to_async(add_route)("chat", [added])
    communicator, connected = await connect(staff)
    assert connected
    return communicator


def is_history(replace: bool, window: str = "5m"):
    return lambda m: m["type"] == "history" and m["replace"] is replace and m["window"] == window


async def test_the_history_comes_whole_on_connect_and_then_only_what_changed(connect):
    communicator = await staff_on_dashboard(connect, "gpu-hist")

    whole = await receive_until(communicator, is_history(True))
    metrics.observe(finished("gpu-hist", status=503, code="queue_full", ttfb_ms=None))
    metrics.observe(finished("gpu-hist"))

    def counted(m: dict[str, Any]) -> bool:
        return is_history(False)(m) and any(
            p["hosts"].get("gpu-hist", {}).get("requests") == 2 for p in m["points"]
        )

    increment = await receive_until(communicator, counted)

    assert (whole["step"], whole["seconds"], len(whole["points"])) == (5, 300, 60)
    assert len(increment["points"]) <= 2  # the step in progress, and the one before it at most
    point = next(p for p in increment["points"] if "gpu-hist" in p["hosts"])
    assert point["requests"]["5xx"] >= 1 and point["codes"].get("queue_full", 0) >= 1
    assert point["hosts"]["gpu-hist"]["cold"] == 2
    assert point["hosts"]["gpu-hist"]["cache_hit"] == 0.1


async def test_choosing_a_window_sends_that_window_whole(connect):
    communicator = await staff_on_dashboard(connect, "gpu-win")
    await receive_until(communicator, is_history(True))

    await communicator.send_json_to({"type": "window", "window": "1h"})
    hour = await receive_until(communicator, is_history(True, "1h"))
    await communicator.send_json_to({"type": "window", "window": "1y"})
    refused = await receive_until(communicator, lambda m: m["type"] == "notice")

    assert (hour["step"], len(hour["points"])) == (30, 120)
    assert refused["text"] == "Unknown window; use 5m, 1h, 24h."


async def test_the_24_hour_window_is_read_from_the_request_rows(connect, monkeypatch):
    from accounting.models import Request
    from routing.ops import dashboard
    from routing.ops.history_rows import DatabaseHistory

    monkeypatch.setattr(dashboard, "database_history", DatabaseHistory())
    communicator = await staff_on_dashboard(connect, "gpu-day")
    # Older than the hour the hour ring serves: the table's part of the 24 hours.
    an_hour_ago = datetime.now(UTC).replace(second=0, microsecond=0) - timedelta(hours=2)
    for status in (200, 200, 504):
        await sync_to_async(Request.objects.create)(
            route="chat", model=MODEL, host="gpu-day", started=an_hour_ago + timedelta(seconds=7),
            queued_ms=0, ttfb_ms=80, total_ms=3000, status=status,
            code="upstream_timeout" if status == 504 else "",
        )  # fmt: skip

    await communicator.send_json_to({"type": "window", "window": "24h"})
    day = await receive_until(communicator, is_history(True, "24h"))

    assert (day["step"], len(day["points"])) == (60, 24 * 60)
    point = next(p for p in day["points"] if p["t"] == int(an_hour_ago.timestamp()))
    assert point["requests"] == {"2xx": 2, "4xx": 0, "5xx": 1, "499": 0}
    assert point["codes"] == {"upstream_timeout": 1}
    assert point["hosts"]["gpu-day"]["requests"] == 3


async def test_a_dashboard_opened_after_a_restart_shows_the_requests_before_it(
    connect, monkeypatch
):
    from accounting.models import Request
    from routing.ops import dashboard
    from routing.ops import history as history_module
    from routing.ops.history_rings import History

    ten_minutes_ago = datetime.now(UTC) - timedelta(minutes=10)
    for status in (200, 200, 503):
        await sync_to_async(Request.objects.create)(
            route="chat", model=MODEL, host="gpu-back", started=ten_minutes_ago, queued_ms=0,
            ttfb_ms=80, total_ms=3000, status=status, code="queue_full" if status == 503 else "",
        )  # fmt: skip
    restarted = History()  # a new process's history: empty until rebuilt from the rows
    monkeypatch.setattr(history_module, "history", restarted)
    monkeypatch.setattr(dashboard, "history", restarted)
    communicator = await staff_on_dashboard(connect, "gpu-back")
    await communicator.send_json_to({"type": "window", "window": "1h"})

    def counted(m: dict[str, Any]) -> bool:
        return is_history(True, "1h")(m) and any(
            p["hosts"].get("gpu-back", {}).get("requests") for p in m["points"]
        )

    hour = await receive_until(communicator, counted)

    point = next(p for p in hour["points"] if p["hosts"].get("gpu-back"))
    assert point["requests"] == {"2xx": 2, "4xx": 0, "5xx": 1, "499": 0}
    assert point["codes"] == {"queue_full": 1}


async def test_running_requests_show_with_their_host_wait_and_tokens_until_they_finish(connect):
    from routing.runtime import get_runtime

    communicator = await staff_on_dashboard(connect, "gpu-run")
    runtime = await get_runtime()
    waiting = runtime.running.add("chat", MODEL, "team-b")
    streaming = runtime.running.add("chat", MODEL, "")
    runtime.running.placed(streaming, "gpu-run", 250, MODEL)
    streaming.tokens = 7  # as the relay counts them

    shown = await receive_until(communicator, lambda m: len(m.get("running", [])) == 2)
    runtime.running.finish(waiting)
    runtime.running.finish(streaming)
    gone = await receive_until(communicator, lambda m: m.get("running") == [])

    first, second = shown["running"]
    assert first == first | {"route": "chat", "model": MODEL, "client": "team-b", "host": ""}
    assert first["queued_ms"] is None
    assert second == second | {"host": "gpu-run", "queued_ms": 250, "tokens": 7}
    assert second["elapsed_ms"] >= 0
    assert shown["running_total"] == 2 and gone["running_total"] == 0


async def test_host_cards_give_the_last_five_minutes_and_the_down_reason(connect):
    communicator = await staff_on_dashboard(connect, "gpu-card")  # nothing listens at its URL
    metrics.observe(finished("gpu-card", ttfb_ms=120, cached_tokens=90))
    metrics.observe(finished("gpu-card", status=502, ttfb_ms=120, cached_tokens=90))

    message = await receive_until(
        communicator,
        lambda m: (
            m.get("cards", {}).get("gpu-card", {}).get("requests") == 2
            and (host_in(m, "gpu-card") or {}).get("state") == "down"
        ),
    )

    card = message["cards"]["gpu-card"]
    assert card["outcomes"] == {"2xx": 1, "4xx": 0, "5xx": 1, "499": 0}
    assert card["codes"] == {"http_502": 1}
    assert card["cache_hit"] == 0.9 and card["cold"] == 0
    assert 100 < card["ttfb_p50"] <= 125
    reason = host_in(message, "gpu-card")["reason"]  # type: ignore[index]  # None fails the test
    assert reason.startswith("/health: connection refused")


# -- a host that keeps losing its cache, through the real gateway -----------------------------


def test_a_host_card_counts_each_lost_cache_and_hints_at_more_room_once_it_recurs(
    gateway, fake, admin_user
):
    # A name of its own: the session's gateway keeps each host name's last 5 minutes.
    add_route("chat", [add_host("gpu-forgets", fake.url)])
    gateway.sync()
    conversation = Conversation(f"{gateway.url}/chat/v1/chat/completions")

    def card_with(lost: int):
        return lambda m: m["cards"].get("gpu-forgets", {}).get("cache_lost") == lost

    with dashboard(gateway) as socket:
        conversation.turn()  # the prefix index learns what the host now holds
        fake.forget_cache()  # and the host loses it, as an eviction does
        conversation.turn()
        once = state_where(socket, card_with(1))["cards"]["gpu-forgets"]
        fake.forget_cache()  # again: the second turn's prompt, which the index expected
        conversation.turn()
        twice = state_where(socket, card_with(2))["cards"]["gpu-forgets"]

    assert once["requests"] == 2 and once["cache_lost_hint"] is None
    assert twice["requests"] == 3
    assert twice["cache_lost_hint"] == (
        "Lost what it had cached 2 times in 5 minutes: answers held less of their prompt than"
        " this gateway had sent the host, by more than a block (after a restart the gateway"
        " saw, nothing is counted). More slots (llama-server --parallel, and its parallel in"
        " crossbar) or a larger --cache-ram keep more; a restart it did not see leaves this"
        " card within 5 minutes."
    )
