"""The HTTP answers the proxy sends: its own errors, and the host's response streamed through.

Every answer names the page's origin for the browser only as the route's CORS rule allows
(`routing.core.cors`): the preflight, the gateway's own errors, and the host's answers, whose
own `Access-Control-*` headers are dropped (a host's permissive CORS must not widen the rule).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

import httpx
from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.utils.cache import patch_vary_headers

from routing.core.cors import grant
from routing.core.errors import Answer
from routing.proxy.record import Trail, said
from routing.proxy.relay import Relay

METHODS = ("GET", "HEAD", "POST", "DELETE", "OPTIONS")  # llama-server's; the rest is 405
_PREFLIGHT_METHODS = "GET, POST, DELETE, OPTIONS"

_RESPONSE_DROP = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "upgrade", "trailer", "proxy-authenticate"}
)
# An SSE stream may end with an error event of the gateway's own after the host's bytes (the
# host broke off): a length declared for the host's bytes would send that event past it, where
# the client reads the next answer on its connection. Sent without one, it goes out chunked.
_STREAM_DROP = _RESPONSE_DROP | {"content-length"}
_HOST_CORS = "access-control-"  # the host's CORS headers: the route's rule replaces them


class Body(Protocol):
    """A response body that ends its request exactly once, also when it is never read."""

    def __aiter__(self) -> AsyncIterator[bytes]: ...
    def close(self) -> None: ...


class StreamedResponse(StreamingHttpResponse):
    """A streamed proxy response. `close()` ends the body's request if the body did not run to
    its end (the client left, or the response was never sent); the gateway's handler calls it
    after every response, so no finalizer is needed. Unlike Django's, it sends no
    `request_finished` signal: the proxy path has no per-request database connection.

    `source` is the body itself, whose chunks are bytes: the gateway's handler sends them as
    they are (crossbar_site/handler.py), not through Django's `streaming_content` wrappers."""

    def __init__(self, body: Body, status: int = 200) -> None:
        super().__init__(body, status=status)
        self.source = body

    def close(self) -> None:
        self.source.close()
        self.closed = True


def preflight_response(request: HttpRequest, origins: frozenset[str]) -> HttpResponse:
    """A CORS preflight for a route the view has resolved: 200, with the methods and the
    headers the page asked for when the route's rule allows its origin, and no
    `Access-Control-*` header at all when it does not."""
    response = HttpResponse(status=200)
    if allow_origin(response, origins, request.headers.get("Origin")):
        response["Access-Control-Allow-Methods"] = _PREFLIGHT_METHODS
        # Echoed rather than `*`: a `*` covers neither Authorization nor, with credentials,
        # any header at all (Fetch standard, CORS protocol).
        asked = request.headers.get("Access-Control-Request-Headers")
        if asked:
            response["Access-Control-Allow-Headers"] = asked
            patch_vary_headers(response, ("Access-Control-Request-Headers",))
    return response


def error_response(
    answer: Answer, trail: Trail, origin: str | None, origins: frozenset[str] = frozenset()
) -> HttpResponse:
    """The gateway's own answer for a failure, in OpenAI's error shape; a page at `origin` may
    read it as the route's CORS rule allows (the default rule before a route is known)."""
    response = JsonResponse(answer.body(), status=answer.status)
    allow_origin(response, origins, origin)
    if answer.retry_after is not None:
        response["Retry-After"] = str(answer.retry_after)
    if answer.status == 401:
        response["WWW-Authenticate"] = 'Bearer realm="crossbar"'
    if answer.status == 405:
        response["Allow"] = ", ".join(METHODS)
    if trail.host:
        response["X-Crossbar-Host"] = trail.host
    return response


def streamed(
    upstream: httpx.Response, trail: Trail, relay: Relay, origins: frozenset[str]
) -> StreamedResponse:
    """The host's response: its status and headers (hop-by-hop and CORS ones dropped, and the
    length of an SSE stream, which the relay may extend), our headers (from the request's
    `trail`), and CORS headers by the route's rule for the origin the client sent."""
    response = StreamedResponse(relay, status=upstream.status_code)
    del response["Content-Type"]
    drop = _STREAM_DROP if relay.streamed else _RESPONSE_DROP
    for name, value in upstream.headers.multi_items():
        lowered = name.lower()
        if lowered not in drop and not lowered.startswith(_HOST_CORS):
            response.headers[name] = value
    # The Origin the host was asked with is the client's own (it is forwarded unchanged).
    allow_origin(response, origins, upstream.request.headers.get("Origin"))
    set_placement_headers(response, trail)
    response["X-Crossbar-Queued-Ms"] = str(trail.queued_ms)
    return response


def allow_origin(
    response: HttpResponse | StreamingHttpResponse, origins: frozenset[str], origin: str | None
) -> bool:
    """Name `origin` on `response` (with credentials when the route lists it) if the CORS
    rule of a route listing `origins` allows it; True when it does. Before a route is known,
    no origins are listed (the default rule)."""
    if not origin:
        return False
    patch_vary_headers(response, ("Origin",))  # the answer depends on it: caches must know
    allowed = grant(origins, origin)
    if allowed is None:
        return False
    response["Access-Control-Allow-Origin"] = allowed.origin
    if allowed.credentials:
        response["Access-Control-Allow-Credentials"] = "true"
    return True


def set_placement_headers(response: HttpResponse | StreamingHttpResponse, trail: Trail) -> None:
    """Where the request went and why: `X-Crossbar-Host`, `-Lease`, `-Placement`, `-Fallback`,
    and `-Patience` when priced patience priced its wait (`spill stay_ms=5200 spill_ms=800`)."""
    response["X-Crossbar-Host"] = trail.host
    response["X-Crossbar-Placement"] = trail.placement
    if trail.patience is not None:
        response["X-Crossbar-Patience"] = said(trail.patience)
    if trail.lease:
        response["X-Crossbar-Lease"] = trail.lease
    if trail.fallback:
        response["X-Crossbar-Fallback"] = trail.fallback
