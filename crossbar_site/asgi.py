"""The ASGI entry point daphne serves.

Two Django handlers share one URLconf. The site (admin, static files) goes through the full
middleware stack. Proxied requests go through a handler with no middleware at all: every
built-in middleware is a `MiddlewareMixin`, which under ASGI costs a hop to a worker thread per
request and per response; the proxy view needs none of them (no sessions, no CSRF, no auth).
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
from django.conf import settings  # noqa: E402
from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler  # noqa: E402
from django.core.handlers.asgi import ASGIHandler  # noqa: E402
from django.core.handlers.exception import convert_exception_to_response  # noqa: E402
from django.urls import path, set_urlconf  # noqa: E402

from routing.dashboard import DashboardConsumer  # noqa: E402

# First path segments served by the site; everything else is the gateway's.
SITE_PREFIXES = ("/admin", "/static/", "/dashboard", "/metrics", "/api/")


class GatewayHandler(ASGIHandler):
    """Django's ASGI handler with an empty middleware chain, for the proxy view."""

    def load_middleware(self, is_async: bool = False) -> None:
        self._view_middleware = []
        self._template_response_middleware = []
        self._exception_middleware = []
        get_response = self._get_response_async if is_async else self._get_response
        self._middleware_chain = convert_exception_to_response(get_response)

    async def get_response_async(self, request):  # type: ignore[no-untyped-def]
        # Django's version also logs every 4xx/5xx answer through a worker thread; the proxy
        # logs one line per request itself, so that would be a second line and a thread hop.
        set_urlconf(settings.ROOT_URLCONF)
        response = await self._middleware_chain(request)
        response._resource_closers.append(request.close)
        return response


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
