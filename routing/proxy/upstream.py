"""Talking to a host: the request it gets, and waiting for its response head."""

from __future__ import annotations

import asyncio
import json

import httpx
from django.conf import settings
from django.http import HttpRequest

from hosts.failures import failure
from routing.core.errors import (
    BadBody,
    HostDown,
    UpstreamFailed,
    UpstreamTimeout,
    UpstreamUnreachable,
)
from routing.core.forwarding import FORWARDING, forwarding_headers
from routing.proxy.ask import Ask
from routing.runtime import Runtime

# Never forwarded upstream: hop-by-hop headers (RFC 9110 7.6.1), what httpx sets itself, the
# client's credentials (a host's own key replaces them), the gateway's own headers, and the
# client's forwarding headers (the gateway writes its own). Accept-Encoding is replaced by
# identity so the tee can read token counts.
_REQUEST_DROP = frozenset(
    {
        "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
        "trailer", "transfer-encoding", "upgrade", "host", "content-length", "authorization",
        "x-api-key", "cookie", "accept-encoding", "x-crossbar-route", "x-crossbar-session",
        "x-crossbar-wait-status", *FORWARDING,
    }
)  # fmt: skip


_CREDENTIALS = frozenset({"authorization", "x-api-key"})

# The statuses a client may be given as the host's answer. Both transports read past a host's
# interim answers (100 Continue, 102, 103 Early Hints) to its final one; a 1xx that reaches the
# gateway is final (101 Switching Protocols: the gateway relays HTTP, not an upgraded
# connection), and a status past 599, or under 100, is no HTTP status Django can send. (On
# httpcore, h11 refuses an unasked-for 101 and a status under 100 itself, as a malformed head.)
RELAYABLE = range(200, 600)
# How much of an unusable status line the client's error and the row quote: printable ASCII only.
QUOTED_CHARS = 40


def _headers(request: HttpRequest, api_key: str, credentials: bool) -> list[tuple[str, str]]:
    """The client's headers as the host gets them: none that its `Connection` header names
    (they were for the gateway alone, RFC 9110 7.6.1); its credentials only when the route
    passes them through, otherwise the host's own key; forwarding headers naming the client
    as the gateway saw it (`routing.core.forwarding`)."""
    connection = request.headers.get("Connection")
    hop = {name.strip().lower() for name in connection.split(",")} if connection else ()
    headers = [
        (name, value)
        for name, value in request.headers.items()
        if (lowered := name.lower()) not in hop
        and (lowered not in _REQUEST_DROP or (credentials and lowered in _CREDENTIALS))
    ]
    headers += forwarding_headers(
        request.META.get("REMOTE_ADDR", ""), request.headers, settings.CROSSBAR["TRUSTED_PROXIES"]
    )
    headers.append(("Accept-Encoding", "identity"))
    if api_key and not credentials:
        headers.append(("Authorization", f"Bearer {api_key}"))
    return headers


async def _send(runtime: Runtime, host: str, request: httpx.Request) -> httpx.Response:
    """Send and wait for the response head; one retry when a pooled connection was stale.
    A host that cannot be reached is named with its URL, where the operator's fix often is.

    llama-server closes the connection after each streamed response while advertising
    keep-alive, so a pooled connection can die between requests. A failure before any response
    byte is retried once; a refused connection is not (the host is down).
    """
    who = f"host {host} ({runtime.fleet.hosts[host].url})"
    for attempt in (1, 2):
        try:
            async with asyncio.timeout(runtime.headers_timeout):
                return await runtime.client.send(request, stream=True)
        except TimeoutError:
            raise UpstreamTimeout(
                f"host {host} sent no response head within {runtime.headers_timeout:g} s"
            ) from None
        except httpx.ConnectTimeout:
            reason = f"no connection within {runtime.connect_timeout:g} s"
            runtime.health.mark_down(host, reason)
            raise HostDown(f"{who} unreachable: {reason}") from None
        except httpx.ConnectError as exc:
            reason = failure(exc)
            runtime.health.mark_down(host, reason)
            raise HostDown(f"{who} unreachable: {reason}") from None
        except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
            if attempt == 2:
                reason = f"closed the connection before answering: {failure(exc)}"
                runtime.health.mark_down(host, reason)
                raise HostDown(f"{who} {reason}") from None
        except httpx.HTTPError as exc:
            raise UpstreamUnreachable(f"{who} failed: {failure(exc)}") from None
    raise AssertionError("unreachable")


def _with_model(payload: dict[str, object], model: str, id_slot: int | None) -> bytes:
    """The body again, naming `model` (and the slot, if given). Raises BadBody when it cannot
    be written back."""
    document = {**payload, "model": model}
    if id_slot is not None:
        document["id_slot"] = id_slot
    try:
        return json.dumps(document, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        # A lone surrogate, valid as a JSON escape but not in UTF-8: keep it an escape.
        return json.dumps(document).encode()
    except RecursionError:
        raise BadBody("request body is not valid JSON: nested too deeply") from None


def _with_slot(body: bytes, payload: dict[str, object], id_slot: int) -> bytes:
    """The client's bytes with `"id_slot": N` first in their object: the rest goes as sent.
    `body` is a JSON object (the gateway read it as `payload`), so only blanks come before
    its opening brace; the client named no `id_slot` (a key given twice is not valid JSON
    for every reader)."""
    start = body.index(b"{") + 1
    field = b'"id_slot":%d' % id_slot
    return b"".join((body[:start], field, b"," if payload else b"", body[start:]))


async def forward(
    runtime: Runtime, ask: Ask, model: str | None, host: str, id_slot: int | None
) -> httpx.Response:
    """Send the ask to `host` for `model` and return once its response head arrived.
    `id_slot`: the host's slot to name in the body (llama-server's), if any.

    Raises HostDown (the host refused or reset before answering; it is marked down),
    UpstreamUnreachable (another transport failure), UpstreamTimeout, or UpstreamFailed (a
    head no client may be given).
    """
    config = runtime.fleet.hosts[host]
    body, payload = ask.body, ask.payload
    if model is not None and payload is not None:
        spec = config.models[model]
        asked = payload.get("model")
        # The host answers to each of the model's names: the body goes as the client sent it.
        wanted = spec.upstream_name or (
            asked if isinstance(asked, str) and asked in spec.aliases else model
        )
        if wanted != asked:
            # Re-serialised only when the model changes: the original bytes go otherwise.
            body = _with_model(payload, wanted, id_slot)
        elif id_slot is not None:
            body = _with_slot(body, payload, id_slot)
    url = config.url + ask.path
    query = ask.request.META.get("QUERY_STRING", "")
    if query:
        url = f"{url}?{query}"
    upstream_request = runtime.client.build_request(
        ask.request.method or "GET",
        url,
        headers=_headers(ask.request, config.api_key, ask.credentials),
        content=body or None,
    )
    return await _relayable(host, await _send(runtime, host, upstream_request))


async def _relayable(host: str, response: httpx.Response) -> httpx.Response:
    """`response`, when its status is one a client may be given (`RELAYABLE`); otherwise it is
    closed and UpstreamFailed raised, quoting a short, printable excerpt of the status line."""
    if response.status_code in RELAYABLE:
        return response
    await response.aclose()
    said = f"{response.status_code:03d} {response.reason_phrase}"
    quoted = "".join(char for char in said if char.isascii() and char.isprintable())
    if len(quoted) > QUOTED_CHARS:
        quoted = quoted[:QUOTED_CHARS] + "..."
    raise UpstreamFailed(f"host {host} answered an unusable status line: {quoted}")
