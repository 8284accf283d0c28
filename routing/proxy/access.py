"""Who may reach an endpoint: a client, or only an operator (`routing.core.endpoints`).

A client is anyone while client keys are not in use, else a request with a valid key
(`Authorization: Bearer <key>` or `X-Api-Key`). An operator sends the operators' token
(`Authorization: Bearer $CROSSBAR_METRICS_TOKEN`, as `/metrics` takes it) or is staff signed in
to the admin. The health check is anyone's. Host controls are an operator's unless the route
opens them; one named host's own endpoints (`/<route>/hosts/<host>/...`) are always an
operator's.

The proxy path has no middleware (crossbar_site/handler.py), so the admin session is read here
with Django's async session and auth API, and only for an operator's endpoints: a request that
generates never pays for it.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from importlib import import_module

from django.conf import settings
from django.contrib.auth import aget_user
from django.http import HttpRequest, HttpResponse
from django.middleware.csrf import CsrfViewMiddleware

from accounting.keys import hash_key
from routing.config.shape import RouteConfig
from routing.core.clients import ClientGate, ClientSpec, bearer_token
from routing.core.endpoints import READS, Endpoint, Opener
from routing.core.errors import ManagementNotAllowed, OperatorOnly
from routing.proxy.ask import HOSTS_PREFIX, read_body


@dataclass(slots=True, frozen=True)
class Caller:
    """Who asks: the client its key names (None while keys are not in use), or an operator."""

    client: ClientSpec | None = None
    operator: bool = False


OPERATOR = Caller(operator=True)


async def check_access(
    request: HttpRequest, clients: ClientGate, route: RouteConfig, endpoint: Endpoint, path: str
) -> Caller:
    """Who asks for `endpoint` (at upstream `path`) on `route`, if they may.

    Raises OperatorOnly or ManagementNotAllowed (the endpoint is an operator's and the request
    is not), MissingKey or InvalidKey (client keys are in use). No message holds a key or the
    operators' token.
    """
    pinned = path.startswith(HOSTS_PREFIX)
    if endpoint.keyless and not pinned:
        return Caller()
    if pinned or endpoint.operators_only:
        if await _is_operator(request):
            return OPERATOR
        if pinned or not _opens(route, endpoint):
            raise _refusal(route, endpoint, path, pinned)
    return Caller(client=clients.identify(_client_key(request)))


def _opens(route: RouteConfig, endpoint: Endpoint) -> bool:
    if endpoint.opened_by is Opener.MODEL_MANAGEMENT:
        return route.manage_models
    return route.open_host_controls


def _refusal(route: RouteConfig, endpoint: Endpoint, path: str, pinned: bool) -> OperatorOnly:
    """The refusal, saying why the endpoint is an operator's and how to get in."""
    token_set = bool(settings.CROSSBAR["METRICS_TOKEN"])
    status = 401 if token_set else 403  # 401: the token would get in
    bearer = "as “Authorization: Bearer <token>”"
    how = (
        f"send CROSSBAR_METRICS_TOKEN {bearer}"
        if token_set
        else f"set CROSSBAR_METRICS_TOKEN on the gateway and send it {bearer}"
    ) + ", or sign in at /admin/ as staff"
    asked = f"/{route.name}{path[:200]}"
    if pinned:
        return OperatorOnly(f"{asked} is one host's own, for operators: {how}", status=status)
    opener = endpoint.opened_by
    assert opener is not None, "every host control names the route setting that opens it"
    message = (
        f"{asked} is for operators ({endpoint.why}): {how}; or set {opener.value} on route "
        f"“{route.name}” to open it to clients"
    )
    refusal = ManagementNotAllowed if opener is Opener.MODEL_MANAGEMENT else OperatorOnly
    return refusal(message, status=status)


async def _is_operator(request: HttpRequest) -> bool:
    """The request carries the operators' token, or a signed-in staff session."""
    token: str = settings.CROSSBAR["METRICS_TOKEN"]
    presented = bearer_token(request.headers.get("Authorization"))
    if token and presented and hmac.compare_digest(presented.encode(), token.encode()):
        return True
    return await _staff_session(request)


async def _staff_session(request: HttpRequest) -> bool:
    """An active staff user's admin session, as the admin checks it. A session is a browser's
    ambient credential, so a write (POST) must also pass Django's CSRF check, as the admin's
    own forms do: a page on another origin must not change a host through the admin's
    browser."""
    key = request.COOKIES.get(settings.SESSION_COOKIE_NAME)
    if not key:
        return False  # no session to look up: no thread hop
    engine = import_module(settings.SESSION_ENGINE)
    request.session = engine.SessionStore(key)
    user = await aget_user(request)
    if not (user.is_active and user.is_staff):
        return False
    if request.method not in READS and not _passes_csrf(request):
        raise OperatorOnly(
            "CSRF check failed: a signed-in admin's POST needs the csrftoken cookie's value in "
            "an X-CSRFToken header, sent from this gateway's own pages"
        )
    return True


def _passes_csrf(request: HttpRequest) -> bool:
    read_body(request)  # read before the CSRF check parses a form from it, so it stays readable
    _CSRF.process_request(request)
    return _CSRF.process_view(request, _not_exempt, (), {}) is None


def _not_exempt(request: HttpRequest) -> HttpResponse:
    """The view the CSRF check is asked about: not exempt (the proxy view itself is)."""
    raise AssertionError("the CSRF check only judges the request; it never calls the view")


_CSRF = CsrfViewMiddleware(_not_exempt)


def _client_key(request: HttpRequest) -> str | None:
    """The sha256 of the client key the request presents, as `Authorization: Bearer` or as
    `X-Api-Key` (Anthropic's clients send that); None when it presents none."""
    token = bearer_token(request.headers.get("Authorization"))
    token = token or request.headers.get("X-Api-Key", "").strip()
    return hash_key(token) if token else None
