"""HTTP/1.1 by hand for the fake llama-server: reading requests, writing answers as it does.

Every answer carries what llama-server's cpp-httplib adds to all of them: `Server: llama.cpp`
and `Access-Control-Allow-Origin` echoing the request's `Origin` (empty when it sent none).
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
from dataclasses import dataclass
from urllib.parse import parse_qsl

MAX_HEAD_BYTES = 64 * 1024
REASONS = {
    200: "OK",
    204: "No Content",
    400: "Bad Request",
    401: "Unauthorized",
    403: "Forbidden",
    404: "Not Found",
    500: "Internal Server Error",
    501: "Not Implemented",
    503: "Service Unavailable",
}
JSON_TYPE = "application/json; charset=utf-8"
# What llama-server answers to every OPTIONS request, before any other check.
PREFLIGHT_HEADERS = (
    ("Access-Control-Allow-Credentials", "true"),
    ("Access-Control-Allow-Methods", "GET, POST, DELETE, OPTIONS"),
    ("Access-Control-Allow-Headers", "*"),
)


@dataclass(slots=True)
class SeenRequest:
    """One request as the fake received it.

    `path` is the request target as sent (query string included); `headers` has lower-case
    names, repeated headers joined with ", "; `header_lines` keeps every header line as sent
    (name in its own case, in order); `json` is the parsed body, None when it is not JSON.
    """

    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    json: object | None
    header_lines: tuple[tuple[str, str], ...] = ()

    @property
    def route(self) -> str:
        """The path without its query string."""
        return self.path.partition("?")[0]

    @property
    def query(self) -> dict[str, str]:
        """The query parameters (the last value of a repeated one)."""
        return dict(parse_qsl(self.path.partition("?")[2], keep_blank_values=True))


async def read_request(reader: asyncio.StreamReader) -> tuple[SeenRequest, bool] | None:
    """The next request on the connection and whether it asks for keep-alive; None at a clean
    EOF between requests. Raises ValueError (or a stream error) on a malformed request."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as exc:
        if exc.partial.strip():
            raise
        return None
    request_line, *header_lines = head[:-4].decode("latin-1").split("\r\n")
    method, target, version = request_line.split(" ")
    headers: dict[str, str] = {}
    lines: list[tuple[str, str]] = []
    for line in header_lines:
        name, colon, value = line.partition(":")
        if not colon:
            raise ValueError(f"malformed header line {line!r}")
        name, value = name.strip(), value.strip()
        lines.append((name, value))
        key = name.lower()
        headers[key] = f"{headers[key]}, {value}" if key in headers else value
    if "chunked" in headers.get("transfer-encoding", "").lower():
        body = await _read_chunked(reader)
    else:
        length = int(headers.get("content-length") or 0)
        body = await reader.readexactly(length) if length else b""
    try:
        document = json.loads(body) if body else None
    except ValueError:
        document = None
    connection = headers.get("connection", "").lower()
    keep_alive = "keep-alive" in connection if version == "HTTP/1.0" else "close" not in connection
    request = SeenRequest(
        method=method,
        path=target,
        headers=headers,
        body=body,
        json=document,
        header_lines=tuple(lines),
    )
    return request, keep_alive


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    body = bytearray()
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
        if size == 0:
            while await reader.readuntil(b"\r\n") != b"\r\n":
                pass  # trailers
            return bytes(body)
        body += await reader.readexactly(size)
        await reader.readexactly(2)


async def wait_until_gone(reader: asyncio.StreamReader) -> None:
    try:
        while await reader.read(65536):
            pass
    except ConnectionError:
        pass


def reset(writer: asyncio.StreamWriter) -> None:
    """Abort the connection with a TCP RST, as a crashing server would."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


def head(
    status: int,
    content_type: str,
    *,
    origin: str,
    keep_alive: bool,
    length: int | None = None,
    extra: tuple[tuple[str, str], ...] = (),
) -> bytes:
    """A response head; chunked when `length` is None."""
    lines = [
        f"HTTP/1.1 {status} {REASONS.get(status, 'Error')}",
        f"Content-Type: {content_type}",
        f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked",
        f"Connection: {'keep-alive' if keep_alive else 'close'}",
        "Server: llama.cpp",
        f"Access-Control-Allow-Origin: {origin}",
        *(f"{name}: {value}" for name, value in extra),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def stream_head(origin: str) -> bytes:
    """The head of an SSE stream: keep-alive is announced, though the connection will close."""
    return head(200, "text/event-stream", origin=origin, keep_alive=True)


def whole_response(
    status: int,
    body: bytes,
    content_type: str,
    *,
    origin: str,
    keep_alive: bool,
    head_only: bool = False,
    extra: tuple[tuple[str, str], ...] = (),
) -> bytes:
    """A complete response with a Content-Length; a HEAD request gets the head alone."""
    start = head(
        status, content_type, origin=origin, keep_alive=keep_alive, length=len(body), extra=extra
    )
    return start if head_only else start + body


def dumps(document: object) -> bytes:
    return json.dumps(document, separators=(",", ":")).encode()


def error_document(status: int, message: str, kind: str) -> dict[str, object]:
    """llama-server's (and OpenAI's) error shape."""
    return {"error": {"code": status, "message": message, "type": kind}}


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


LAST_CHUNK = b"0\r\n\r\n"


def sse(document: object) -> bytes:
    """One unnamed SSE event, as the OpenAI-compatible and native endpoints send them."""
    return b"data: " + dumps(document) + b"\n\n"


def sse_event(event: str, document: object) -> bytes:
    """One named SSE event, as the Responses and Anthropic endpoints send them."""
    return b"event: " + event.encode() + b"\ndata: " + dumps(document) + b"\n\n"
