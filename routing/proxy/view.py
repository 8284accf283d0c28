"""The proxy view: route, client, ask, place, forward, relay; one record at the end.

The life of one request (docs/architecture.md, "One request"): the route comes from the path or
`X-Crossbar-Route`; the client key is checked; the body gives the model and the conversation's
fingerprint (`ask`); placement picks the host and takes a slot or a place in its queue in one
step (`routing.core.placement`); the passage waits if needed and asks the host, placing again
when the host turns out to be down (`passage`); the host's response streams back through a
`Relay` while the tee reads token counts. Whatever ends the request (an error answered here, the
end of the body, the client leaving) writes its one row, from the `Trail` of plain values the
steps produced (`record`).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.template.loader import render_to_string
from django.views.decorators.csrf import csrf_exempt

from accounting.recorder import get_recorder
from routing.config.shape import RouteConfig
from routing.core.endpoints import Kind
from routing.core.errors import (
    MethodNotAllowed,
    NoHealthyHost,
    NotARoute,
    answer_for,
)
from routing.core.placement import Placer, Waiting
from routing.core.refusals import unknown_model
from routing.proxy.access import check_access
from routing.proxy.ask import (
    ROUTE_HEADER,
    Ask,
    check_host,
    named_host,
    read_ask,
    resolve_route,
    wants_wait_status,
)
from routing.proxy.figures import pricing
from routing.proxy.model_list import model_list
from routing.proxy.passage import Answered, Passage
from routing.proxy.record import Arrival, Trail, finish
from routing.proxy.refusal import counted_where_it_happened, explained
from routing.proxy.relay import Relay
from routing.proxy.respond import (
    METHODS,
    StreamedResponse,
    allow_origin,
    error_response,
    preflight_response,
    set_placement_headers,
    streamed,
)
from routing.proxy.waiting import StatusStream
from routing.runtime import STOPPING, Runtime, get_runtime

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
    trail = Trail(Arrival())
    passage: Passage | None = None  # once placed, the passage's trail is the request's
    origins: frozenset[str] = frozenset()  # the route's CORS origins, once it is known
    serving: tuple[Runtime, RouteConfig] | None = None  # once the route is known
    try:
        runtime = await get_runtime()
        await runtime.refresh()
        route, path, endpoint = resolve_route(request, runtime.fleet)
        serving = (runtime, route)
        origins = route.cors_origins
        if request.method == "OPTIONS":
            return preflight_response(request, origins)  # a browser asking first: no row, no host
        trail = trail._replace(route=route.name)
        check_host(request)
        pinned = named_host(route, path)
        caller = await check_access(request, runtime.clients, route, endpoint, path)
        if caller.client is not None:
            trail = trail._replace(client=caller.client.name)
            trail = trail._replace(client_pass=await runtime.admit(caller.client, route.name))
        if (request.method or "GET") not in METHODS:
            raise MethodNotAllowed(
                f"method {(request.method or '')[:20]} not allowed: use {', '.join(METHODS)}"
            )
        if endpoint.kind is Kind.MODELS and request.method in ("GET", "HEAD"):
            query = request.META.get("QUERY_STRING", "")
            models_list = JsonResponse(await model_list(runtime, route, path, query))
            finish(trail, 200)
            allow_origin(models_list, origins, request.headers.get("Origin"))
            return models_list
        models = runtime.live.served(route)
        ask = read_ask(request, route, path, endpoint, models, operator=caller.operator)
        if pinned is not None:
            ask = replace(ask, host=pinned[0], path=pinned[1])
        running = runtime.running.add(route.name, ask.model or "", trail.client)
        trail = trail._replace(
            model=ask.model or "",
            fingerprint=ask.fingerprint,
            prefix=ask.prefix,
            running=running,
        )
        try:
            passage = await _place(runtime, route, ask, trail)
        except NoHealthyHost:
            await runtime.probe_down(route)  # a host that just came back serves at once
            passage = await _place(runtime, route, ask, trail)
        if isinstance(passage.waiting, Waiting) and wants_wait_status(ask, route):
            status = _waiting_response(runtime, passage, passage.waiting)
            allow_origin(status, origins, request.headers.get("Origin"))
            return status
        return _relayed(runtime, await passage.through(), origins)
    except asyncio.CancelledError:
        ended = passage.trail if passage is not None else trail
        finish(ended, 499, "client disconnected before the response", "client_disconnected")
        raise
    except NotARoute as exc:
        return error_response(answer_for(exc), trail, request.headers.get("Origin"))
    except Exception as exc:
        ended = passage.trail if passage is not None else trail
        if serving is not None:
            exc = explained(*serving, ended.model or None, exc)
        answer = answer_for(exc)
        if answer.status == 500:
            log.exception("unexpected error serving %s", request.path[:200])
        response = error_response(answer, ended, request.headers.get("Origin"), origins)
        finish(counted_where_it_happened(ended, exc), answer.status, answer.message, answer.code)
        return response


def _relayed(runtime: Runtime, answered: Answered, origins: frozenset[str]) -> StreamedResponse:
    """The response that relays the host's answer. The answer's slot and the host's response
    are this step's until the response is handed to the server, whose handler closes it on
    every way out (`Relay.close` ends the request): whatever fails before gives both back, and
    the view answers the failure, with the request's row."""
    try:
        placement = answered.placement
        slot = placement.slot if placement is not None else None
        return streamed(answered, Relay(answered.upstream, slot, answered.trail, runtime), origins)
    except BaseException:
        answered.give_back()
        raise


async def _place(runtime: Runtime, route: RouteConfig, ask: Ask, trail: Trail) -> Passage:
    """The request's passage: placed now, or holding its place in a queue, in one step.

    Raises UnknownModel, QueueFull, NoHealthyHost or PinnedHostDown.
    """
    if ask.model is not None and not runtime.live.serves(route, ask.model):
        raise unknown_model(route.name, ask.model, runtime.fleet.route_models(route))
    if not ask.takes_slot:
        return Passage(runtime, route, ask, trail, None, None)
    assert ask.model is not None
    prices = pricing(runtime, route, ask)
    placer = Placer(
        runtime.live, route, ask.model, ask.fingerprint, runtime.loop.time(), ask.prefix.blocks,
        prices,
    )  # fmt: skip
    return Passage(runtime, route, ask, trail, placer, await placer.now())


def _waiting_response(runtime: Runtime, passage: Passage, waiting: Waiting) -> StreamedResponse:
    """The head now (200, SSE), the wait's status comments, then the host's stream."""
    passage.trail = passage.trail._replace(
        host=waiting.host,
        lease=str(waiting.lease),
        placement=str(waiting.reason),
        streamed=True,
    )
    response = StreamedResponse(StatusStream(passage, runtime))
    response["Content-Type"] = "text/event-stream"
    response["Cache-Control"] = "no-cache"
    set_placement_headers(response, passage.trail)
    return response
