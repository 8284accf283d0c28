"""The live dashboard: a page for staff, and the WebSocket that keeps it current.

The page (`/dashboard/`) is a plain template with uPlot (vendored in `routing/static/`); its
script opens `/dashboard/ws/` and renders what arrives. The consumer sends a `state` message
every `TICK` seconds, read from the runtime of its own event loop (the one the proxy serves
from): each host's `HostLive` (health and its reason, draining, leases, per model the slots in
flight against `parallel` and the queue), the requests that finished since the last message,
the requests running now, and per host the last five minutes (`history.cards`, with a hint for
a host that keeps losing its cache: `cache_lost_hint`). Charts come in
`history` messages: the whole window when the page opens or changes window, then only the
points that changed, never the whole history every tick. With shared state, the running and
recent requests, cards and charts are every live gateway process's, merged
(routing/ops/dashboard_share.py), not only those of the process serving the page.

A staff user with the right to change hosts may drain and undrain from the page; the change
goes through `hosts.actions.set_draining`, like the admin's, and every open dashboard is told
through the channel layer's group.
"""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import UTC, datetime
from typing import Any

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer
from django.conf import settings
from django.contrib import admin
from django.contrib.admin.views.decorators import staff_member_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render

from hosts.actions import set_draining
from hosts.models import DRAINING
from hosts.routes_left import left_lines, routes_left_without
from routing.ops.dashboard_share import (
    PROCESS,
    FleetView,
    request_entry,
    running_entries,
    share_fleet,
)
from routing.ops.fleet_map import decision_log, fleet_map
from routing.ops.history import database_history, ensure_sampler, history
from routing.ops.history_rings import CARD_SECONDS
from routing.ops.history_steps import RING_WINDOWS, WINDOWS
from routing.ops.live import host_lives
from routing.ops.metrics import recent
from routing.runtime import Runtime, get_runtime

log = logging.getLogger("crossbar.dashboard")

GROUP = "crossbar-dashboard"
TICK = 0.5
DEFAULT_WINDOW = "5m"
LOG_SHOWN = 20  # the model actor's decisions on the page, newest first
NO_ACTOR_SHARED = (
    "No model placement: with shared state (CROSSBAR_REDIS_URL) no process loads models yet."
)
NO_ROUTER_HOST = (
    "No model placement: no usable router-mode host here loads models only when crossbar"
    " asks (models_autoload off)."
)


@staff_member_required
def dashboard_page(request: HttpRequest) -> HttpResponse:
    """The page; anyone but active staff is sent to the admin login."""
    context = {
        **admin.site.each_context(request),
        "title": "Live dashboard",
        "can_drain": request.user.has_perm("hosts.change_host"),
        # The page shows every time in the site's zone, as the admin does.
        "time_zone": settings.TIME_ZONE,
    }
    return render(request, "dashboard/index.html", context)


def state(runtime: Runtime) -> dict[str, Any]:
    """Every configured host with its models, as the dashboard shows them, JSON-ready, and
    when this process began (`gateway_since`): the hosts' `since` is its view, from then on."""
    return {
        "type": "state",
        "revision": runtime.fleet.revision,
        "gateway_since": datetime.fromtimestamp(history.began, UTC).isoformat(timespec="seconds"),
        "hosts": [host.as_json() for host in host_lives(runtime)],
        "models": fleet_models(runtime),
        "process": PROCESS,  # the one serving this page
    }


def fleet_models(runtime: Runtime) -> dict[str, Any]:
    """The fleet map (routing/ops/fleet_map.py) and the model actor's last decisions, newest
    first; `note`, one line, when no actor places models here. Call on the runtime's loop."""
    actor = runtime.models
    if actor is None:
        return {"note": NO_ACTOR_SHARED, "map": [], "log": []}
    seen = actor.seen()
    state = runtime.state
    busy = {key for key in seen if state.in_flight(*key) or state.queued(*key)}
    return {
        "note": "" if seen else NO_ROUTER_HOST,
        "map": [row.as_json() for row in fleet_map(seen, actor.decisions.last, busy)],
        "log": decision_log(actor.decisions.recent, LOG_SHOWN),
    }


