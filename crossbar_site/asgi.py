"""The ASGI entry point crossbar_serve serves, on daphne or uvicorn.

Two Django handlers share one URLconf. The site (admin, static files, dashboard, metrics) goes
through Django's own handler and the full middleware stack, and logs one access line per
request. Proxied requests go through `GatewayHandler` (crossbar_site/handler.py): no middleware,
no per-request thread, no signals, and the proxy's own line per request. Every HTTP request is
counted in flight, for the graceful stop (crossbar_site/lifecycle.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Mapping
from typing import Any

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "crossbar_site.settings")
site_app = get_asgi_application()

# Imports that need Django set up first.
from channels.auth import AuthMiddlewareStack  # noqa: E402
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from channels.security.websocket import AllowedHostsOriginValidator  # noqa: E402
from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler  # noqa: E402
from django.urls import path  # noqa: E402

from accounting.recorder import get_recorder  # noqa: E402
from crossbar_site.handler import GatewayHandler  # noqa: E402
from crossbar_site.lifecycle import (  # noqa: E402
    CUT_WAIT,
    REQUESTS,
    close_runtime,
    start_runtime,
)
from routing.ops.dashboard import DashboardConsumer  # noqa: E402
from routing.runtime import STOPPING  # noqa: E402

# First path segments served by the site; everything else is the gateway's.
SITE_PREFIXES = ("/admin", "/static/", "/dashboard", "/metrics", "/favicon.ico")


gateway_app = GatewayHandler()
# The admin's CSS and JavaScript, served from the apps' static folders (no collectstatic, no
# extra server): only the admin uses them, so their speed does not matter.
site_with_static = ASGIStaticFilesHandler(site_app)


access_log = logging.getLogger("crossbar.access")


def _names_a_route(scope: dict[str, Any]) -> bool:
    """Whether the request carries `X-Crossbar-Route`: then `/metrics` is the host's."""
    return any(name == b"x-crossbar-route" for name, _ in scope["headers"])


async def http_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    path: str = scope["path"]
    site = path.startswith(SITE_PREFIXES) and not (path == "/metrics" and _names_a_route(scope))
    REQUESTS.enter()
    try:
        if site:
            await _logged(scope, receive, send)
        else:
            await gateway_app(scope, receive, send)
    finally:
        REQUESTS.leave()


async def _logged(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Serve a request of the site, and log its access line (a proxied request's line is the
    proxy's own): client, method, path, status, milliseconds."""
    started = time.monotonic()
    status = 0  # the client left before the head

    async def sending(message: Mapping[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        await send(message)

    try:
        await site_with_static(scope, receive, sending)
    finally:
        client = scope.get("client") or ("-", 0)
        access_log.info(
            "%s %s %s %d %d ms",
            client[0],
            scope["method"],
            scope["path"][:200],
            status,
            (time.monotonic() - started) * 1000,
        )


async def lifespan(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Startup and shutdown, from servers that send them (uvicorn).

    The runtime starts with the server. At shutdown, which crossbar_serve's uvicorn sends once
    its graceful stop is over (and plain `uvicorn` once it has cancelled the requests still
    running past its own grace), the requests still winding up may write their rows, then
    the runtime closes and the recorder writes what it holds.
    """
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            start_runtime()
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            STOPPING.set()
            await REQUESTS.idle_within(CUT_WAIT)
            await close_runtime()
            await asyncio.to_thread(get_recorder().stop)
            await send({"type": "lifespan.shutdown.complete"})
            return


application = ProtocolTypeRouter(
    {
        "lifespan": lifespan,
        "http": http_app,
        # The live dashboard: session-authenticated, and only from pages of an allowed host
        # (a cookie-authenticated socket must not be opened by another site's script).
        "websocket": AllowedHostsOriginValidator(
            AuthMiddlewareStack(URLRouter([path("dashboard/ws/", DashboardConsumer.as_asgi())]))
        ),
    }
)
