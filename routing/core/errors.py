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
    ├── BudgetExhausted                429 budget_exhausted (+ Retry-After: to the reset)
    ├── QueueFull                      503 queue_full (+ Retry-After 1)
    ├── Shed                           429 over_capacity (+ Retry-After 1)
    ├── NoHealthyHost                  503 no_healthy_host (+ Retry-After 2 while a host is down)
    │   └── ModelNotLoaded             503 model_not_loaded (its hosts load no model on demand)
    │       └── ModelLoadFailed        (the load crossbar started for it failed)
    ├── PinnedHostDown                 503 pinned_host_down (+ Retry-After 2 while it is down)
    ├── QueueTimeout                   503 queue_timeout (+ Retry-After 5)
    ├── HostRemoved                    503 host_removed (+ Retry-After 1)
    ├── UpstreamUnreachable            502 upstream_unreachable
    │   └── HostDown                   (refused or reset before answering: placed again)
    ├── UpstreamFailed                 502 upstream_failed (a head no client may be given)
    ├── UpstreamTimeout                504 upstream_timeout
    └── (routing.shared.state) StateUnavailable 503 state_unavailable (+ Retry-After 2)

    Codes the proxy writes without raising (`OUTCOMES`): a host's own error passed through
    (`upstream_error`), a slot the shared state took back
    (`slot_lost`), a client gone (499 `client_disconnected`,
    `client_too_slow`: in the row only), and anything unexpected (500 `internal_error`).

