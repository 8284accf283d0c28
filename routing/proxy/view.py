"""The proxy view: route, peek, lease, slot, forward, tee, record, log.

The life of one request is DESIGN.md's "One request, start to finish". In short: the route
comes from the path or `X-Crossbar-Route`; the body gives the model and the conversation's
fingerprint; the lease table picks the host that holds the conversation's cache; the limiter
holds the request until that host has a slot for the model (`placement`); the host is asked
(`upstream`) and its response streams back through a `Relay`, chunk for chunk, while the tee
reads token counts; an `Exchange` writes exactly one accounting row and one log line when the
request ends, however it ends.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import AsyncIterator

import httpx
from django.core.exceptions import RequestDataTooBig
from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.http.request import RawPostDataException
from django.views.decorators.csrf import csrf_exempt

from routing.config.shape import Fleet, RouteConfig
from routing.core import sse
from routing.core.errors import (
    Answer,
    BadBody,
    BodyTooLarge,
    ConflictingRoute,
    GatewayError,
    MethodNotAllowed,
    MissingRoute,
    NotFound,
    UnknownModel,
    UnknownRoute,
    answer_for,
)
from routing.core.fingerprint import fingerprint
from routing.core.leases import NoHealthyHost
from routing.core.placement import TICK, Placement, Placer
from routing.proxy.exchange import Exchange
from routing.proxy.relay import Relay
from routing.proxy.upstream import Ask, forward
from routing.runtime import Runtime, get_runtime

log = logging.getLogger("crossbar.proxy")

MAX_BODY = 16 * 1024 * 1024
MAX_MODEL_NAME = 200  # HostModel.name and Request.model hold this much
ROUTE_HEADER = "X-Crossbar-Route"
SESSION_HEADER = "X-Crossbar-Session"
WAIT_STATUS_HEADER = "X-Crossbar-Wait-Status"

_RESPONSE_DROP = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "upgrade", "trailer", "proxy-authenticate"}
)
_ROUTE_NAME = re.compile(r"[-a-zA-Z0-9_]{1,64}")
# Upstream paths: /v1/... made of plain segments (no "", "." or ".." segments), /health, /props.
_UPSTREAM_PATH = re.compile(r"/v1(/[A-Za-z0-9_~:@!$&'()*+,;=-][A-Za-z0-9._~:@!$&'()*+,;=-]*)+")
_LOCAL_METHODS = frozenset({"GET", "HEAD"})
_METHODS = ("GET", "HEAD", "POST")  # what llama-server's endpoints take; the rest is 405


def error_response(exc: Exception, exchange: Exchange) -> HttpResponse:
    """The OpenAI-shaped answer for a failure; finishes the exchange with it."""
    answer = answer_for(exc)
    response = JsonResponse(answer.body(), status=answer.status)
    if answer.retry_after is not None:
        response["Retry-After"] = str(answer.retry_after)
    if answer.status == 401:
        response["WWW-Authenticate"] = 'Bearer realm="crossbar"'
    if answer.status == 405:
        response["Allow"] = ", ".join(_METHODS)
    if exchange.host:
        response["X-Crossbar-Host"] = exchange.host
    exchange.finish(answer.status, answer.message, code=answer.code)
    return response


def resolve_route(request: HttpRequest, fleet: Fleet) -> tuple[RouteConfig, str]:
    """The route and the upstream path.

    Raises MissingRoute, ConflictingRoute, UnknownRoute or NotFound.
    """
    path = request.path
    if b"%2f" in getattr(request, "scope", {}).get("raw_path", b"").lower():
        # The path is matched decoded: an encoded slash would be a second way to spell it.
        raise NotFound("not found: the path contains an encoded slash (%2F)")
    header = request.headers.get(ROUTE_HEADER, "").strip()
    first, _, remainder = path[1:].partition("/")
    if header:
        name = header
        rest = path
        if first in fleet.routes:
            if first != header:
                raise ConflictingRoute(
                    f"conflicting route: the path names “{first}”, {ROUTE_HEADER} “{header[:64]}”"
                )
            rest = "/" + remainder
    else:
        if not first or first == "v1":
            raise MissingRoute(
                f"missing route: use /<route>/v1/... or set the {ROUTE_HEADER} header"
            )
        name, rest = first, "/" + remainder
    route = fleet.routes.get(name) if _ROUTE_NAME.fullmatch(name) else None
    if route is None:
        raise UnknownRoute(f"unknown route: “{name[:64]}”")
    if not route.enabled:
        raise UnknownRoute(f"unknown route: “{name}” is disabled")
    if rest not in ("/health", "/props") and not _UPSTREAM_PATH.fullmatch(rest):
        raise NotFound(f"not found: {rest[:200]}")
    return route, rest


def _read_body(request: HttpRequest) -> bytes:
    try:
        body = request.body
    except (RequestDataTooBig, RawPostDataException):
        raise BodyTooLarge(f"request body over {MAX_BODY} bytes") from None
    if len(body) > MAX_BODY:
        raise BodyTooLarge(f"request body over {MAX_BODY} bytes")
    return body


def _parse_payload(body: bytes) -> dict[str, object]:
    if not body:
        raise BadBody("request body is empty: expected a JSON object with a model")
    try:
        payload = json.loads(body.decode())
    except UnicodeDecodeError:
        raise BadBody("request body is not valid UTF-8") from None
    except ValueError as exc:
        raise BadBody(f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise BadBody("request body is not valid JSON: nested too deeply") from None
    if not isinstance(payload, dict):
        raise BadBody(f"request body must be a JSON object, not {type(payload).__name__}")
    return payload


def _model_of(payload: dict[str, object], route: RouteConfig) -> str:
    model = payload.get("model")
    if model is None or model == "":
        if not route.default_model:
            raise BadBody(
                f"missing model: the body names none and route “{route.name}” has no default"
            )
        return route.default_model
    if not isinstance(model, str):
        raise BadBody("model must be a string")
    if len(model) > MAX_MODEL_NAME:
        raise BadBody(f"model name longer than {MAX_MODEL_NAME} characters")
    return model


async def gateway_health() -> JsonResponse:
    """`/health`: the gateway itself is up (for load balancers; no row, no log line).

    `revision` is the configuration stamp this process serves, so a deploy script (or a test)
    can tell when an edit has been picked up.
    """
    runtime = await get_runtime()
    await runtime.refresh()
    return JsonResponse({"status": "ok", "revision": runtime.fleet.revision})


def models_response(runtime: Runtime, route: RouteConfig) -> JsonResponse:
    """`/<route>/v1/models`: what the route serves, in OpenAI's list shape."""
    data = [
        {"id": name, "object": "model", "created": 0, "owned_by": "crossbar"}
        for name in runtime.fleet.route_models(route)
    ]
    return JsonResponse({"object": "list", "data": data})


