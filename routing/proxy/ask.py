"""What the client asked: the route, the upstream path, the body, the model, the conversation."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass

from django.core.exceptions import DisallowedHost, RequestDataTooBig
from django.http import HttpRequest
from django.http.request import RawPostDataException

from routing.config.shape import FleetConfig, RouteConfig
from routing.core.endpoints import Endpoint, Kind, endpoint_of
from routing.core.errors import (
    BadBody,
    BadHostHeader,
    BodyTooLarge,
    ConflictingRoute,
    MissingRoute,
    NotARoute,
    NotFound,
    UnknownRoute,
)
from routing.core.fingerprint import fingerprint
from routing.core.prefixes import NO_PREFIX, Prefix, prefix_blocks

MAX_BODY = 16 * 1024 * 1024
MAX_MODEL_NAME = 200  # HostModel.name and Request.model hold this much
ROUTE_HEADER = "X-Crossbar-Route"
SESSION_HEADER = "X-Crossbar-Session"
WAIT_STATUS_HEADER = "X-Crossbar-Wait-Status"

_ROUTE_NAME = re.compile(r"[-a-zA-Z0-9_]{1,64}")
HOSTS_PREFIX = "/hosts/"
_LOCAL_METHODS = frozenset({"GET", "HEAD"})
# The endpoints whose prompt stays in the host's KV cache for the next request to reuse:
# generations, not embeddings or reranking (and infill has no prefix: routing/core/prefixes.py).
_CACHED_PROMPTS = frozenset(
    {"/v1/chat/completions", "/chat/completions", "/v1/completions", "/completions",
     "/completion", "/v1/responses", "/responses", "/v1/messages"}
)  # fmt: skip

# The paths whose body llama-server reads a slot's number from (`id_slot`): its completions,
# its chat completions and its Responses (turned into a chat with every other field kept),
# which pass on what they do not know; not its Anthropic messages, whose conversion keeps
# only the fields it names.
_NAMED_SLOTS = _CACHED_PROMPTS - {"/v1/messages"}


@dataclass(slots=True, frozen=True)
class Ask:
    """What the client asked, ready to be asked of a host."""

    request: HttpRequest
    path: str  # the upstream path, e.g. /v1/chat/completions
    kind: Kind
    body: bytes
    payload: dict[str, object] | None  # the body's JSON object, when the gateway read it
    model: str | None  # the model it names; None for requests about the host itself
    fingerprint: str = ""
    credentials: bool = False  # the client's credentials go to the host (the route says so)
    host: str = ""  # the one host an operator asked about (`/hosts/<name>/...`)
    prefix: Prefix = NO_PREFIX  # the prompt in blocks, for the prefix index

    @property
    def takes_slot(self) -> bool:
        return self.kind is Kind.GENERATE and self.model is not None

    @property
    def names_slot(self) -> bool:
        """Whether the host can be told which of its slots serves this (`id_slot`)."""
        return self.payload is not None and self.path in _NAMED_SLOTS

    @property
    def wants_stream(self) -> bool:
        return self.payload is not None and self.payload.get("stream") is True


_checked_hosts: dict[str, bool] = {}  # Host header -> allowed; a few entries in practice


def check_host(request: HttpRequest) -> None:
    """Refuse a `Host` header outside ALLOWED_HOSTS, as the admin does. Raises BadHostHeader.

    Django's own check costs a few microseconds; its verdict per header value is kept, so a
    request pays one dictionary lookup. At most 256 values are kept, so odd headers sent by a
    scanner cannot grow it.
    """
    raw = request.META.get("HTTP_HOST", "")
    allowed = _checked_hosts.get(raw)
    if allowed is None:
        try:
            request.get_host()
            allowed = True
        except DisallowedHost:
            allowed = False
        if len(_checked_hosts) < 256:
            _checked_hosts[raw] = allowed
    if not allowed:
        raise BadHostHeader(f"invalid Host header: “{raw[:100]}” is not served here")


def resolve_route(request: HttpRequest, fleet: FleetConfig) -> tuple[RouteConfig, str, Endpoint]:
    """The route, the upstream path (`/hosts/<name>/...` for one named host) and the endpoint
    it reaches (for one named host: the host's endpoint, one about the host).

    Raises MissingRoute, ConflictingRoute, UnknownRoute (NotARoute when the path is no
    endpoint either) or NotFound.
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
        shown = name[:64]
        if not header and endpoint_of(request.method or "GET", rest) is None:
            raise NotARoute(f"unknown route: “{shown}”")  # no request for the gateway at all
        raise UnknownRoute(
            f"unknown route: “{shown}”: no route has this name. Send /<route>/v1/... (or "
            f"{ROUTE_HEADER}: <route>) with a route of this gateway (its admin lists them)",
            shown,
        )
    if not route.enabled:
        raise UnknownRoute(
            f"unknown route: “{name}” is disabled: an operator may enable it in the admin", name
        )
    pinned = _split_host(rest)
    endpoint = endpoint_of(request.method or "GET", pinned[1] if pinned else rest)
    if endpoint is None:
        raise NotFound(f"not found: {rest[:200]}")
    if pinned and not endpoint.about_the_host:
        raise NotFound(f"not found: {pinned[1][:100]} is not an endpoint about a host")
    return route, rest, endpoint


def named_host(route: RouteConfig, path: str) -> tuple[str, str] | None:
    """For `/hosts/<name>/<endpoint>` (an operator asking one host of the route about itself:
    its state and controls, `slots`, `metrics`, `props`, ...): the host and the endpoint's
    path. None for any other path. Raises NotFound for a host the route does not have."""
    pinned = _split_host(path)
    if pinned is not None and pinned[0] not in route.hosts:
        raise NotFound(f"not found: route “{route.name}” has no host “{pinned[0][:64]}”")
    return pinned


def _split_host(path: str) -> tuple[str, str] | None:
    """`/hosts/gpu1/slots` as ("gpu1", "/slots"); None for a path not about one named host."""
    if not path.startswith(HOSTS_PREFIX):
        return None
    name, _, endpoint = path[len(HOSTS_PREFIX) :].partition("/")
    return name, "/" + endpoint


def read_ask(
    request: HttpRequest,
    route: RouteConfig,
    path: str,
    endpoint: Endpoint,
    models: Mapping[str, str],
    *,
    operator: bool = False,
) -> Ask:
    """Read the body when the gateway needs what it names (the model, the conversation).

    `models`: every name the route serves a model by (its own, its aliases), to its own; the
    ask's model is the model's own name, so its aliases share one pool of slots. Endpoints
    whose body names no model, and GETs, pass with their body unread. The client's
    credentials go to the host where the route says so, never an operator's (the
    `CROSSBAR_METRICS_TOKEN` bearer). Raises BodyTooLarge, or BadBody with the reason.
    """
    method = request.method or "GET"
    kind = endpoint.kind
    credentials = route.pass_credentials and not operator
    if method in _LOCAL_METHODS:
        return Ask(request, path, kind, b"", None, None, credentials=credentials)
    body = read_body(request)
    if not endpoint.names_model:
        return Ask(request, path, kind, body, None, None, credentials=credentials)
    payload = _parse_payload(body)
    model = _model_of(payload, route, models)
    if not isinstance(payload.get("messages", []), list):
        raise BadBody("messages must be a list of message objects")
    conversation = ""
    if kind is Kind.GENERATE:
        conversation = fingerprint(method, payload, request.headers.get(SESSION_HEADER))
    prefix = prefix_blocks(payload) if path in _CACHED_PROMPTS else NO_PREFIX
    return Ask(request, path, kind, body, payload, model, conversation, credentials, prefix=prefix)


def wants_wait_status(ask: Ask, route: RouteConfig) -> bool:
    """Whether a request that must queue gets its head at once and status comments.

    Only streaming requests can: the comments ride in the SSE stream. The route decides, and a
    client may override it either way with the header.
    """
    if not ask.wants_stream:
        return False
    override = ask.request.headers.get(WAIT_STATUS_HEADER, "").strip().lower()
    if override in ("on", "true", "1", "yes"):
        return True
    if override in ("off", "false", "0", "no"):
        return False
    return route.wait_status


def read_body(request: HttpRequest) -> bytes:
    """The request body. Raises BodyTooLarge past MAX_BODY."""
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


def _model_of(payload: dict[str, object], route: RouteConfig, models: Mapping[str, str]) -> str:
    """The model the body names, by its own name when it names an alias; else (or, with
    `map_unknown_models`, when the route does not serve it) the route's default."""
    model = payload.get("model")
    if route.map_unknown_models and route.default_model and model not in models:
        return route.default_model
    if model is None or model == "":
        if route.default_model:
            return route.default_model
        raise BadBody(f"missing model: the body names none and route “{route.name}” has no default")
    if not isinstance(model, str):
        raise BadBody("model must be a string")
    if len(model) > MAX_MODEL_NAME:
        raise BadBody(f"model name longer than {MAX_MODEL_NAME} characters")
    return models.get(model, model)
