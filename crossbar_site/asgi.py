"""The ASGI entry point daphne serves.

Two Django handlers share one URLconf. The site (admin, static files, dashboard, metrics) goes
through Django's own handler and the full middleware stack. Proxied requests go through
`GatewayHandler` (crossbar_site/handler.py): no middleware, no per-request thread, no signals.
"""

from __future__ import annotations

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "crossbar_site.settings")
site_app = get_asgi_application()

# Imports that need Django set up first.
from channels.auth import AuthMiddlewareStack  # noqa: E402
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from channels.security.websocket import AllowedHostsOriginValidator  # noqa: E402
from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler  # noqa: E402
from django.urls import path  # noqa: E402

from crossbar_site.handler import GatewayHandler  # noqa: E402
from routing.dashboard import DashboardConsumer  # noqa: E402

# First path segments served by the site; everything else is the gateway's.
SITE_PREFIXES = ("/admin", "/static/", "/dashboard", "/metrics", "/api/")


gateway_app = GatewayHandler()
# The admin's CSS and JavaScript, served from the apps' static folders (no collectstatic, no
# extra server): only the admin uses them, so their speed does not matter.
site_with_static = ASGIStaticFilesHandler(site_app)


async def http_app(scope, receive, send) -> None:  # type: ignore[no-untyped-def]
    path: str = scope["path"]
    app = site_with_static if path.startswith(SITE_PREFIXES) else gateway_app
    await app(scope, receive, send)


application = ProtocolTypeRouter(
    {
        "http": http_app,
        # The live dashboard: session-authenticated, and only from pages of an allowed host
        # (a cookie-authenticated socket must not be opened by another site's script).
        "websocket": AllowedHostsOriginValidator(
            AuthMiddlewareStack(URLRouter([path("dashboard/ws/", DashboardConsumer.as_asgi())]))
        ),
    }
)
