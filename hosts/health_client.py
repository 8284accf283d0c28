"""`GET /health` on one kept HTTP/1.1 connection per host: the health poller's every round.

The poller asks each host `/health` every interval and needs the status alone. Through an
aiohttp session a GET built URL objects, a request, a response, a writer and timers each time:
most of the idle gateway's CPU with 200 hosts (bench/README.md, issue 20). Here a host's
connection is an asyncio Protocol that is sent one request and reads one answer: the status
line, the head up to its blank line, and a body of `Content-Length` bytes, counted, not kept.
`/props` and `/v1/models` (read once a minute) stay on the poller's aiohttp session.

- One request at a time on a connection. A second caller while the host's is busy (a probe of
  the proxy's during a poll) opens one of its own; one idle connection per host is kept.
- A kept connection that turns out closed is retried once on a new one, when no byte of the
  answer came (llama-server closes a connection idle for 5 s; the close may cross the
  request). A connection seen closed while idle is not used again.
- An answer whose end only the connection's close tells (no `Content-Length`: chunked, or
  HTTP/1.0) gives its status at its head, and the connection is closed rather than kept.
- `timeout` bounds the whole call (connect, a retry, the answer); past it, `TimeoutError`.
  Failures raise what the socket raised (refused, reset, DNS, TLS: OSError and its kinds), or
  `HungUp`, `CutShort`, `Garbled` (ConnectionErrors too): hosts.failures words them all.

One client per event loop; not thread-safe.
"""

from __future__ import annotations

import asyncio
import functools
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from typing import cast
from urllib.parse import urlsplit

HEAD_MAX = 64 * 1024  # bytes of status line and headers before the answer counts as garbled


class HungUp(ConnectionError):
    """The host closed the connection before any byte of its answer."""


class CutShort(ConnectionError):
    """The connection ended inside the answer's head or body."""


class Garbled(ConnectionError):
    """What came back is not an HTTP/1.x answer."""


class _Stale(Exception):
    """A kept connection the host had closed: the request is worth sending again."""


@dataclass(slots=True, frozen=True)
class _Target:
    """Where a URL's request goes, and its request line and Host header."""

    key: tuple[str, str, int]  # scheme, host, port: the connection it may share
    host: str
    port: int
    tls: bool
    head: str  # "GET <path> HTTP/1.1\r\nHost: <host>\r\n"

    def request(self, headers: Mapping[str, str]) -> bytes:
        extra = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
        return f"{self.head}{extra}Accept: */*\r\n\r\n".encode("latin-1")


@functools.lru_cache(maxsize=4096)
def _target(url: str) -> _Target:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {url!r}")
    tls = parts.scheme == "https"
    port = parts.port or (443 if tls else 80)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    netloc = parts.netloc.rpartition("@")[2]
    head = f"GET {path} HTTP/1.1\r\nHost: {netloc}\r\n"
    return _Target((parts.scheme, parts.hostname, port), parts.hostname, port, tls, head)


class HealthClient:
    """`status(url, headers)`: the HTTP status of a GET of `url`, on a kept connection per host.

    `drop(url)` closes the idle connection kept for `url`'s host (a host no longer polled);
    `aclose()` closes every one.
    """

    def __init__(self, timeout: float) -> None:
        self._timeout = timeout
        self._idle: dict[tuple[str, str, int], _Connection] = {}
        self._tls: ssl.SSLContext | None = None

    async def status(self, url: str, headers: Mapping[str, str]) -> int:
        target = _target(url)
        request = target.request(headers)
        async with asyncio.timeout(self._timeout):
            kept = self._idle.pop(target.key, None)
            if kept is not None and not kept.closed:
                try:
                    return await self._exchange(kept, target, request, kept=True)
                except _Stale:
                    pass  # closed by the host as the request went: once more, anew
            return await self._exchange(await self._connect(target), target, request)

    def drop(self, url: str) -> None:
        kept = self._idle.pop(_target(url).key, None)
        if kept is not None:
            kept.close()

    async def aclose(self) -> None:
        for kept in self._idle.values():
            kept.close()
        self._idle.clear()

    async def _connect(self, target: _Target) -> _Connection:
        loop = asyncio.get_running_loop()
        tls = None
        if target.tls:
            tls = self._tls = self._tls or ssl.create_default_context()
        _, connection = await loop.create_connection(_Connection, target.host, target.port, ssl=tls)
        return connection

    async def _exchange(
        self, connection: _Connection, target: _Target, request: bytes, *, kept: bool = False
    ) -> int:
        """The answer's status, the connection kept when it may serve again. `_Stale` when a
        `kept` connection closed before any byte of the answer."""
        try:
            status = await connection.ask(request)
        except (HungUp, ConnectionResetError, BrokenPipeError):
            connection.close()
            if kept and not connection.answered:
                raise _Stale from None
            raise
        except BaseException:  # a timeout or a cancel mid-answer: the connection is unusable
            connection.close()
            raise
        if connection.reusable and target.key not in self._idle:
            self._idle[target.key] = connection
        else:
            connection.close()
        return status


