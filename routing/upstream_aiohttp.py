"""The `aiohttp` upstream transport: httpx-aiohttp's, raising what httpcore raises.

routing/proxy/upstream.py and relay.py read httpx's exceptions the way httpcore's transport
raises them: a refused connect is a `ConnectError` (the host is down), a connection reset or
closed before the response head a `ReadError` or `RemoteProtocolError` (retried once, then the
host is down), a failure while reading the body a `ReadError` (a 502 row). httpx-aiohttp maps
every `aiohttp.ClientConnectionError` to `ConnectTimeout` instead (a reset before the head, a
refused connect, a server that hung up alike) and lets a malformed head through as aiohttp's
own `ClientResponseError`. `HttpcoreErrors` sends through httpx-aiohttp and maps aiohttp's
exception again with `_MAP`. Only importing this module needs httpx-aiohttp.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import httpx
from httpx_aiohttp import AiohttpTransport
from httpx_aiohttp.transport import AiohttpResponseStream

# aiohttp's exception -> what httpcore raises for the same event; the first match wins, so a
# subclass comes before its base.
_MAP: tuple[tuple[type[aiohttp.ClientError], type[httpx.TransportError]], ...] = (
    (aiohttp.ClientProxyConnectionError, httpx.ProxyError),
    (aiohttp.ClientHttpProxyError, httpx.ProxyError),
    # The TCP connect (sock_connect) outlasted the connect timeout; the pool waits no time.
    (aiohttp.ConnectionTimeoutError, httpx.ConnectTimeout),
    (aiohttp.ServerTimeoutError, httpx.ReadTimeout),
    # The connect itself failed: refused, unreachable, DNS, TLS.
    (aiohttp.ClientConnectorError, httpx.ConnectError),
    # A clean close (FIN): before the head httpcore says "Server disconnected without sending a
    # response.", a RemoteProtocolError; so does a head that is not HTTP.
    (aiohttp.ServerDisconnectedError, httpx.RemoteProtocolError),
    (aiohttp.ClientResponseError, httpx.RemoteProtocolError),
    # Writing the request to a closed transport.
    (aiohttp.ClientConnectionResetError, httpx.WriteError),
    # A reset (ECONNRESET ...) before the head, or "Can not write request body": ReadError
    # (both are retried once, like httpcore's ReadError and WriteError). Mid-body, aiohttp
    # reports a reset or a close as an incomplete payload: ReadError (httpcore says
    # RemoteProtocolError for a close; aiohttp does not tell the two apart, nor does the relay).
    (aiohttp.ClientOSError, httpx.ReadError),
    (aiohttp.ClientPayloadError, httpx.ReadError),
    (aiohttp.ClientConnectionError, httpx.NetworkError),
    (aiohttp.ClientError, httpx.TransportError),
)


def httpx_error(exc: aiohttp.ClientError) -> httpx.TransportError:
    """The httpx exception httpcore's transport raises where aiohttp raised `exc`."""
    for theirs, ours in _MAP:
        if isinstance(exc, theirs):
            return ours(str(exc))
    raise AssertionError("aiohttp.ClientError matches last")  # pragma: no cover


class HttpcoreErrors(httpx.AsyncBaseTransport):
    """An `AiohttpTransport` that raises httpx's exceptions as httpcore's transport would."""

    def __init__(self, inner: AiohttpTransport) -> None:
        self._inner = inner

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        try:
            response = await self._inner.handle_async_request(request)
        except httpx.TransportError as exc:
            # httpx-aiohttp raises its mapping `from` aiohttp's exception.
            cause = exc.__cause__
            if not isinstance(cause, aiohttp.ClientError):
                raise
            raise httpx_error(cause) from cause
        except aiohttp.ClientError as exc:  # one httpx-aiohttp does not map
            raise httpx_error(exc) from exc
        stream = response.stream
        if isinstance(stream, AiohttpResponseStream):
            # Read the body here rather than through httpx-aiohttp's stream, not around it:
            # one async generator per chunk either way.
            response.stream = _Body(stream._aiohttp_response)
        return response

    async def aclose(self) -> None:
        await self._inner.aclose()


class _Body(httpx.AsyncByteStream):
    """A response body from aiohttp, its failures mapped once, not per chunk."""

    __slots__ = ("_response",)

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._response.content.iter_chunked(
                AiohttpResponseStream.CHUNK_SIZE
            ):
                yield chunk
        except aiohttp.ClientError as exc:
            raise httpx_error(exc) from exc

    async def aclose(self) -> None:
        try:
            self._response.release()
            await self._response.wait_for_close()
        except aiohttp.ClientError as exc:
            raise httpx_error(exc) from exc


class _Response(aiohttp.ClientResponse):
    """aiohttp's response, its reason phrase made text: aiohttp reads a status line's bytes
    undecodable as UTF-8 as lone surrogates, which httpx-aiohttp then fails to encode (a
    `UnicodeEncodeError` past the proxy's handling, the response never released). Replaced
    as `errors="replace"` would, the reason reads as what it was, and the proxy quotes it."""

    async def start(self, connection: Any) -> aiohttp.ClientResponse:
        started = await super().start(connection)
        if self.reason is not None:
            self.reason = self.reason.encode("utf-8", "replace").decode("utf-8")
        return started


def aiohttp_transport() -> HttpcoreErrors:
    """httpx-aiohttp's transport without keep-alive, raising httpcore's exceptions.

    Without keep-alive: aiohttp hands a pooled connection to the next request without checking
    whether the host closed it, and llama-server closes every connection after a stream while
    saying keep-alive.
    """

    def session() -> aiohttp.ClientSession:
        connector = aiohttp.TCPConnector(limit=0, force_close=True)
        return aiohttp.ClientSession(connector=connector, response_class=_Response)

    return HttpcoreErrors(AiohttpTransport(client=session))
