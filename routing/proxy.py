"""The proxy view: route, peek, lease, slot, forward, tee, record, log.

The life of one request is DESIGN.md's "One request, start to finish". In short: the route
comes from the path or `X-Crossbar-Route`; the body gives the model and the conversation's
fingerprint; the lease table picks the host that holds the conversation's cache; the limiter
holds the request until that host has a slot for the model; the upstream response streams back
through `Relay`, chunk for chunk, while the tee reads token counts; an `Exchange` writes exactly
one accounting row and one log line when the request ends, however it ends.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import threading
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime

import httpx
from django.core.exceptions import RequestDataTooBig
from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.http.request import RawPostDataException
from django.views.decorators.csrf import csrf_exempt

from accounting.recorder import RequestRecord, get_recorder
from routing import metrics, sse
from routing.clients import ClientPass
from routing.errors import (
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
    UpstreamTimeout,
    UpstreamUnreachable,
    answer_for,
)
from routing.fingerprint import fingerprint
from routing.leases import NoHealthyHost
from routing.limiter import Slot
from routing.placement import TICK, Placement, Placer
from routing.runtime import Fleet, RouteConfig, Runtime, get_runtime
from routing.tee import Tee

log = logging.getLogger("crossbar.proxy")

MAX_BODY = 16 * 1024 * 1024
MAX_MODEL_NAME = 200  # HostModel.name and Request.model hold this much
ROUTE_HEADER = "X-Crossbar-Route"
SESSION_HEADER = "X-Crossbar-Session"
WAIT_STATUS_HEADER = "X-Crossbar-Wait-Status"

# Never forwarded upstream: hop-by-hop headers (RFC 9110 7.6.1), what httpx sets itself, the
# client's credentials (a host's own key replaces them), and the gateway's own headers.
# Accept-Encoding is replaced by identity so the tee can read token counts.
_REQUEST_DROP = frozenset(
    {
        "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
        "trailer", "transfer-encoding", "upgrade", "host", "content-length", "authorization",
        "cookie", "accept-encoding", "x-crossbar-route", "x-crossbar-session",
        "x-crossbar-wait-status",
    }
)  # fmt: skip
_RESPONSE_DROP = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "upgrade", "trailer", "proxy-authenticate"}
)
_ROUTE_NAME = re.compile(r"[-a-zA-Z0-9_]{1,64}")
# Upstream paths: /v1/... made of plain segments (no "", "." or ".." segments), /health, /props.
_UPSTREAM_PATH = re.compile(r"/v1(/[A-Za-z0-9_~:@!$&'()*+,;=-][A-Za-z0-9._~:@!$&'()*+,;=-]*)+")
_LOCAL_METHODS = frozenset({"GET", "HEAD"})
_METHODS = ("GET", "HEAD", "POST")  # what llama-server's endpoints take; the rest is 405


class Exchange:
    """The accounting of one request: exactly one row and one log line, however it ends.

    `finish` is idempotent and may be called from any thread (a response dropped by Django
    after a disconnect is finalized wherever its last reference goes); it only hands a row to
    the recorder, never touches the database.
    """

    __slots__ = (
        "route", "fingerprint", "model", "host", "lease", "fallback", "started", "t0",
        "queued_ms", "ttfb_ms", "streamed", "done", "_lock", "client", "client_pass",
    )  # fmt: skip

    def __init__(self) -> None:
        self.route = ""
        self.fingerprint = ""
        self.model = ""
        self.host = ""
        self.lease = ""
        self.fallback = ""
        self.client = ""  # the client key's name
        self.client_pass: ClientPass | None = None  # released when the exchange finishes
        self.started = datetime.now(UTC)
        self.t0 = time.perf_counter()
        self.queued_ms = 0
        self.ttfb_ms: int | None = None
        self.streamed = False
        self.done = False
        self._lock = threading.Lock()

    def elapsed_ms(self) -> int:
        return int((time.perf_counter() - self.t0) * 1000)

    def placed(self, placement: Placement) -> None:
        """Note where the request runs. `route` stays the route the client asked for."""
        self.host = placement.host
        self.lease = placement.lease
        self.model = placement.model
        self.fallback = placement.fallback
        self.queued_ms = int(placement.waited * 1000)

    def finish(
        self,
        status: int,
        error: str = "",
        prompt_tokens: int | None = None,
        cached_tokens: int | None = None,
        completion_tokens: int | None = None,
    ) -> None:
        with self._lock:
            if self.done:
                return
            self.done = True
        if self.client_pass is not None:
            self.client_pass.release()
        total_ms = self.elapsed_ms()
        record = RequestRecord(
            route=self.route,
            fingerprint=self.fingerprint,
            model=self.model,
            host=self.host,
            started=self.started,
            queued_ms=self.queued_ms,
            ttfb_ms=self.ttfb_ms,
            total_ms=total_ms,
            status=status,
            streamed=self.streamed,
            lease=self.lease,
            prompt_tokens=prompt_tokens,
            cached_tokens=cached_tokens,
            completion_tokens=completion_tokens,
            error=error,
            client=self.client,
            fallback=self.fallback,
        )
        get_recorder().record(record)
        metrics.observe(record)
        log.info(
            "route=%s model=%s host=%s status=%d lease=%s queued_ms=%d total_ms=%d fp=%s%s",
            self.route or "-",
            self.model or "-",
            self.host or "-",
            status,
            self.lease or "-",
            self.queued_ms,
            total_ms,
            self.fingerprint[:8] or "-",
            f" error={error!r}" if error else "",
        )

    def __del__(self) -> None:
        # The last safety net: a response Django dropped before iterating it (the client left
        # between the view's return and the first byte) still leaves its row.
        if not self.done:
            self.finish(499, "client disconnected")


class Relay:
    """The upstream body as an async iterator for StreamingHttpResponse.

    Yields each upstream chunk unchanged (the tee only looks), enforces the idle timeout
    between chunks, and when the body ends, fails or is abandoned, closes the upstream
    response, frees the slot and finishes the exchange, once.

    Django may stop iterating without telling the iterator (a client that leaves while
    Django awaits the socket): `__del__` covers that, handing the cleanup to the loop.

    The idle timeout is a watchdog timer, not an `asyncio.timeout` per read (which cost ~9 µs
    per chunk in `make bench`): each read only notes when it started, and the timer, which
    wakes about once per idle period, cancels the read that has waited too long. Time the
    client takes to accept a chunk does not count: that is backpressure, not a stalled host.
    """

    __slots__ = (
        "_upstream", "_chunks", "_slot", "_tee", "_exchange", "_idle", "_loop", "_status",
        "_closed", "_task", "_read_since", "_watchdog", "_stalled",
    )  # fmt: skip

    def __init__(
        self, upstream: httpx.Response, slot: Slot | None, exchange: Exchange, runtime: Runtime
    ) -> None:
        self._upstream = upstream
        self._chunks = upstream.aiter_raw()
        self._slot = slot
        self._tee = Tee(upstream.headers.get("content-type", ""))
        self._exchange = exchange
        self._idle = runtime.stream_idle_timeout
        self._loop = asyncio.get_running_loop()
        self._status = upstream.status_code
        self._closed = False
        self._task: asyncio.Task[object] | None = None
        self._read_since: float | None = None  # when the pending read began; None between reads
        self._watchdog: asyncio.TimerHandle | None = None
        self._stalled = False
        exchange.streamed = exchange.streamed or self._tee.streamed

    def __aiter__(self) -> Relay:
        return self

    async def __anext__(self) -> bytes:
        if self._closed:
            raise StopAsyncIteration
        self._read_since = self._loop.time()
        if self._watchdog is None:
            self._task = asyncio.current_task()
            self._watchdog = self._loop.call_at(self._read_since + self._idle, self._watch)
        try:
            chunk = await anext(self._chunks)
        except StopAsyncIteration:
            await self._close(self._status)
            raise
        except httpx.HTTPError as exc:
            message = f"host {self._exchange.host} failed mid-stream: {_describe(exc)}"
            return await self._fail(502, message)
        except asyncio.CancelledError:
            if self._stalled and self._task is not None and self._task.uncancel() == 0:
                message = f"host {self._exchange.host} sent nothing for {self._idle:g} s mid-stream"
                return await self._fail(504, message)
            self._abandon(499, "client disconnected mid-stream")
            raise
        self._read_since = None
        self._tee.feed(chunk)
        return chunk

    def _watch(self) -> None:
        """The watchdog: cancel a read that has waited the idle timeout, else look again."""
        if self._closed:
            return
        now = self._loop.time()
        since = self._read_since
        if since is None or now - since < self._idle:
            self._watchdog = self._loop.call_at((since or now) + self._idle, self._watch)
            return
        self._stalled = True
        if self._task is not None:
            self._task.cancel()

    async def _fail(self, status: int, message: str) -> bytes:
        """End a stream the host broke: an SSE client gets one error event, then the end."""
        await self._close(status, message)
        if not self._tee.streamed:
            raise StopAsyncIteration
        return sse.error_event(Answer(status, message, "server_error", "upstream_failed"))

    async def error_message(self) -> str:
        """Read a failed answer's body (bounded), close it, and say what the host said."""
        body = b""
        try:
            async with asyncio.timeout(self._idle):
                async for chunk in self._chunks:
                    body += chunk
                    if len(body) > 65536:
                        break
        except (TimeoutError, httpx.HTTPError):
            pass
        message = f"host {self._exchange.host} answered {self._status}"
        try:
            detail = json.loads(body)["error"]["message"]
            message = f"{message}: {detail}"
        except (ValueError, KeyError, TypeError):
            pass
        await self._close(self._status, message)
        return message

    async def _close(self, status: int, error: str = "") -> None:
        if self._closed:
            return
        self._release(status, error)
        await self._upstream.aclose()

    def _release(self, status: int, error: str) -> None:
        self._closed = True
        if self._watchdog is not None:
            self._watchdog.cancel()
        if self._slot is not None:
            self._slot.release()
        usage = self._tee.usage()
        self._exchange.finish(
            status, error, usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens
        )

    def _abandon(self, status: int, error: str) -> None:
        """Finish now and close the upstream in the background (cancelled or dropped)."""
        if self._closed:
            return
        self._release(status, error)
        self._loop.create_task(self._upstream.aclose())

    def __del__(self) -> None:
        if not self._closed and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._abandon, 499, "client disconnected")


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


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
    exchange.finish(answer.status, answer.message)
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