Each error carries its own status, code and Retry-After, and may carry `detail`: the refusal's
facts as JSON (route, model, the hosts and their states, the route's models), which
`routing.core.refusals` builds only when a request is refused. `answer_for` is the one place
an exception becomes an `Answer` (anything unexpected: a plain 500), which the proxy writes as
an OpenAI-shaped body (`{"error": {"message", "type", "code", ...detail}}`) so OpenAI clients
show it. The `code` values are stable: clients match on them; messages may change. Every
code is in the README's table, written from these classes and `OUTCOMES` by
`manage.py crossbar_error_table` (a test fails when the two differ, or when the code answers
one that neither names).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

_NO_DETAIL: Mapping[str, object] = MappingProxyType({})


class GatewayError(Exception):
    """A request the gateway answers itself. `status`, `code` and `retry_after` are class-level
    defaults; an instance may carry its own `retry_after` (None where waiting does not help)
    and `detail` (extra keys of the error object, JSON-ready). `when` says, for the README's
    table of codes (`routing.core.error_table`), when a client meets the code."""

    status = 400
    code = "bad_request"
    when = "a request the gateway refuses that no code below names more precisely"
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
    when = "every usable host of the route is busy and its queue is full (`Retry-After: 1`)"
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


class Shed(GatewayError):
    """A waiting request refused to make room for one of a higher class, or of its own class
    whose key is further below its share of the slots: every line the newcomer could wait in
    was full, and this was the most recently queued of the lowest class waiting there, or of
    the key furthest ahead of its share (`routing.core.limiter`). 429, not `queue_full`'s
    503: the fleet is not at fault, the request's class (or its key's share) is what lost it
    the place; the same `Retry-After` as a full queue, since the line is as full as when a
    newcomer is refused."""

    status = 429
    code = "over_capacity"
    when = (
        "the request waited in a full line and was shed for a request of a higher class, or"
        " of its own class whose key was further below its share (its weight)"
        " (`Retry-After: 1`; in-process state only)"
    )
    retry_after = QueueFull.retry_after

    def __init__(self, host: str, model: str, shed: str, newcomer: str) -> None:
        why = (
            f"a request of class {newcomer} took its place"
            if shed != newcomer
            else "a request of a client key further below its share of the slots (its weight)"
            " took its place"
        )
        super().__init__(
            f"shed for another request: this {shed} request waited in the full line of host"
            f" {host} for model {model}, and {why}. Retry after {QueueFull.retry_after} s"
        )
        self.host = host
        self.model = model


class NoHealthyHost(GatewayError):
    """No host of the route may take the request (down, draining, disabled, not serving)."""

    status = 503
    code = "no_healthy_host"
    when = (
        "no host of the route may take the request: down, loading, draining or disabled"
        " (`Retry-After: 2` while one is down or loading)"
    )
    retry_after: int | None = 2

    def __init__(
        self, message: str = "no healthy host", *, detail: Mapping[str, object] = _NO_DETAIL
    ) -> None:
        super().__init__(message, detail=detail)


class ModelNotLoaded(NoHealthyHost):
    """No host of the route that serves the model has it loaded, and the ones up
    load no model on demand (a llama-server router started with --no-models-autoload): only a
    load (by an operator, from the admin) serves it. A `NoHealthyHost`, so every step that
    handles one handles this one too."""

    code = "model_not_loaded"
    when = (
        "no host of the route has the model loaded, those up load no model on demand"
        " (`--no-models-autoload`), and crossbar's load failed or none may load it: an operator"
        " loads it from the admin (`Retry-After: 2` while a host is down, or loading the model)"
    )
    retry_after: int | None = None


class ModelLoadFailed(ModelNotLoaded):
    """The load crossbar started for the request's model failed on `host`: the host answered
    the load with an error, its `/models` says the load failed, or it took too long. `message`
    carries the host's own words; the pair is not tried again for a while, so the next request
    starts a load on another host."""

    retry_after: int | None = 1

    def __init__(self, host: str, model: str, message: str) -> None:
        detail = {"host": host, "model": model}  # explained already: the host's words stay
        super().__init__(f"model “{model}” failed to load on {host}: {message}", detail=detail)
        self.host = host
        self.model = model


class PinnedHostDown(GatewayError):
    """A strict route's lease points at a host that cannot take the request."""

    status = 503
    code = "pinned_host_down"
    when = (
        "a `sticky = strict` route's leased host cannot take the request"
        " (`Retry-After: 2` while it is down)"
    )
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
    when = "the `Host` header names no host the gateway serves (`ALLOWED_HOSTS`)"


class MissingRoute(GatewayError):
    code = "missing_route"
    when = "no route in the path nor in `X-Crossbar-Route`"


class ConflictingRoute(GatewayError):
    code = "conflicting_route"
    when = "the path and `X-Crossbar-Route` name different routes"


class UnknownRoute(GatewayError):
    """No enabled route has the name the path or `X-Crossbar-Route` gives (`name`, as sent)."""

    status = 404
    code = "unknown_route"
    when = (
        "no enabled route has that name (on a path no endpoint has, such as `/robots.txt`: no row)"
    )

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
    when = "the path is no endpoint the gateway serves (also: `%2F` in the path)"


class BodyTooLarge(GatewayError):
    status = 413
    code = "body_too_large"
    when = "the body is over 16 MiB"


class BadBody(GatewayError):
    code = "invalid_body"
    when = (
        "not JSON, not an object, not UTF-8, no model and no route default, `messages` not a list"
    )


class UnknownModel(GatewayError):
    """The route serves no model of the name the body gives."""

    status = 404
    code = "model_not_found"
    when = "the route serves no model of that name (the answer lists the route's `models`)"


class MethodNotAllowed(GatewayError):
    status = 405
    code = "method_not_allowed"
    when = "a method other than GET, HEAD, POST (`Allow` says which)"


class QueueTimeout(GatewayError):
    """The request waited the route's queue_timeout without getting a slot."""

    status = 503
    code = "queue_timeout"
    when = "the request waited the route's `queue_timeout` without a slot (`Retry-After: 5`)"
    retry_after = 5


class HostRemoved(GatewayError):
    """The host left the configuration (deleted, renamed away from its box, or no longer
    serving the model) while the request waited in its line. The limiter ends such a wait with
    this; the request's lifecycle then places it again on the route's other hosts, and answers
    it only when none of them can take it (the message then says why)."""

    status = 503
    code = "host_removed"
    when = (
        "the host the request waited for left the configuration, and no other host of the route"
        " could take the request (`Retry-After: 1`)"
    )
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
    when = "the host refused or reset the connection (it is marked down)"


class HostDown(UpstreamUnreachable):
    """The host refused or reset the connection before any response byte: it is down, and the
    request may be placed again elsewhere, since nothing was sent to the client yet."""


class UpstreamFailed(GatewayError):
    """The host answered with a head the gateway cannot relay: a status outside 200-599 (a 1xx
    as its final answer among them). Not placed again: the host may have acted on the request.
    (The same code ends a stream the host broke after its head: the relay's error event.)"""

    status = 502
    code = "upstream_failed"
    when = (
        "the host answered a status no client may be given (outside 200-599), or its answer"
        " broke off (502) or went silent for `CROSSBAR_STREAM_IDLE_TIMEOUT` (504) mid-stream:"
        ' a stream then ends with one `data: {"error": ...}` event'
    )


class UpstreamTimeout(GatewayError):
    """The host did not send a response head in time."""

    status = 504
    code = "upstream_timeout"
    when = "the host sent no response head within `CROSSBAR_HEADERS_TIMEOUT`"


class MissingKey(GatewayError):
    """Client keys are required and the request sent no `Authorization: Bearer` key."""

    status = 401
    code = "missing_api_key"
    when = "client keys are in use and the request sent none"


class InvalidKey(GatewayError):
    """The key is unknown or disabled."""

    status = 401
    code = "invalid_api_key"
    when = "the key is unknown or disabled"


class OperatorOnly(GatewayError):
    """An operator's endpoint (a host control the route does not open, or one named host's own
    endpoint), asked by someone who is not an operator.

    403, or 401 (`status`) where sending the operators' token would get in.
    """

    status = 403
    code = "operator_only"
    when = (
        "a host control the route does not open, or one host's own endpoint, asked by a client"
        " (401 when the operators' token would get in)"
    )

    def __init__(self, message: str, *, status: int = 403) -> None:
        super().__init__(message)
        self.status = status


class ManagementNotAllowed(OperatorOnly):
    """Model load or unload, which the route does not open to clients, from a client."""

    code = "model_management_not_allowed"
    when = "model load or unload, which the route does not open to clients (401 likewise)"


class RouteNotAllowed(GatewayError):
    """The key may not use this route."""

    status = 403
    code = "route_not_allowed"
    when = "the client key may not use this route"


class ClientLimited(GatewayError):
    """The key is over its concurrency or requests-per-minute limit; `retry_after` says when."""

    status = 429
    code = "rate_limit_exceeded"
    when = "the client key is over its concurrency or per-minute limit (`Retry-After`)"


class BudgetExhausted(GatewayError):
    """The key has spent its tokens of the UTC day or month (routing/core/budgets.py); the
    message and `detail` say which budget and when it resets, `retry_after` in how long."""

    status = 429
    code = "budget_exhausted"
    when = (
        "the client key has spent its tokens of the day or month; the message says which and "
        "when it resets (`Retry-After`: the seconds until then)"
    )


@dataclass(slots=True, frozen=True)
class CodeRow:
    """A code the proxy writes without raising a `GatewayError`, with its status and `when`."""

    status: str
    code: str
    when: str


INTERNAL_ERROR = CodeRow(
    "500", "internal_error", "anything unexpected (a bug: the log has its traceback)"
)
OUTCOMES = (
    CodeRow(
        "the host's",
        "upstream_error",
        "the host answered an error of its own: its status and body pass through as they are"
        ' (in a stream already answered 200: one `data: {"error": ...}` event)',
    ),
    CodeRow(
        "503",
        "slot_lost",
        "with shared state: this gateway lost touch with Redis past its hold TTL and another"
        ' request took the slot, so the stream ends with one `data: {"error": ...}` event',
    ),
    CodeRow(
        "499",
        "client_disconnected",
        "in the row only: the client left, or read nothing for `CROSSBAR_STREAM_IDLE_TIMEOUT`",
    ),
    CodeRow(
        "499",
        "client_too_slow",
        "in the row only: the client fell more than 1 MiB behind the host and was cut",
    ),
    INTERNAL_ERROR,
)


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
    return Answer(500, "internal gateway error", "server_error", INTERNAL_ERROR.code)
