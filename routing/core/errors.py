"""Every way a proxied request can fail before the upstream answers, and its HTTP answer.

The proxy raises these types; `answer_for` is the one place they become status codes and
OpenAI-shaped error bodies (`{"error": {"message", "type", "code"}}`), so OpenAI clients show
the message to their user.
"""

from __future__ import annotations

from dataclasses import dataclass

from routing.core.leases import NoHealthyHost, PinnedHostDown
from routing.core.limiter import QueueFull


class GatewayError(Exception):
    """A request the gateway answers itself. `status`/`code` are class-level defaults."""

    status = 400
    code = "bad_request"

    def __init__(self, message: str, *, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after = retry_after


class MissingRoute(GatewayError):
    code = "missing_route"


class ConflictingRoute(GatewayError):
    code = "conflicting_route"


class UnknownRoute(GatewayError):
    status = 404
    code = "unknown_route"


class NotFound(GatewayError):
    status = 404
    code = "not_found"


class BodyTooLarge(GatewayError):
    status = 413
    code = "body_too_large"


class BadBody(GatewayError):
    code = "invalid_body"


class UnknownModel(GatewayError):
    status = 404
    code = "model_not_found"


class MethodNotAllowed(GatewayError):
    status = 405
    code = "method_not_allowed"


class QueueTimeout(GatewayError):
    """The request waited the route's queue_timeout without getting a slot."""

    status = 503
    code = "queue_timeout"


class UpstreamUnreachable(GatewayError):
    """The host refused or reset the connection before answering."""

    status = 502
    code = "upstream_unreachable"


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


class RouteNotAllowed(GatewayError):
    """The key may not use this route."""

    status = 403
    code = "route_not_allowed"


class ClientLimited(GatewayError):
    """The key is over its concurrency or requests-per-minute limit; `retry_after` says when."""

    status = 429
    code = "rate_limit_exceeded"


def describe_error(exc: BaseException) -> str:
    """An exception as one line for a person: its type, and its message when it has one."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


@dataclass(slots=True, frozen=True)
class Answer:
    status: int
    message: str
    type: str
    code: str
    retry_after: int | None = None

    def body(self) -> dict[str, object]:
        return {"error": {"message": self.message, "type": self.type, "code": self.code}}


def _error_type(status: int) -> str:
    if status == 404:
        return "not_found_error"
    if status < 500:
        return "invalid_request_error"
    return "server_error"


def answer_for(exc: Exception) -> Answer:
    """The HTTP answer for a failure; anything unexpected is a plain 500."""
    if isinstance(exc, QueueFull):
        return Answer(503, "queue full", "server_error", "queue_full", retry_after=1)
    if isinstance(exc, NoHealthyHost):
        return Answer(503, "no healthy host", "server_error", "no_healthy_host", retry_after=2)
    if isinstance(exc, PinnedHostDown):
        message = (
            f"pinned host down: {exc.host}" if getattr(exc, "host", "") else "pinned host down"
        )
        return Answer(503, message, "server_error", "pinned_host_down", retry_after=2)
    if isinstance(exc, QueueTimeout):
        return Answer(503, exc.message, "server_error", exc.code, retry_after=5)
    if isinstance(exc, GatewayError):
        return Answer(
            exc.status, exc.message, _error_type(exc.status), exc.code, exc.retry_after
        )
    return Answer(500, "internal gateway error", "server_error", "internal_error")
