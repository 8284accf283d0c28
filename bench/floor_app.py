"""The floor under crossbar in `make bench`: a bare pass-through, as an ASGI application.

    FLOOR_UPSTREAM=http://127.0.0.1:9001 daphne -v 0 -p 8090 floor_app:application   # in bench/
    FLOOR_UPSTREAM=... daphne -v 0 -p 8090 floor_app:django_application   # the same, in Django

Each request goes to `FLOOR_UPSTREAM` + its path (less a first segment that is not `v1`, so
that crossbar's `/bench/v1/chat/completions` works here too) with the client crossbar uses:
one `httpx.AsyncClient` per event loop with routing/runtime.py's timeouts and limits, streaming
(`send(stream=True)`, `aiter_raw()`), the same headers dropped, and the same one retry when a
pooled connection turns out closed (llama-server closes it after every stream). The response
streams back chunk for chunk. No routing, no limiter, no lease, no accounting, no log line:
what is left is the server, the client library and the event loop, which is all a gateway in
this stack cannot avoid. `GET /health` is answered here, for readiness.

`FLOOR_TRANSPORT=aiohttp` swaps httpx's default transport (httpcore, on anyio) for the
`httpx-aiohttp` one, crossbar's default: the same `httpx.AsyncClient` API on aiohttp's
connection pool and parser (`aiohttp_client()`). bench/targets.py sets it for every floor but
`floor+httpcore`.

`django_application` is one rung up: the same pass-through as an async Django view returning a
`StreamingHttpResponse`, served by crossbar's own proxy handler (`crossbar_site/handler.py`:
the URLconf, `HttpRequest`, the disconnect watch, `send_response`), so that Django's share of
crossbar's cost can be told from crossbar's own.
"""

from __future__ import annotations

import asyncio
import os
import weakref
from collections.abc import AsyncIterator
from typing import Any

import httpx

UPSTREAM = os.environ.get("FLOOR_UPSTREAM", "").rstrip("/")
TRANSPORT = os.environ.get("FLOOR_TRANSPORT", "httpcore")
TRANSPORTS = ("httpcore", "aiohttp")

# routing/runtime.py's client settings and crossbar's defaults (CROSSBAR_CONNECT_TIMEOUT).
CONNECT_TIMEOUT = 3.0
TIMEOUT = httpx.Timeout(connect=CONNECT_TIMEOUT, read=None, write=60.0, pool=None)
LIMITS = httpx.Limits(max_connections=None, max_keepalive_connections=256)
# routing/proxy/upstream.py's and view.py's header filters, less the gateway's own headers.
REQUEST_DROP = frozenset(
    {
        "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
        "trailer", "transfer-encoding", "upgrade", "host", "content-length", "authorization",
        "cookie", "accept-encoding",
    }
)  # fmt: skip
RESPONSE_DROP = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "upgrade", "trailer", "proxy-authenticate"}
)

if TRANSPORT not in TRANSPORTS:
    raise SystemExit(f"FLOOR_TRANSPORT is one of {', '.join(TRANSPORTS)}, not {TRANSPORT!r}")


def aiohttp_client(**kwargs: Any) -> httpx.AsyncClient:
    """An httpx.AsyncClient on httpx-aiohttp's transport, with crossbar's limits.

    The transport's own pool would cap connections at aiohttp's default of 100 (it passes no
    limit when httpx's is None): its session is built here instead, unlimited. And without
    keep-alive (`force_close`): aiohttp hands a pooled connection to the next request without
    checking that the host has not closed it, and llama-server (like the fake) closes every
    connection right after a stream's last byte, so with keep-alive some requests write to a
    dead socket (`Can not write request body`, `Connection reset by peer`: 34 requests in one
    floor run, LiteLLM's HTTP 500s in bench/README.md). httpx-aiohttp maps those to
    `httpx.ConnectTimeout`, which crossbar's upstream.py takes for a host that is down. A
    stream's connection is closed by the host anyway, so this costs only the health polls'.
    """
    try:
        import aiohttp
        from httpx_aiohttp import AiohttpTransport
    except ImportError:
        raise SystemExit(
            "the aiohttp transport needs httpx-aiohttp: "
            ".venv/bin/pip install -r bench/requirements.txt"
        ) from None

    def session() -> aiohttp.ClientSession:
        connector = aiohttp.TCPConnector(limit=0, force_close=True)
        return aiohttp.ClientSession(connector=connector)

    kwargs.pop("limits", None)  # a given transport ignores them anyway
    return httpx.AsyncClient(transport=AiohttpTransport(client=session), **kwargs)


_clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, httpx.AsyncClient] = (
    weakref.WeakKeyDictionary()
)