def _upstream_headers(request: HttpRequest, api_key: str) -> list[tuple[str, str]]:
    headers = [
        (name, value)
        for name, value in request.headers.items()
        if name.lower() not in _REQUEST_DROP
    ]
    headers.append(("Accept-Encoding", "identity"))
    if api_key:
        headers.append(("Authorization", f"Bearer {api_key}"))
    return headers


async def _send(runtime: Runtime, host: str, request: httpx.Request) -> httpx.Response:
    """Send and wait for the response head; one retry when a pooled connection was stale.

    llama-server closes the connection after each streamed response while advertising
    keep-alive, so a pooled connection can die between requests. A failure before any response
    byte is retried once; a refused connection is not (the host is down).
    """
    for attempt in (1, 2):
        try:
            async with asyncio.timeout(runtime.headers_timeout):
                return await runtime.client.send(request, stream=True)
        except TimeoutError:
            raise UpstreamTimeout(
                f"host {host} sent no response head within {runtime.headers_timeout:g} s"
            ) from None
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            runtime.health.mark_down(host, _describe(exc))
            raise UpstreamUnreachable(f"host {host} unreachable: {_describe(exc)}") from None
        except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
            if attempt == 2:
                runtime.health.mark_down(host, _describe(exc))
                raise UpstreamUnreachable(
                    f"host {host} closed the connection: {_describe(exc)}"
                ) from None
        except httpx.HTTPError as exc:
            raise UpstreamUnreachable(f"host {host} failed: {_describe(exc)}") from None
    raise AssertionError("unreachable")


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

    if model is None:
        # Requests without a model (/health, /props, GETs) take no lease and no slot.
        host = runtime.choose(route, None)
        if host is None:
            raise NoHealthyHost(route.name)
        exchange.host = host
        upstream = await _forward(runtime, request, rest, body, payload, None, host, exchange)
        return _client_response(upstream, Relay(upstream, None, exchange, runtime), exchange)

    if not runtime.serves(route, model):
        raise UnknownModel(f"model “{model}” is not served by route “{route.name}”")
    exchange.fingerprint = fingerprint(method, payload, request.headers.get(SESSION_HEADER))
    placer = Placer(runtime, route, model, exchange.fingerprint)
    placement = await placer.now()
    if placement is None:
        exchange.host, exchange.lease = placer.host, placer.lease
        if _wants_wait_status(request, route, payload):
            return _waiting_response(runtime, request, rest, body, payload, placer, exchange)
        placement = await placer.wait()
    exchange.placed(placement)
    try:
        upstream = await _forward(
            runtime, request, rest, body, payload, placement.model, placement.host, exchange
        )
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
    runtime: Runtime,
    request: HttpRequest,
    rest: str,
    body: bytes,
    payload: dict[str, object] | None,
    placer: Placer,
    exchange: Exchange,
) -> StreamingHttpResponse:
    """The response head now; status comments while the request waits; then the stream."""
    exchange.streamed = True
    response = StreamingHttpResponse(
        _wait_then_stream(runtime, request, rest, body, payload, placer, exchange),
        content_type="text/event-stream",
    )
    response["Cache-Control"] = "no-cache"
    response["X-Crossbar-Host"] = exchange.host
    if exchange.lease:
        response["X-Crossbar-Lease"] = exchange.lease
    return response


