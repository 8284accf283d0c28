"""The ASGI entry point daphne serves.

Two Django handlers share one URLconf. The site (admin, static files, dashboard, metrics) goes
through Django's own handler and the full middleware stack. Proxied requests go through
`GatewayHandler` (crossbar_site/handler.py): no middleware, no per-request thread, no signals.
"""

from __future__ import annotations

import asyncio
import os
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
from routing.ops.dashboard import DashboardConsumer  # noqa: E402
from routing.runtime import STOPPING, close_runtime  # noqa: E402

# First path segments served by the site; everything else is the gateway's.
SITE_PREFIXES = ("/admin", "/static/", "/dashboard", "/metrics", "/favicon.ico")


gateway_app = GatewayHandler()
# The admin's CSS and JavaScript, served from the apps' static folders (no collectstatic, no
# extra server): only the admin uses them, so their speed does not matter.
site_with_static = ASGIStaticFilesHandler(site_app)


_in_flight: set[asyncio.Task[None]] = set()  # HTTP requests being served, for a clean shutdown


def _names_a_route(scope: dict[str, Any]) -> bool:
    """Whether the request carries `X-Crossbar-Route`: then `/metrics` is the host's."""
    return any(name == b"x-crossbar-route" for name, _ in scope["headers"])


async def http_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    path: str = scope["path"]
    site = path.startswith(SITE_PREFIXES) and not (
        path == "/metrics" and _names_a_route(scope)
    )
    app = site_with_static if site else gateway_app
    task = asyncio.current_task()
    _in_flight.add(task)  # type: ignore[arg-type]  # a server runs each request as a Task
    try:
        await app(scope, receive, send)
    finally:
        _in_flight.discard(task)  # type: ignore[arg-type]  # a server runs each request as a Task


async def lifespan(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Startup and shutdown under servers that send them (uvicorn with `--lifespan on`).

    uvicorn ends the process by re-raising SIGTERM after its graceful stop, so `atexit` (where
    the recorder writes its last rows) never runs: write them here, once the requests are done.
    """
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            STOPPING.set()
            # uvicorn has cancelled the requests still running past its grace: let them record
            # their 499 rows before the recorder stops.
            if _in_flight:
                await asyncio.wait(set(_in_flight), timeout=5)
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
