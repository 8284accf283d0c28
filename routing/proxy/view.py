"""The proxy view: the route, then the request's lifecycle, which owns it to its row.

The life of one request (docs/architecture.md, "One request"): the route comes from the path or
`X-Crossbar-Route`; from then on the request's `Lifecycle` (`lifecycle`) holds it: the client
key's pass, the ask (the body gives the model and the conversation's fingerprint: `ask`),
placement from first try to last, the host's head, the relay of its answer, and whatever ends
the request (an error answered here, the end of the body, the client leaving) writes its one
row. The view only reads the request and answers it.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.template.loader import render_to_string
from django.views.decorators.csrf import csrf_exempt

from accounting.recorder import get_recorder
from routing.core.endpoints import Kind
from routing.core.errors import MethodNotAllowed
from routing.proxy.access import check_access
from routing.proxy.ask import (
    ROUTE_HEADER,
    check_host,
    named_host,
    read_ask,
    resolve_route,
    wants_wait_status,
)
from routing.proxy.lifecycle import Lifecycle
from routing.proxy.model_list import model_list
from routing.proxy.record import Outcome
from routing.proxy.respond import (
    METHODS,
    StreamedResponse,
    allow_origin,
    error_response,
    preflight_response,
)
from routing.proxy.waiting import waiting_response
from routing.runtime import STOPPING, get_runtime

log = logging.getLogger("crossbar.proxy")


async def gateway_health() -> JsonResponse:
    """`/health`: the gateway itself is up (for load balancers; no row, no log line).

    `revision` is the configuration stamp this process serves, so a deploy script (or a test)
    can tell when an edit has been picked up; `rows_spooled`, the accounting rows waiting in
    the spool for the database (docs/reliability.md). 503 `draining` once a graceful stop has begun,
    and 503 `state_unavailable` while the shared state (Redis) cannot be reached: this process
    would refuse every proxied request meanwhile, so a balancer should send them elsewhere.
    """
    if STOPPING.is_set():
        return JsonResponse({"status": "draining"}, status=503)
    runtime = await get_runtime()
    await runtime.refresh()
    shared = runtime.shared
    if shared is not None and not shared.available:
        unavailable = {
            "status": "state_unavailable",
            "error": f"shared state unavailable: Redis at {shared.where} cannot be reached",
            "revision": runtime.fleet.revision,
        }
        return JsonResponse(unavailable, status=503, headers={"Retry-After": "2"})
    spooled = get_recorder().spooled  # rows a stop kept on disk, not yet in the database
    return JsonResponse(
        {"status": "ok", "revision": runtime.fleet.revision, "rows_spooled": spooled}
    )


def gateway_home() -> HttpResponse:
    """`GET /`: a person who opens the gateway's address is pointed at the dashboard and the
    admin (no row, no log line). A page rather than a redirect to the admin: a client sent
    here by a base URL without its route reads why in plain words instead of following a
    redirect into a login form, and a person sees both ways in."""
    return HttpResponse(render_to_string("gateway/home.html"))


@csrf_exempt
async def proxy(request: HttpRequest) -> HttpResponse | StreamedResponse:
    """Serve one client request through the fleet. Every outcome ends with one record."""
    if ROUTE_HEADER not in request.headers:
        if request.path == "/health":
            return await gateway_health()
        if request.path == "/" and request.method in ("GET", "HEAD"):
            return gateway_home()
    life = Lifecycle()
    origin = request.headers.get("Origin")
    origins: frozenset[str] = frozenset()  # the route's CORS origins, once it is known
    try:
        runtime = await get_runtime()
        await runtime.refresh()
        route, path, endpoint = resolve_route(request, runtime.fleet)
        origins = route.cors_origins
        if request.method == "OPTIONS":
            return preflight_response(request, origins)  # a browser asking first: no row, no host
        life.routed(runtime, route)
        check_host(request)
        pinned = named_host(route, path)
        caller = await check_access(request, runtime.clients, route, endpoint, path)
        await life.admit(caller.client)
        if (request.method or "GET") not in METHODS:
            raise MethodNotAllowed(
                f"method {(request.method or '')[:20]} not allowed: use {', '.join(METHODS)}"
            )
        if endpoint.kind is Kind.MODELS and request.method in ("GET", "HEAD"):
            query = request.META.get("QUERY_STRING", "")
            models_list = JsonResponse(await model_list(runtime, route, path, query))
            life.end(Outcome(200))
            allow_origin(models_list, origins, origin)
            return models_list
        models = runtime.live.served(route)
        ask = read_ask(request, route, path, endpoint, models, operator=caller.operator)
        if pinned is not None:
            ask = replace(ask, host=pinned[0], path=pinned[1])
        await life.place(ask)
        if (life.waiting is not None or life.loading) and wants_wait_status(ask, route):
            status = waiting_response(life)
            allow_origin(status, origins, origin)
            return status
        await life.through()
        return life.respond(origins)
    except asyncio.CancelledError:
        life.end(Outcome(499, "client disconnected before the response", "client_disconnected"))
        raise
    except Exception as exc:
        answer = life.fail(exc)
        if answer.status == 500:
            log.exception("unexpected error serving %s", request.path[:200])
        return error_response(answer, life.trail, origin, origins)
