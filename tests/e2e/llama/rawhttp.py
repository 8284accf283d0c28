"""One HTTP/1.1 exchange over a plain socket, seen as the wire shows it.

httpx hides what the captures are about (header order and case, chunked framing, when the head
arrives, whether the server closes the connection), so the captures speak HTTP themselves.
"""

from __future__ import annotations

import json
import socket
import time
from dataclasses import dataclass, field


@dataclass
class Exchange:
    """What came back. Times are seconds since the request's last byte was sent."""

    status: int
    reason: str
    headers: list[tuple[str, str]]
    body: bytes  # de-chunked
    chunks: int  # chunked-encoding chunks (0 when the body had a Content-Length)
    head_at: float
    first_body_at: float | None
    end_at: float
    closed_by_server: bool  # the server closed the connection after this response
    raw_head: bytes = field(repr=False, default=b"")

    def header(self, name: str) -> str | None:
        for key, value in self.headers:
            if key.lower() == name.lower():
                return value
        return None

    def json(self) -> object:
        return json.loads(self.body)


class _Reader:
    def __init__(self, sock: socket.socket, sent_at: float) -> None:
        self.sock = sock
        self.buffer = b""
        self.sent_at = sent_at
        self.eof = False

    def fill(self) -> bool:
        data = self.sock.recv(65536)
        if not data:
            self.eof = True
            return False
        self.buffer += data
        return True

    def until(self, marker: bytes) -> bytes:
        while marker not in self.buffer:
            if not self.fill():
                raise ConnectionError(f"connection closed before {marker!r}")
        head, _, self.buffer = self.buffer.partition(marker)
        return head

    def exactly(self, n: int) -> bytes:
        while len(self.buffer) < n:
            if not self.fill():
                raise ConnectionError("connection closed mid-body")
        data, self.buffer = self.buffer[:n], self.buffer[n:]
        return data

    def rest(self) -> bytes:
        while self.fill():
            pass
        data, self.buffer = self.buffer, b""
        return data

    def now(self) -> float:
        return time.monotonic() - self.sent_at


def exchange(
    port: int,
    method: str,
    path: str,
    *,
    headers: dict[str, str] | None = None,
    body: object | None = None,
    timeout: float = 60.0,
    linger: float = 1.0,
) -> Exchange:
    """Send one request to 127.0.0.1:`port` and read the whole response.

    `body` is sent as JSON when it is not bytes. After the response, waits up to `linger`
    seconds to see whether the server closes the connection on its own.
    """
    payload = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    lines = [f"{method} {path} HTTP/1.1", f"Host: 127.0.0.1:{port}"]
    sent_headers = dict(headers or {})
    if payload is not None:
        sent_headers.setdefault("Content-Type", "application/json")
        sent_headers["Content-Length"] = str(len(payload))
    lines += [f"{key}: {value}" for key, value in sent_headers.items()]
    request = ("\r\n".join(lines) + "\r\n\r\n").encode() + (payload or b"")

    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(request)
        reader = _Reader(sock, time.monotonic())
        raw_head = reader.until(b"\r\n\r\n")
        head_at = reader.now()
        status_line, *header_lines = raw_head.decode("latin-1").split("\r\n")
        _, status, *reason = status_line.split(" ", 2)
        response_headers = [
            (key.strip(), value.strip())
            for key, _, value in (line.partition(":") for line in header_lines)
        ]
        lookup = {key.lower(): value for key, value in response_headers}
        first_body_at: float | None = None
        chunks = 0
        parts: list[bytes] = []
        if method == "HEAD" or status.startswith("1") or status in ("204", "304"):
            pass
        elif "chunked" in lookup.get("transfer-encoding", "").lower():
            while True:
                size_line = reader.until(b"\r\n")
                size = int(size_line.split(b";")[0], 16)
                if size == 0:
                    reader.until(b"\r\n")  # no trailers expected: the empty line
                    break
                parts.append(reader.exactly(size))
                reader.exactly(2)
                chunks += 1
                if first_body_at is None:
                    first_body_at = reader.now()
        elif "content-length" in lookup:
            length = int(lookup["content-length"])
            if length:
                parts.append(reader.exactly(length))
                first_body_at = reader.now()
        else:
            parts.append(reader.rest())
            first_body_at = reader.now() if parts[0] else None
        end_at = reader.now()

        closed = reader.eof
        if not closed:
            sock.settimeout(linger)
            try:
                closed = sock.recv(1) == b""
            except TimeoutError:
                closed = False
            except ConnectionResetError:
                closed = True

    return Exchange(
        status=int(status),
        reason=reason[0] if reason else "",
        headers=response_headers,
        body=b"".join(parts),
        chunks=chunks,
        head_at=head_at,
        first_body_at=first_body_at,
        end_at=end_at,
        closed_by_server=closed,
        raw_head=raw_head,
    )
