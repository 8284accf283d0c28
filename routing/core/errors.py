"""Every way a proxied request can fail that the gateway answers itself, and its HTTP answer.

    GatewayError                       400 bad_request (the base: status, code, retry_after)
    ├── MissingRoute, ConflictingRoute 400            ├── BadBody          400 invalid_body
    ├── BadHostHeader                  400 invalid_host
    ├── UnknownRoute, NotFound         404            ├── UnknownModel     404 model_not_found
    │   └── NotARoute                  404 unknown_route, no row
    ├── MethodNotAllowed               405            ├── BodyTooLarge     413
    ├── MissingKey, InvalidKey         401            ├── RouteNotAllowed  403
    ├── OperatorOnly                   403 operator_only (401 when a token would get in)
    │   └── ManagementNotAllowed       403 model_management_not_allowed (likewise)
    ├── ClientLimited                  429 (+ Retry-After)
    ├── QueueFull                      503 queue_full (+ Retry-After 1)
    ├── NoHealthyHost                  503 no_healthy_host (+ Retry-After 2 while a host is down)
    ├── PinnedHostDown                 503 pinned_host_down (+ Retry-After 2 while it is down)
    ├── QueueTimeout                   503 queue_timeout (+ Retry-After 5)
    ├── HostRemoved                    503 host_removed (+ Retry-After 1)
    ├── UpstreamUnreachable            502 upstream_unreachable
    │   └── HostDown                   (refused or reset before answering: placed again)
    ├── UpstreamFailed                 502 upstream_failed (a head no client may be given)
    └── UpstreamTimeout                504 upstream_timeout

Each error carries its own status, code and Retry-After, and may carry `detail`: the refusal's
facts as JSON (route, model, the hosts and their states, the route's models), which
`routing.core.refusals` builds only when a request is refused. `answer_for` is the one place
an exception becomes an `Answer` (anything unexpected: a plain 500), which the proxy writes as
an OpenAI-shaped body (`{"error": {"message", "type", "code", ...detail}}`) so OpenAI clients
show it. The `code` values are stable: clients match on them; messages may change.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

_NO_DETAIL: Mapping[str, object] = MappingProxyType({})


class GatewayError(Exception):
    """A request the gateway answers itself. `status`, `code` and `retry_after` are class-level
    defaults; an instance may carry its own `retry_after` (None where waiting does not help)
    and `detail` (extra keys of the error object, JSON-ready)."""

    status = 400
    code = "bad_request"
    retry_after: int | None = None

    def __init__(
        self,
        message: str,
        *,
        retry_after: int | None = None,
        detail: Mapping[str, object] = _NO_DETAIL,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.detail = detail
        if retry_after is not None:
            self.retry_after = retry_after


class QueueFull(GatewayError):
    """Every usable host of the route has its slots busy and its queue full: `hosts`, in the
    order placement tried them (the request is counted against each)."""

    status = 503
    code = "queue_full"
    retry_after = 1

    def __init__(
        self,
        hosts: Sequence[str] = (),
        model: str = "",
        message: str = "queue full",
        *,
        detail: Mapping[str, object] = _NO_DETAIL,
    ) -> None:
        super().__init__(message, detail=detail)
        self.hosts = tuple(hosts)
        self.model = model


class NoHealthyHost(GatewayError):
    """No host of the route may take the request (down, draining, disabled, not serving)."""

    status = 503
    code = "no_healthy_host"
    retry_after: int | None = 2

    def __init__(
        self, message: str = "no healthy host", *, detail: Mapping[str, object] = _NO_DETAIL
    ) -> None:
        super().__init__(message, detail=detail)


class PinnedHostDown(GatewayError):
    """A strict route's lease points at a host that cannot take the request."""

    status = 503
    code = "pinned_host_down"
    retry_after: int | None = 2

    def __init__(
        self, host: str, message: str = "", *, detail: Mapping[str, object] = _NO_DETAIL
    ) -> None:
        super().__init__(message or f"pinned host down: {host}", detail=detail)
        self.host = host


class BadHostHeader(GatewayError):
    """The `Host` header names no host the gateway serves (ALLOWED_HOSTS): e.g. a page on
    another site reaching a gateway on 127.0.0.1 through DNS rebinding."""

    code = "invalid_host"


class MissingRoute(GatewayError):
    code = "missing_route"


class ConflictingRoute(GatewayError):
    code = "conflicting_route"


class UnknownRoute(GatewayError):
    """No enabled route has the name the path or `X-Crossbar-Route` gives (`name`, as sent)."""

    status = 404
    code = "unknown_route"

    def __init__(self, message: str, name: str = "") -> None:
        super().__init__(message)
        self.name = name