@csrf_exempt
async def proxy(request: HttpRequest) -> HttpResponse | StreamingHttpResponse:
    """Serve one client request through the fleet. Every outcome finishes the exchange."""
    if request.path == "/health" and ROUTE_HEADER not in request.headers:
        return await gateway_health()
    exchange = Exchange()
    try:
        return await _serve(request, exchange)
    except asyncio.CancelledError:
        exchange.finish(499, "client disconnected before the response")
        raise
    except Exception as exc:
        if answer_for(exc).status == 500:
            log.exception("unexpected error serving %s", request.path[:200])
        return error_response(exc, exchange)


async def _serve(request: HttpRequest, exchange: Exchange) -> HttpResponse | StreamingHttpResponse:
    runtime = await get_runtime()
    await runtime.refresh()
    route, rest = resolve_route(request, runtime.fleet)
    exchange.route = route.name
    client = runtime.clients.identify(request.headers.get("Authorization"))
    if client is not None:
        exchange.client = client.name
        exchange.client_pass = runtime.clients.admit(client, route.name)
    method = request.method or "GET"
    if method not in _METHODS:
        raise MethodNotAllowed(f"method {method[:20]} not allowed: use {', '.join(_METHODS)}")

    if rest == "/v1/models" and method in _LOCAL_METHODS:
        exchange.finish(200)
        return models_response(runtime, route)

    body = b""
    model: str | None = None
    payload: dict[str, object] | None = None
    if method not in _LOCAL_METHODS:
        body = _read_body(request)
        if rest.startswith("/v1/"):
            payload = _parse_payload(body)
            model = _model_of(payload, route)
            if not isinstance(payload.get("messages", []), list):
                raise BadBody("messages must be a list of message objects")
    exchange.model = model or ""
    exchange.track(runtime.running)
    ask = Ask(request, rest, body, payload)

    if model is None:
        # Requests without a model (/health, /props, GETs) take no lease and no slot.
        host = runtime.choose(route, None)
        if host is None:
            raise NoHealthyHost(route.name)
        exchange.host = host
        upstream = await forward(runtime, ask, None, host, exchange)
        return _client_response(upstream, Relay(upstream, None, exchange, runtime), exchange)

    if not runtime.serves(route, model):
        raise UnknownModel(f"model “{model}” is not served by route “{route.name}”")
    exchange.fingerprint = fingerprint(method, payload, request.headers.get(SESSION_HEADER))
    placer = Placer(runtime, route, model, exchange.fingerprint)
    placement = await placer.now()
    if placement is None:
        exchange.host, exchange.lease = placer.host, placer.lease
        if _wants_wait_status(request, route, payload):
            return _waiting_response(runtime, ask, placer, exchange)
        placement = await placer.wait()
    exchange.placed(placement)
    try:
        upstream = await forward(runtime, ask, placement.model, placement.host, exchange)
    except BaseException:
        placement.slot.release()
        raise
    relay = Relay(upstream, placement.slot, exchange, runtime)
    return _client_response(upstream, relay, exchange)


