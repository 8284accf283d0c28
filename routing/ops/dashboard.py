"""The live dashboard: a page for staff, and the WebSocket that keeps it current.

The page (`/dashboard/`) is a plain template; its script opens `/dashboard/ws/` and renders
what arrives. The consumer sends a `state` message every `TICK` seconds, read from the runtime
of its own event loop (the one the proxy serves from): per host its health, draining flag and
leases, per (host, model) slots in flight against `parallel` and the queue, and the requests
that finished since the last message. A staff user with the right to change hosts may drain
and undrain from the page; the change goes through `hosts.actions.set_draining`, like the
admin's, and every open dashboard is told through the channel layer's group.
"""

from __future__ import annotations

import asyncio
import logging
from datetime import UTC, datetime
from typing import Any

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer
from django.contrib import admin
from django.contrib.admin.views.decorators import staff_member_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render

from accounting.recorder import RequestRecord
from hosts.actions import set_draining
from hosts.health import HostState
from routing.ops.metrics import recent
from routing.runtime import Runtime, get_runtime

log = logging.getLogger("crossbar.dashboard")

GROUP = "crossbar-dashboard"
TICK = 0.5


@staff_member_required
def dashboard_page(request: HttpRequest) -> HttpResponse:
    """The page; anyone but active staff is sent to the admin login."""
    context = {
        **admin.site.each_context(request),
        "title": "Live dashboard",
        "can_drain": request.user.has_perm("hosts.change_host"),
    }
    return render(request, "dashboard/index.html", context)


def state(runtime: Runtime) -> dict[str, Any]:
    """Every configured host with its models, as the dashboard shows them, JSON-ready."""
    health = runtime.health.snapshot()
    held = runtime.leases.held_by_host()
    pairs = {(pair.host, pair.model): pair for pair in runtime.limiter.snapshot()}
    hosts = []
    for name, host in sorted(runtime.fleet.hosts.items()):
        known = health.get(name)
        models = []
        for model in sorted(host.models.values(), key=lambda m: m.name):
            pair = pairs.get((name, model.name))
            models.append(
                {
                    "name": model.name,
                    "in_flight": pair.in_flight if pair else 0,
                    "parallel": model.parallel,
                    "queued": pair.queued if pair else 0,
                    "queue_max": model.queue_max,
                }
            )
        hosts.append(
            {
                "name": name,
                "enabled": host.enabled,
                "draining": host.draining,
                "state": str(known.state if known else HostState.UNKNOWN),
                "reason": known.reason if known else "",
                "since": _iso(known.since) if known else None,
                "leases": held.get(name, 0),
                "models": models,
            }
        )
    return {"type": "state", "revision": runtime.fleet.revision, "hosts": hosts}


def request_entry(number: int, record: RequestRecord) -> dict[str, Any]:
    """A finished request as the dashboard lists it (no fingerprint, no error details)."""
    return {
        "n": number,
        "started": record.started.isoformat(),
        "route": record.route,
        "model": record.model[:100],
        "host": record.host,
        "client": record.client,
        "status": record.status,
        "lease": record.lease,
        "total_ms": record.total_ms,
        "prompt_tokens": record.prompt_tokens,
        "completion_tokens": record.completion_tokens,
    }


def _iso(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).isoformat(timespec="seconds")


class DashboardConsumer(AsyncJsonWebsocketConsumer):
    """One open dashboard. Anonymous and non-staff users are refused at the handshake.

    Receives `{"type": "drain", "host": name, "on": true|false}`; sends `state` messages
    (with the requests finished since the last one) and `notice` messages.
    """

    async def connect(self) -> None:
        user = self.scope.get("user")
        if user is None or not (user.is_authenticated and user.is_active and user.is_staff):
            await self.close()  # before accept: the handshake is answered 403
            return
        self.user_name = user.get_username()
        self.can_drain = await database_sync_to_async(user.has_perm)("hosts.change_host")
        self.runtime = await get_runtime()
        self.shown = 0  # the number of the last request sent
        await self.accept()
        await self.channel_layer.group_add(GROUP, self.channel_name)
        self.ticker = asyncio.create_task(self._tick_forever())

    async def disconnect(self, code: int) -> None:
        ticker = getattr(self, "ticker", None)
        if ticker is not None:
            ticker.cancel()
            await self.channel_layer.group_discard(GROUP, self.channel_name)

    async def _tick_forever(self) -> None:
        while True:
            try:
                await self.send_state()
            except asyncio.CancelledError:
                raise
            except Exception:  # a reload failing (database down) must not end the dashboard
                log.exception("dashboard: cannot send the state")
            await asyncio.sleep(TICK)

    async def send_state(self) -> None:
        await self.runtime.refresh()
        message = state(self.runtime)
        fresh = recent.since(self.shown)
        if fresh:
            self.shown = fresh[-1][0]
        message["requests"] = [request_entry(number, record) for number, record in fresh]
        await self.send_json(message)

    async def receive_json(self, content: Any, **kwargs: Any) -> None:
        if not isinstance(content, dict) or content.get("type") != "drain":
            return
        host, on = content.get("host"), content.get("on")
        if not isinstance(host, str) or not isinstance(on, bool):
            return
        if not self.can_drain:
            await self.send_json({"type": "notice", "text": "You may not change hosts."})
            return
        changed = await database_sync_to_async(set_draining)([host], on)
        verb = "started" if on else "stopped"
        if changed:
            log.info("dashboard: %s %s draining host %s", self.user_name, verb, host)
            text = f"{self.user_name} {verb} draining {host}."
            await self.channel_layer.group_send(GROUP, {"type": "dashboard.notice", "text": text})
        else:
            await self.send_json({"type": "notice", "text": f"{host}: nothing to change."})
        await self.send_state()

    async def dashboard_notice(self, event: dict[str, Any]) -> None:
        await self.send_json({"type": "notice", "text": event["text"]})