async def _wait_then_stream(
    runtime: Runtime,
    request: HttpRequest,
    rest: str,
    body: bytes,
    payload: dict[str, object] | None,
    placer: Placer,
    exchange: Exchange,
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
        exchange.finish(answer.status, answer.message)
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
        upstream = await _forward(
            runtime, request, rest, body, payload, placement.model, placement.host, exchange
        )
    except GatewayError as exc:
        placement.slot.release()
        answer = answer_for(exc)
        exchange.finish(answer.status, answer.message)
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


def _with_model(payload: dict[str, object], model: str) -> bytes:
    """The body again, naming `model`. Raises BadBody when it cannot be written back."""
    document = {**payload, "model": model}
    try:
        return json.dumps(document, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        # A lone surrogate, valid as a JSON escape but not in UTF-8: keep it an escape.
        return json.dumps(document).encode()
    except RecursionError:
        raise BadBody("request body is not valid JSON: nested too deeply") from None


async def _forward(
    runtime: Runtime,
    request: HttpRequest,
    rest: str,
    body: bytes,
    payload: dict[str, object] | None,
    model: str | None,
    host: str,
    exchange: Exchange,
) -> httpx.Response:
    config = runtime.fleet.hosts[host]
    if model is not None and payload is not None:
        wanted = config.models[model].upstream_name or model
        if wanted != payload.get("model"):
            # Re-serialised only when the model changes: the original bytes go otherwise.
            body = _with_model(payload, wanted)
    url = config.url + rest
    query = request.META.get("QUERY_STRING", "")
    if query:
        url = f"{url}?{query}"
    upstream_request = runtime.client.build_request(
        request.method or "GET",
        url,
        headers=_upstream_headers(request, config.api_key),
        content=body or None,
    )
    response = await _send(runtime, host, upstream_request)
    exchange.ttfb_ms = exchange.elapsed_ms()
    return response


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