def client() -> httpx.AsyncClient:
    """The running loop's client, made on first use (as crossbar's runtime makes its own)."""
    loop = asyncio.get_running_loop()
    found = _clients.get(loop)
    if found is None:
        settings: dict[str, Any] = {"timeout": TIMEOUT, "limits": LIMITS, "trust_env": False}
        make = aiohttp_client if TRANSPORT == "aiohttp" else httpx.AsyncClient
        found = make(**settings)
        _clients[loop] = found
    return found


def upstream_path(path: str) -> str:
    first, _, rest = path[1:].partition("/")
    return path if first == "v1" else "/" + rest


async def forward(
    method: str, path: str, query: bytes, headers: list[tuple[str, str]], body: bytes
) -> httpx.Response:
    """Ask the upstream; return at its response head. One retry on a stale pooled connection."""
    if not UPSTREAM:
        raise RuntimeError("FLOOR_UPSTREAM is not set: the upstream's base URL, without /v1")
    url = UPSTREAM + upstream_path(path) + (f"?{query.decode('latin-1')}" if query else "")
    sent = [(name, value) for name, value in headers if name.lower() not in REQUEST_DROP]
    sent.append(("Accept-Encoding", "identity"))
    http = client()
    request = http.build_request(method, url, headers=sent, content=body or None)
    try:
        return await http.send(request, stream=True)
    except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError):
        return await http.send(request, stream=True)


def response_headers(upstream: httpx.Response) -> list[tuple[str, str]]:
    return [
        (name, value)
        for name, value in upstream.headers.multi_items()
        if name.lower() not in RESPONSE_DROP
    ]


async def application(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """The bare pass-through (see the module's docstring)."""
    if scope["type"] == "lifespan":  # uvicorn and granian ask; nothing to start or stop
        while True:
            kind = (await receive())["type"].rpartition(".")[2]  # startup, then shutdown
            await send({"type": f"lifespan.{kind}.complete"})
            if kind == "shutdown":
                return
    if scope["type"] != "http":
        return
    if scope["path"] == "/health":
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json")]})  # fmt: skip
        await send({"type": "http.response.body", "body": b'{"status": "ok"}'})
        return
    body = b""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        body += message.get("body", b"")
        if not message.get("more_body", False):
            break
    headers = [(n.decode("latin-1"), v.decode("latin-1")) for n, v in scope["headers"]]
    upstream = await forward(scope["method"], scope["path"], scope["query_string"], headers, body)
    try:
        await send(
            {
                "type": "http.response.start",
                "status": upstream.status_code,
                "headers": [(n.encode("latin-1"), v.encode("latin-1"))
                            for n, v in response_headers(upstream)],
            }
        )  # fmt: skip
        async for chunk in upstream.aiter_raw():
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
    finally:
        await upstream.aclose()


# -- the same, one rung up: a Django view behind crossbar's proxy handler -------------------


async def passthrough(request: Any) -> Any:
    """The pass-through as an async Django view (no middleware: crossbar's handler has none)."""
    from django.http import StreamingHttpResponse

    headers = list(request.headers.items())
    query = request.META.get("QUERY_STRING", "").encode("latin-1")
    upstream = await forward(request.method, request.path, query, headers, request.body)

    async def body() -> AsyncIterator[bytes]:
        try:
            async for chunk in upstream.aiter_raw():
                yield chunk
        finally:
            await upstream.aclose()

    response = StreamingHttpResponse(body(), status=upstream.status_code)
    del response["Content-Type"]
    for name, value in response_headers(upstream):
        response.headers[name] = value
    return response


def _django_application() -> Any:
    """crossbar's proxy handler (crossbar_site/handler.py) routing every path to `passthrough`.

    Django is set up with crossbar's settings; only the URLconf is this module's.
    """
    import django

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "crossbar_site.settings")
    django.setup(set_prefix=False)
    from django.conf import settings
    from django.http import JsonResponse
    from django.urls import re_path

    try:
        from crossbar_site.handler import GatewayHandler
    except ImportError:
        raise SystemExit(
            "floor-django needs crossbar's proxy handler (crossbar_site/handler.py), which this "
            "source tree does not have"
        ) from None

    async def health(request: Any) -> Any:
        return JsonResponse({"status": "ok"})

    global urlpatterns
    urlpatterns = [re_path(r"^health$", health), re_path(r"^", passthrough)]
    settings.ROOT_URLCONF = __name__
    handler = GatewayHandler()

    async def served(scope: dict[str, Any], receive: Any, send: Any) -> None:
        # The handler serves HTTP only; uvicorn's lifespan is answered as the bare floor does.
        if scope["type"] == "lifespan":
            await application(scope, receive, send)
        else:
            await handler(scope, receive, send)

    return served


urlpatterns: list[Any] = []


def __getattr__(name: str) -> Any:
    # Built on first access, so that the bare `application` never imports Django.
    if name == "django_application":
        app = _django_application()
        globals()[name] = app
        return app
    raise AttributeError(name)