class _Connection(asyncio.Protocol):
    """One HTTP/1.1 connection: `ask(request)` sends it and returns the answer's status."""

    def __init__(self) -> None:
        self._transport: asyncio.Transport | None = None
        self._answer: asyncio.Future[int] | None = None
        self._head = bytearray()
        self._status = 0
        self._body_left = -1  # -1 while the head is read
        self.closed = False
        self.answered = False  # a byte of the current answer came
        self.reusable = False

    async def ask(self, request: bytes) -> int:
        assert self._transport is not None and self._answer is None
        self._answer = asyncio.get_running_loop().create_future()
        self._head.clear()
        self._body_left, self.answered, self.reusable = -1, False, False
        self._transport.write(request)
        try:
            return await self._answer
        finally:
            self._answer = None

    def close(self) -> None:
        self.closed = True
        if self._transport is not None:
            self._transport.close()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A cast, not an isinstance check: uvloop's TCP transport (uvicorn's loop) is no
        # asyncio.Transport subclass, though it has every method of one.
        self._transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._answer is None or self._answer.done():
            return
        if isinstance(exc, OSError):
            self._answer.set_exception(exc)
        elif not self.answered:
            self._answer.set_exception(HungUp("the host closed the connection without answering"))
        else:
            self._answer.set_exception(CutShort("the connection ended inside the answer"))

    def data_received(self, data: bytes) -> None:
        answer = self._answer
        if answer is None or answer.done():
            self.close()  # bytes nobody asked for: nothing after them can be trusted
            return
        self.answered = True
        if self._body_left >= 0:
            self._body_left -= len(data)
            self._end_if_done()
            return
        self._head += data
        try:
            self._read_head()
        except Garbled as exc:
            self.close()
            answer.set_exception(exc)

    def _read_head(self) -> None:
        while (end := self._head.find(b"\r\n\r\n")) >= 0:
            lines = bytes(self._head[:end]).split(b"\r\n")
            rest = len(self._head) - end - 4
            del self._head[: end + 4]
            version, _, status = lines[0].partition(b" ")
            code = status[:3]
            if version not in (b"HTTP/1.1", b"HTTP/1.0") or not code.isdigit():
                raise Garbled(f"not an HTTP answer: {bytes(lines[0][:80])!r}")
            self._status = int(code)
            if 100 <= self._status < 200:
                continue  # an interim answer; the real one follows
            fields = {}
            for line in lines[1:]:
                name, _, value = line.partition(b":")
                fields[name.strip().lower()] = value.strip().lower()
            length = fields.get(b"content-length")
            if self._status in (204, 304):
                length = b"0"
            if length is None or b"transfer-encoding" in fields or not length.isdigit():
                # Only the connection's end would say where this body ends.
                self.reusable = False
                self._body_left = 0
            else:
                self.reusable = version == b"HTTP/1.1" and fields.get(b"connection") != b"close"
                self._body_left = int(length) - rest
            self._end_if_done()
            return
        if len(self._head) > HEAD_MAX:
            raise Garbled(f"no end of the answer's head in {HEAD_MAX} bytes")

    def _end_if_done(self) -> None:
        if self._body_left > 0 or self._answer is None:
            return
        if self._body_left < 0:
            self.reusable = False  # more than the answer: the connection is out of step
        self._answer.set_result(self._status)
