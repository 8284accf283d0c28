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

It also reads a request's body only up to `BODY_CAP`, and lets the graceful stop cut the
requests it serves (crossbar_site/lifecycle.py).
"""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, cast

from django.conf import settings
from django.core.exceptions import RequestAborted
from django.core.handlers.asgi import ASGIHandler, get_script_prefix
from django.core.handlers.exception import convert_exception_to_response
from django.http import HttpRequest, HttpResponse, HttpResponseBase
from django.urls import set_script_prefix, set_urlconf

from crossbar_site.lifecycle import REQUESTS
from routing.proxy.respond import StreamedResponse

Send = Callable[[Mapping[str, Any]], Awaitable[None]]

# One byte more than the proxy accepts, so that it can tell "too large" from "exactly the limit".
BODY_CAP = settings.DATA_UPLOAD_MAX_MEMORY_SIZE + 1


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

    async def read_capped_body(
        self, scope: dict[str, Any], receive: Any
    ) -> tuple[tempfile.SpooledTemporaryFile[bytes], bool]:
        """The request's body as Django's `read_body` reads it, but no more than `BODY_CAP`
        bytes, and whether some of it is left unread: reading stops at the cap, so that the
        proxy answers 413 at once (with its row). A body whose declared length is over the
        limit is not read at all (`request.body` refuses it by its Content-Length).

        Raises RequestAborted when the client leaves first."""
        body_file = tempfile.SpooledTemporaryFile(
            max_size=settings.FILE_UPLOAD_MAX_MEMORY_SIZE, mode="w+b"
        )
        kept = 0
        if _declared_length(scope) >= BODY_CAP:
            return body_file, True
        more = True
        while more and kept < BODY_CAP:
            message = await receive()
            if message["type"] == "http.disconnect":
                body_file.close()
                raise RequestAborted()
            chunk = message.get("body", b"")
            body_file.write(chunk[: BODY_CAP - kept])  # the whole chunk, but past the cap
            kept += len(chunk)
            more = message.get("more_body", False)
        body_file.seek(0)
        return body_file, more

    async def listen_for_disconnect(
        self, receive: Any, rest_read: asyncio.Event | None = None
    ) -> None:
        """Raise RequestAborted once the client leaves. The body that `read_capped_body` left
        unread is read and dropped meanwhile (Django's asserts there is none), and `rest_read`
        set at its end."""
        while (message := await receive())["type"] != "http.disconnect":
            if rest_read is not None and not message.get("more_body", False):
                rest_read.set()
        raise RequestAborted()

    async def handle(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """Serve one request; Django's `handle` without the request signals.

        As in Django, a client that disconnects cancels the view (or the streaming of its
        response): the proxy turns that into a 499 row.
        """
        try:
            body_file, unread = await self.read_capped_body(scope, receive)
        except RequestAborted:
            return
        rest_read = asyncio.Event() if unread else None
        set_script_prefix(get_script_prefix(scope))
        request, error_response = self.create_request(scope, body_file)
        if request is None:
            assert error_response is not None, "create_request returns a request or a response"
            body_file.close()
            await self.send_response(error_response, send)
            return

        # The view runs in this task, not in one of its own as in Django's handler: a new task
        # starts only at the loop's next turn, and the first token would wait for that turn
        # behind every other stream's chunks (bench/README.md, "Where the first token waits").
        # The watch cancels this task when the client leaves, as Django cancels its view's.
        serving = asyncio.current_task()
        assert serving is not None, "an ASGI application runs in a task"
        ended = False

        def end() -> None:
            if not ended:
                serving.cancel()

        watch = asyncio.create_task(self.listen_for_disconnect(receive, rest_read))
        watch.add_done_callback(_unless_cancelled(end))
        forget = REQUESTS.cuttable(end)  # the graceful stop ends it as a client that left
        try:
            await self._serve(request, send, rest_read)
        except asyncio.CancelledError:
            # The client left, the stop cut the request, or the proxy cut a client too slow
            # (routing/proxy/relay.py): the request has ended as a client that left (its row
            # says so), and so does this handler, as Django's does.
            while serving.uncancel():
                pass
        finally:
            ended = True
            forget()
            watch.cancel()
            body_file.close()

    async def _serve(
        self, request: HttpRequest, send: Send, rest_read: asyncio.Event | None
    ) -> None:
        """The view's answer to `request`, sent (the rest of an unread body read first)."""
        response = await self.get_response_async(request)
        if isinstance(response, HttpResponse) and not response.has_header("Content-Length"):
            # Said, so that a client can read the whole answer before the request's end.
            response["Content-Length"] = str(len(response.content))
        sending = send if rest_read is None else _answer_before_the_rest(send, rest_read)
        try:
            if isinstance(response, StreamedResponse):
                await _send_streamed(response, sending)
            else:
                await self.send_response(response, sending)
        finally:
            if isinstance(response, StreamedResponse):
                # Ends the request if its body did not run to its end (no finalizer).
                response.close()

    async def get_response_async(self, request: HttpRequest) -> HttpResponseBase:
        # Django's version also logs every 4xx/5xx answer through a worker thread; the proxy
        # logs one line per request itself, so that would be a second line and a thread hop.
        set_urlconf(settings.ROOT_URLCONF)
        # ASGIHandler loads its middleware with is_async=True, so the chain returns awaitables.
        return await cast(Awaitable[HttpResponseBase], self._middleware_chain(request))


def _unless_cancelled(end: Callable[[], None]) -> Callable[[asyncio.Task[None]], None]:
    """A done callback for the disconnect watch: `end()` once it has heard the client leave
    (RequestAborted), not when the handler cancelled it."""

    def done(watch: asyncio.Task[None]) -> None:
        if not watch.cancelled():
            watch.exception()  # retrieved: RequestAborted, or the server's receive failing
            end()

    return done


async def _send_streamed(response: StreamedResponse, send: Send) -> None:
    """Send a proxied stream: its head at once, then each chunk of its body as it comes.

    What Django's `send_response` sends for a streaming response, less its per-chunk layers
    (two async generators and a generator around every chunk: `bench/README.md`, "Where the
    first token waits"). The head goes out before the first chunk (an empty body message: daphne
    writes a head only with body bytes), so a client sees the host's head as soon as the host
    sent it (a long prefill, a quiet stream), not with the first token.
    """
    headers = [(name.encode("ascii"), value.encode("latin-1")) for name, value in response.items()]
    await send({"type": "http.response.start", "status": response.status_code, "headers": headers})
    await send({"type": "http.response.body", "body": b"", "more_body": True})
    async for chunk in response.source:
        await send({"type": "http.response.body", "body": chunk, "more_body": True})
    await send({"type": "http.response.body", "body": b""})


def _answer_before_the_rest(send: Send, rest_read: asyncio.Event) -> Send:
    """`send` for the answer to a request whose body was left unread: every byte of it goes out
    at once, but the response ends only once the client has sent the rest (`rest_read`), which
    the server reads and drops meanwhile. Ending it at once would let a server that closes the
    connection after the response (the client asked `Connection: close`) close it with the
    client's bytes unread, which resets the connection, and the client may never see its 413."""

    async def sending(message: Mapping[str, Any]) -> None:
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            await send({**message, "more_body": True})
            await rest_read.wait()
            message = {"type": "http.response.body", "body": b""}
        await send(message)

    return sending


def _declared_length(scope: dict[str, Any]) -> int:
    """The body length the request's Content-Length declares; 0 without one (or a bad one:
    the server has refused those already)."""
    for name, value in scope["headers"]:
        if name == b"content-length":
            return int(value) if value.isdigit() else 0
    return 0