def _wants_wait_status(
    request: HttpRequest, route: RouteConfig, payload: dict[str, object] | None
) -> bool:
    """Whether a request that must queue gets its head at once and status comments.

    Only streaming requests can: the comments ride in the SSE stream. The route decides, and a
    client may override it either way with the header.
    """
    if payload is None or payload.get("stream") is not True:
        return False
    override = request.headers.get(WAIT_STATUS_HEADER, "").strip().lower()
    if override in ("on", "true", "1", "yes"):
        return True
    if override in ("off", "false", "0", "no"):
        return False
    return route.wait_status


def _waiting_response(
    runtime: Runtime, ask: Ask, placer: Placer, exchange: Exchange
) -> StreamingHttpResponse:
    """The response head now; status comments while the request waits; then the stream."""
    exchange.streamed = True
    response = StreamingHttpResponse(
        _wait_then_stream(runtime, ask, placer, exchange),
        content_type="text/event-stream",
    )
    response["Cache-Control"] = "no-cache"
    response["X-Crossbar-Host"] = exchange.host
    if exchange.lease:
        response["X-Crossbar-Lease"] = exchange.lease
    return response


async def _wait_then_stream(
    runtime: Runtime, ask: Ask, placer: Placer, exchange: Exchange
) -> AsyncIterator[bytes]:
    """The body of a waiting response. The head is out: failures become one error event."""
    loop = asyncio.get_running_loop()
    waiting = asyncio.ensure_future(placer.wait())
    placement: Placement | None = None
    try:
        # The place in line is known once the wait has queued, a few loop turns from now.
        queued = asyncio.ensure_future(placer.queued())
        await asyncio.wait((waiting, queued), timeout=TICK, return_when=asyncio.FIRST_COMPLETED)
        queued.cancel()
        position = placer.position
        yield sse.comment(f"waiting {position}")
        said_at = loop.time()
        while not waiting.done():
            await asyncio.wait((waiting,), timeout=TICK)
            now = loop.time()
            if not waiting.done() and (
                placer.position != position or now - said_at >= runtime.keepalive
            ):
                position = placer.position
                yield sse.comment(f"waiting {position}")
                said_at = now
        placement = waiting.result()
    except Exception as exc:
        answer = answer_for(exc)
        exchange.finish(answer.status, answer.message, code=answer.code)
        yield sse.error_event(answer)
        return
    finally:
        if placement is None:
            # The client left while queued, possibly in the very instant its slot came.
            if waiting.done():
                _release_placement(waiting)
            else:
                waiting.cancel()
                waiting.add_done_callback(_release_placement)
            exchange.finish(499, "client disconnected while queued")

    exchange.placed(placement)
    try:
        if placement.fallback:
            yield sse.comment(f"fallback {placement.fallback}")
        yield sse.comment("running")
        upstream = await forward(runtime, ask, placement.model, placement.host, exchange)
    except GatewayError as exc:
        placement.slot.release()
        answer = answer_for(exc)
        exchange.finish(answer.status, answer.message, code=answer.code)
        yield sse.error_event(answer)
        return
    except BaseException:
        placement.slot.release()
        raise
    relay = Relay(upstream, placement.slot, exchange, runtime)
    if upstream.status_code != 200:
        # The client already has a 200 head: the host's error goes out as an error event.
        message = await relay.error_message()
        answer = Answer(upstream.status_code, message, "server_error", "upstream_error")
        yield sse.error_event(answer)
        return
    async for chunk in relay:
        yield chunk


def _release_placement(waiting: asyncio.Future[Placement]) -> None:
    if not waiting.cancelled() and waiting.exception() is None:
        waiting.result().slot.release()


def _client_response(
    upstream: httpx.Response, relay: Relay, exchange: Exchange
) -> StreamingHttpResponse:
    response = StreamingHttpResponse(relay, status=upstream.status_code)
    del response["Content-Type"]
    for name, value in upstream.headers.multi_items():
        if name.lower() not in _RESPONSE_DROP:
            response.headers[name] = value
    response["X-Crossbar-Host"] = exchange.host
    if exchange.lease:
        response["X-Crossbar-Lease"] = exchange.lease
    if exchange.fallback:
        response["X-Crossbar-Fallback"] = exchange.fallback
    response["X-Crossbar-Queued-Ms"] = str(exchange.queued_ms)
    return response
