"""The ASGI handler for proxied requests: Django's, minus what a proxy does not need.

Django's `ASGIHandler` is built for views that use the ORM and middleware. For every request
it runs the middleware chain (each built-in `MiddlewareMixin` hops to a worker thread), opens a
`ThreadSensitiveContext` (a new one-thread executor per request, alive as long as the stream),
and sends `request_started` / `request_finished`, whose receivers (`close_old_connections`,
`reset_queries`) are sync and so run through `sync_to_async`: two more thread hops. Measured
with `make bench`: about 0.4 ms of CPU and two threads per request (650 threads at 512
streams). The proxy view touches the database only through its own `sync_to_async` calls, which
close stale connections themselves, so this handler skips all of that and keeps the rest of
Django's request handling: the URLconf, the view, the disconnect watch, `send_response`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, cast

from django.conf import settings
from django.core.exceptions import RequestAborted
from django.core.handlers.asgi import ASGIHandler, get_script_prefix
from django.core.handlers.exception import convert_exception_to_response
from django.http import HttpRequest, HttpResponseBase
from django.urls import set_script_prefix, set_urlconf

from routing.proxy.respond import StreamedResponse


class GatewayHandler(ASGIHandler):
    """Django's ASGI handler with no middleware, no per-request thread and no signals."""

    def load_middleware(self, is_async: bool = False) -> None:
        self._view_middleware: list[Callable[..., Any]] = []
        self._template_response_middleware: list[Callable[..., Any]] = []
        self._exception_middleware: list[Callable[..., Any]] = []
        get_response = (
            self._get_response_async  # type: ignore[attr-defined]  # django-stubs omits BaseHandler's private methods
            if is_async
            else self._get_response  # type: ignore[attr-defined]  # django-stubs omits BaseHandler's private methods
        )
        self._middleware_chain = convert_exception_to_response(get_response)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            raise ValueError(f"the gateway handler serves HTTP, not {scope['type']}")
        await self.handle(scope, receive, send)

    async def handle(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """Serve one request; Django's `handle` without the request signals.

        As in Django, a client that disconnects cancels the view (or the streaming of its
        response): the proxy turns that into a 499 row.
        """
        try:
            body_file = await self.read_body(receive)
        except RequestAborted:
            return
        set_script_prefix(get_script_prefix(scope))
        request, error_response = self.create_request(scope, body_file)
        if request is None:
            assert error_response is not None, "create_request returns a request or a response"
            body_file.close()
            await self.send_response(error_response, send)
            return

        async def head_first(message: Mapping[str, Any]) -> None:
            await send(message)
            if message["type"] == "http.response.start":
                # daphne writes a head only with the first body bytes; an empty body message
                # sends it now, so a client sees the host's head as soon as the host sent it
                # (a long prefill, a quiet stream), not with the first token.
                await send({"type": "http.response.body", "body": b"", "more_body": True})

        async def process_request() -> None:
            response = await self.get_response_async(request)
            try:
                await self.send_response(response, head_first if response.streaming else send)
            except asyncio.CancelledError:
                pass  # the client left while the response was being sent
            finally:
                if isinstance(response, StreamedResponse):
                    # Ends the request if its body did not run to its end (no finalizer).
                    response.close()

        watch = asyncio.create_task(self.listen_for_disconnect(receive))
        serve = asyncio.create_task(process_request())
        try:
            await asyncio.wait((watch, serve), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (watch, serve):
                if not task.done():
                    task.cancel()
                try:
                    await task
                except (asyncio.CancelledError, RequestAborted):
                    pass
            body_file.close()

    async def get_response_async(self, request: HttpRequest) -> HttpResponseBase:
        # Django's version also logs every 4xx/5xx answer through a worker thread; the proxy
        # logs one line per request itself, so that would be a second line and a thread hop.
        set_urlconf(settings.ROOT_URLCONF)
        # ASGIHandler loads its middleware with is_async=True, so the chain returns awaitables.
        return await cast(Awaitable[HttpResponseBase], self._middleware_chain(request))
