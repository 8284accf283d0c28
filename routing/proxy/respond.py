"""The HTTP answers the proxy sends: its own errors, and the host's response streamed through."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse

from routing.core.errors import Answer
from routing.proxy.passage import Answered
from routing.proxy.record import Trail

METHODS = ("GET", "HEAD", "POST", "OPTIONS")  # what llama-server takes; the rest is 405
# What llama-server answers to a CORS preflight, so browser clients (its own web UI among them)
# can use a route; the origin is echoed.
_PREFLIGHT = (
    ("Access-Control-Allow-Credentials", "true"),
    ("Access-Control-Allow-Methods", "GET, POST, DELETE, OPTIONS"),
    ("Access-Control-Allow-Headers", "*"),
)

_RESPONSE_DROP = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "upgrade", "trailer", "proxy-authenticate"}
)


class Body(Protocol):
    """A response body that ends its request exactly once, also when it is never read."""

    def __aiter__(self) -> AsyncIterator[bytes]: ...
    def close(self) -> None: ...


class StreamedResponse(StreamingHttpResponse):
    """A streamed proxy response. `close()` ends the body's request if the body did not run to
    its end (the client left, or the response was never sent); the gateway's handler calls it
    after every response, so no finalizer is needed. Unlike Django's, it sends no
    `request_finished` signal: the proxy path has no per-request database connection."""

    def __init__(self, body: Body, status: int = 200) -> None:
        super().__init__(body, status=status)
        self._body = body

    def close(self) -> None:
        self._body.close()
        self.closed = True


def preflight_response(request: HttpRequest) -> HttpResponse:
    """A CORS preflight, answered as llama-server answers it."""
    response = HttpResponse(status=200)
    response["Access-Control-Allow-Origin"] = request.headers.get("Origin", "")
    for name, value in _PREFLIGHT:
        response[name] = value
    return response


def error_response(answer: Answer, trail: Trail, origin: str | None = None) -> HttpResponse:
    """The gateway's own answer for a failure, in OpenAI's error shape; a browser client may
    read it (its origin is echoed, as llama-server does)."""
    response = JsonResponse(answer.body(), status=answer.status)
    if origin is not None:
        response["Access-Control-Allow-Origin"] = origin
    if answer.retry_after is not None:
        response["Retry-After"] = str(answer.retry_after)
    if answer.status == 401:
        response["WWW-Authenticate"] = 'Bearer realm="crossbar"'
    if answer.status == 405:
        response["Allow"] = ", ".join(METHODS)
    if trail.host:
        response["X-Crossbar-Host"] = trail.host
    return response


def streamed(answered: Answered, body: Body) -> StreamedResponse:
    """The host's response: its status and headers (hop-by-hop ones dropped), our headers."""
    upstream = answered.upstream
    response = StreamedResponse(body, status=upstream.status_code)
    del response["Content-Type"]
    for name, value in upstream.headers.multi_items():
        if name.lower() not in _RESPONSE_DROP:
            response.headers[name] = value
    set_placement_headers(response, answered.trail)
    response["X-Crossbar-Queued-Ms"] = str(answered.trail.queued_ms)
    return response


def set_placement_headers(response: HttpResponse | StreamingHttpResponse, trail: Trail) -> None:
    """Where the request went and why: `X-Crossbar-Host`, `-Lease`, `-Placement`, `-Fallback`."""
    response["X-Crossbar-Host"] = trail.host
    response["X-Crossbar-Placement"] = trail.placement
    if trail.lease:
        response["X-Crossbar-Lease"] = trail.lease
    if trail.fallback:
        response["X-Crossbar-Fallback"] = trail.fallback