class NotARoute(UnknownRoute):
    """The path's first segment names no route, no `X-Crossbar-Route` was sent, and the rest
    of the path is no endpoint llama-server serves: not a request for the gateway at all (a
    stray `/robots.txt`, a scanner). Answered 404 without a row, a log line or a metric, so
    only proxy traffic is in the books. (`/nope/v1/chat/completions` is a client's request
    with a wrong route: `UnknownRoute`, with its row.)"""


class NotFound(GatewayError):
    status = 404
    code = "not_found"


class BodyTooLarge(GatewayError):
    status = 413
    code = "body_too_large"


class BadBody(GatewayError):
    code = "invalid_body"


class UnknownModel(GatewayError):
    """The route serves no model of the name the body gives."""

    status = 404
    code = "model_not_found"


class MethodNotAllowed(GatewayError):
    status = 405
    code = "method_not_allowed"


class QueueTimeout(GatewayError):
    """The request waited the route's queue_timeout without getting a slot."""

    status = 503
    code = "queue_timeout"
    retry_after = 5


class HostRemoved(GatewayError):
    """The host left the configuration (deleted, renamed away from its box, or no longer
    serving the model) while the request waited in its line. The limiter ends such a wait with
    this; the passage then places the request again on the route's other hosts, and answers
    it only when none of them can take it (the message then says why)."""

    status = 503
    code = "host_removed"
    retry_after = 1

    def __init__(
        self,
        host: str,
        model: str,
        message: str = "",
        *,
        retry_after: int | None = None,
        detail: Mapping[str, object] = _NO_DETAIL,
    ) -> None:
        super().__init__(
            message
            or f"host {host} was removed from the configuration (or no longer serves {model}) "
            "while this request waited in its line",
            retry_after=retry_after,
            detail=detail,
        )
        self.host = host
        self.model = model


class UpstreamUnreachable(GatewayError):
    """The host refused or reset the connection before answering."""

    status = 502
    code = "upstream_unreachable"


class HostDown(UpstreamUnreachable):
    """The host refused or reset the connection before any response byte: it is down, and the
    request may be placed again elsewhere, since nothing was sent to the client yet."""


class UpstreamFailed(GatewayError):
    """The host answered with a head the gateway cannot relay: a status outside 200-599 (a 1xx
    as its final answer among them). Not placed again: the host may have acted on the request.
    (The same code ends a stream the host broke after its head: the relay's error event.)"""

    status = 502
    code = "upstream_failed"


class UpstreamTimeout(GatewayError):
    """The host did not send a response head in time."""

    status = 504
    code = "upstream_timeout"


class MissingKey(GatewayError):
    """Client keys are required and the request sent no `Authorization: Bearer` key."""

    status = 401
    code = "missing_api_key"


class InvalidKey(GatewayError):
    """The key is unknown or disabled."""

    status = 401
    code = "invalid_api_key"


class OperatorOnly(GatewayError):
    """An operator's endpoint (a host control the route does not open, or one named host's own
    endpoint), asked by someone who is not an operator.

    403, or 401 (`status`) where sending the operators' token would get in.
    """

    status = 403
    code = "operator_only"

    def __init__(self, message: str, *, status: int = 403) -> None:
        super().__init__(message)
        self.status = status


class ManagementNotAllowed(OperatorOnly):
    """Model load or unload, which the route does not open to clients, from a client."""

    code = "model_management_not_allowed"


class RouteNotAllowed(GatewayError):
    """The key may not use this route."""

    status = 403
    code = "route_not_allowed"


class ClientLimited(GatewayError):
    """The key is over its concurrency or requests-per-minute limit; `retry_after` says when."""

    status = 429
    code = "rate_limit_exceeded"


@dataclass(slots=True, frozen=True)
class Answer:
    status: int
    message: str
    type: str
    code: str
    retry_after: int | None = None
    detail: Mapping[str, object] = field(default_factory=lambda: _NO_DETAIL)

    def body(self) -> dict[str, object]:
        error = {"message": self.message, "type": self.type, "code": self.code}
        return {"error": {**error, **self.detail}}


def _error_type(status: int) -> str:
    if status == 404:
        return "not_found_error"
    if status < 500:
        return "invalid_request_error"
    return "server_error"


def answer_for(exc: BaseException) -> Answer:
    """The HTTP answer for a failure; anything unexpected is a plain 500."""
    if isinstance(exc, GatewayError):
        return Answer(
            exc.status, exc.message, _error_type(exc.status), exc.code, exc.retry_after, exc.detail
        )
    return Answer(500, "internal gateway error", "server_error", "internal_error")
