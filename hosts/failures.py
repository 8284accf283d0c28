"""A failed exchange with a host, in crossbar's words rather than its HTTP library's.

The proxy's transports (httpx's httpcore, aiohttp) and the health poller (its own `/health`
client, aiohttp for the rest) word the same failure differently, and sometimes misleadingly:
aiohttp reports a refused plain-HTTP connect as `Cannot connect to host 10.0.0.5:8080
ssl:default [Connect call failed ...]`, which reads like a TLS problem; httpcore says `All
connection attempts failed`. They keep the operating system's error in the exception's chain
(`raise ... from`), or raise it as it is, so `failure` reads that instead: the errno, the
resolver's or TLS's own error, a timeout. Pure: standard library only.
"""

from __future__ import annotations

import errno
import os
import re
import socket
import ssl
from collections.abc import Iterator

# What an operator should read for the errors a connect or an exchange usually meets.
_ERRNO = {
    errno.ECONNREFUSED: "connection refused (nothing listens at the host's address and port)",
    errno.ECONNRESET: "connection reset by the host",
    errno.ECONNABORTED: "connection aborted",
    errno.EPIPE: "the host closed the connection while the request was sent",
    errno.ETIMEDOUT: "connect timed out",
    errno.EHOSTUNREACH: "host unreachable (no route to its address)",
    errno.ENETUNREACH: "network unreachable",
    errno.EHOSTDOWN: "host is down",
}
_ERRNO_IN_TEXT = re.compile(r"\[Errno (\d+)\]")  # asyncio's "Multiple exceptions: [Errno 111] ..."
# aiohttp's and hosts.health_client's exceptions for a body cut short, and for a host that
# hung up before its head, by name (this module imports no HTTP client); httpcore says so in
# words of its own.
_CUT_SHORT = frozenset(
    {"ClientPayloadError", "TransferEncodingError", "ContentLengthError", "CutShort"}
)
_HUNG_UP = frozenset({"ServerDisconnectedError", "HungUp"})
_TLS_PLAIN = ("WRONG_VERSION_NUMBER", "record layer failure", "http request")


def failure(exc: BaseException) -> str:
    """What went wrong talking to a host, e.g. `connection refused (nothing listens ...)`,
    `the host's name does not resolve`, `TLS handshake failed: ...`, `no answer in time`; for
    anything else the innermost message with its exception's name."""
    chain = list(_chain(exc))
    # Innermost first: aiohttp's own errors subclass SSLError and OSError with their text.
    for link in reversed(chain):
        if isinstance(link, ssl.SSLError):
            return _tls(link)
        if isinstance(link, socket.gaierror):
            return "the host's name does not resolve (DNS)"
    for link in chain:
        if isinstance(link, OSError) and (code := _errno(link)) is not None:
            return _ERRNO.get(code) or os.strerror(code).lower()
    names = {type(link).__name__ for link in chain}
    if names & _CUT_SHORT:
        return "the connection ended before the whole response arrived"
    if names & _HUNG_UP:
        return "the host closed the connection without answering"
    timed_out = any(isinstance(link, TimeoutError) for link in chain)
    if timed_out or any("Timeout" in name for name in names):
        return "no answer in time"
    inner = next((link for link in reversed(chain) if str(link)), exc)
    text = str(inner)
    return f"{type(inner).__name__}: {text}" if text else type(inner).__name__


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """`exc` and its causes, outermost first (each once)."""
    seen: set[int] = set()
    link: BaseException | None = exc
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        yield link
        link = link.__cause__ or link.__context__


def _errno(error: OSError) -> int | None:
    if error.errno is not None and error.errno > 0:
        return error.errno
    found = _ERRNO_IN_TEXT.search(str(error))
    return int(found.group(1)) if found else None


def _tls(error: ssl.SSLError) -> str:
    reason = error.reason or str(error)
    if isinstance(error, ssl.SSLCertVerificationError):
        return f"TLS certificate not accepted: {error.verify_message or reason}"
    if any(mark in str(error) for mark in _TLS_PLAIN):
        # What a TLS client reads when the server answers in plain HTTP.
        return f"TLS handshake failed ({reason}): the host speaks plain HTTP (use http://)"
    return f"TLS handshake failed: {reason}"