class DashboardConsumer(AsyncJsonWebsocketConsumer):
    """One open dashboard. Anonymous and non-staff users are refused at the handshake.

    Receives `{"type": "drain", "host": name, "on": true|false}` (and `"confirmed": true` once
    the page was told, by `{"type": "confirm_drain", "host", "lines"}`, which routes the drain
    would leave without a usable host) and
    `{"type": "window", "window": "5m"|"1h"|"24h"}`. Sends a `state` message every `TICK`
    (hosts, the requests finished since the last one, the requests running, the host cards),
    `history` messages (the whole window on connect, on a window change and once the rings'
    past is rebuilt from the rows, `replace: true`; then the points that changed, the step in
    progress included) and `notice` messages.
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
        self.shown_by: dict[str, int] = {}  # with shared state: the same, for each process
        self.fleet: FleetView | None = share_fleet(self.runtime, recent)
        self.window = DEFAULT_WINDOW
        self.history_from: int | None = None  # the step the next increment starts at
        self.db_version = -1  # the database history's version last sent
        self.history_version = history.version  # the rings' past, as last sent
        self.db_refresh: asyncio.Task[None] | None = None
        await self.accept()
        await self.channel_layer.group_add(GROUP, self.channel_name)
        ensure_sampler(self.runtime)
        self.ticker = asyncio.create_task(self._tick_forever())

    async def disconnect(self, code: int) -> None:
        ticker = getattr(self, "ticker", None)
        if ticker is not None:
            ticker.cancel()
            await self.channel_layer.group_discard(GROUP, self.channel_name)

    async def _tick_forever(self) -> None:
        try:
            await self.send_history(replace=True)
        except OSError:
            return  # the browser left (uvicorn says so on send, before the disconnect event)
        except Exception:  # the database down must not end the dashboard
            log.exception("dashboard: cannot send the history")
        while True:
            try:
                await self.send_state()
                await self.send_history(replace=False)
            except asyncio.CancelledError:
                raise
            except OSError:
                return  # the browser left: nothing to send to; `disconnect` cleans up
            except Exception:  # a reload failing (database down) must not end the dashboard
                log.exception("dashboard: cannot send the state")
            await asyncio.sleep(TICK)

    async def send_state(self) -> None:
        await self.runtime.refresh()
        message = state(self.runtime)
        if self.fleet is None:
            fresh = recent.since(self.shown)
            if fresh:
                self.shown = fresh[-1][0]
            message["requests"] = [request_entry(number, record) for number, record in fresh]
            message["running"] = running_entries(self.runtime)
            message["running_total"] = len(self.runtime.running)
        else:  # every live process's (routing/ops/dashboard_share.py)
            await self.fleet.read()
            message["requests"] = self.fleet.finished_since(self.shown_by)
            message["running"], message["running_total"] = self.fleet.running()
        message["cards"] = _cards()
        message["route_refusals"] = history.route_refusals()
        await self.send_json(message)

    async def send_history(self, *, replace: bool) -> None:
        """The window's points: all of them, or those that changed since the last send.

        A rebuilt past (`history.version`) is sent whole too, whatever was asked."""
        window = WINDOWS[self.window]
        replace = replace or self.history_version != history.version
        self.history_version = history.version
        since = None if replace else self.history_from
        if since is not None and self.fleet is not None:
            # Other processes' counts of a step arrive up to `lag` seconds after it ended:
            # the steps they may still change go again.
            since = (since - self.fleet.lag) // window.step * window.step
        if window.name in RING_WINDOWS:
            points = history.points(window.name, since=since)
        else:
            points = await self._day_points(replace, since)
        self.history_from = points[-1]["t"] if points else None
        await self.send_json(
            {
                "type": "history",
                "window": window.name,
                "step": window.step,
                "seconds": window.seconds,
                "replace": replace,
                "points": points,
            }
        )

    async def _day_points(self, replace: bool, since: int | None) -> list[dict[str, Any]]:
        """The 24-hour points to send now: from `since`, or from the first minute the table's
        last refresh changed when that is earlier."""
        if replace and database_history.stale:
            try:
                await database_history.refresh()
            except Exception:
                log.exception("dashboard: cannot read the request history")
                await self.send_json(
                    {"type": "notice", "text": "The 24-hour history cannot be read now."}
                )
        elif database_history.stale and (self.db_refresh is None or self.db_refresh.done()):
            # In the background: the live state keeps its pace while the database answers.
            self.db_refresh = asyncio.create_task(database_history.refresh())
            self.db_refresh.add_done_callback(_log_failure)
        if since is not None and database_history.version != self.db_version:
            since = min(since, database_history.changed_from)
        self.db_version = database_history.version
        return history.day_points(database_history, since=since)

    async def receive_json(self, content: Any, **kwargs: Any) -> None:
        if not isinstance(content, dict):
            return
        if content.get("type") == "window":
            await self.change_window(content.get("window"))
        elif content.get("type") == "drain":
            await self.drain(content.get("host"), content.get("on"), content.get("confirmed"))

    async def change_window(self, name: object) -> None:
        if not isinstance(name, str) or name not in WINDOWS:
            choices = ", ".join(WINDOWS)
            await self.send_json({"type": "notice", "text": f"Unknown window; use {choices}."})
            return
        self.window = name
        await self.send_history(replace=True)

    async def drain(self, host: object, on: object, confirmed: object = False) -> None:
        """Drain or undrain `host`. Draining a route's last usable host first asks: the page
        is sent the routes it would leave without one (`confirm_drain`), and drains only when
        asked again with `confirmed` (as the admin's drain action asks)."""
        if not isinstance(host, str) or not isinstance(on, bool):
            return
        if not self.can_drain:
            await self.send_json({"type": "notice", "text": "You may not change hosts."})
            return
        if on and confirmed is not True:
            left = await database_sync_to_async(routes_left_without)([host])
            if left:
                await self.send_json({"type": "confirm_drain", "host": host,
                                      "lines": left_lines(left)})  # fmt: skip
                return
        changed = await database_sync_to_async(set_draining)([host], on)
        verb = "started" if on else "stopped"
        if changed:
            log.info("dashboard: %s %s draining host %s", self.user_name, verb, host)
            text = f"{self.user_name} {verb} draining {host}. {DRAINING if on else ''}".strip()
            await self.channel_layer.group_send(GROUP, {"type": "dashboard.notice", "text": text})
        else:
            await self.send_json({"type": "notice", "text": f"{host}: nothing to change."})
        await self.send_state()

    async def dashboard_notice(self, event: dict[str, Any]) -> None:
        await self.send_json({"type": "notice", "text": event["text"]})


# A host that lost its cache this many times in a card's 5 minutes gets a hint on its card.
# Not at one: a single loss is routine (a burst of new conversations evicts one), and the prefix
# index forgets a lost prompt's blocks at once, so the same prompt counts again only if the host
# evicts it again. Two in 5 minutes is a host evicting what it is sent again, which more room
# cures. A restart the poller sees is not counted (the index forgets the host's cache when it
# comes back up: `LiveFleet._usable_again`); one it did not see is, once per conversation, and
# the hint says so rather than guess.
CACHE_LOST_RECURS = 2


def cache_lost_hint(lost: int) -> str | None:
    """What a host card says of a host that lost its cache `lost` times in its 5 minutes;
    None below `CACHE_LOST_RECURS`."""
    if lost < CACHE_LOST_RECURS:
        return None
    return (
        f"Lost what it had cached {lost} times in {CARD_SECONDS // 60} minutes: answers held"
        " less of their prompt than this gateway had sent the host, by more than a block"
        " (after a restart the gateway saw, nothing is counted). More slots (llama-server"
        " --parallel, and its parallel in crossbar) or a larger --cache-ram keep more; a"
        f" restart it did not see leaves this card within {CARD_SECONDS // 60} minutes."
    )


_cards_cache: tuple[int, dict[str, dict[str, Any]]] = (-1, {})


def _cards() -> dict[str, dict[str, Any]]:
    """The host cards, with their hints, computed once a second for every open dashboard."""
    global _cards_cache
    second = int(time.time())
    if _cards_cache[0] != second:
        cards = {
            host: {**card, "cache_lost_hint": cache_lost_hint(card["cache_lost"])}
            for host, card in history.cards().items()
        }
        _cards_cache = (second, cards)
    return _cards_cache[1]


def _log_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("dashboard: cannot read the request history: %s", task.exception())
