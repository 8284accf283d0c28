"""HTTP/1.1 by hand over a socket, for requests no client library would send as written
(raw paths, odd methods, bytes a client would escape) and for leaving at an exact moment."""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit


@dataclass
class Answer:
    status: int
    headers: dict[str, str]  # lower-case names
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def connect(
    url: str, *, rcvbuf: int | None = None, maxseg: int | None = None, timeout: float = 30.0
) -> socket.socket:
    """A socket connected to the gateway at `url`; `rcvbuf` shrinks the receive buffer.

    `maxseg` shrinks the TCP segments the gateway may send it, which also keeps the gateway's
    send buffer for this connection small: Linux sizes it by segments, and on loopback it
    otherwise grows to 4 MiB. With a 4 KiB `rcvbuf` and 536-byte segments, what the kernel holds
    between the gateway and a client that reads little is a few hundred KiB, not megabytes.
    """
    parts = urlsplit(url)
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    if maxseg is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, maxseg)
    sock.settimeout(timeout)
    sock.connect((parts.hostname, parts.port))
    return sock


def request_bytes(
    method: bytes,
    target: bytes,
    body: bytes = b"",
    headers: dict[bytes, bytes] | None = None,
    *,
    keep_alive: bool = False,
) -> bytes:
    connection = b"Connection: keep-alive" if keep_alive else b"Connection: close"
    head = [method + b" " + target + b" HTTP/1.1", b"Host: localhost", connection]
    head += [name + b": " + value for name, value in (headers or {}).items()]
    if body and not any(name.lower() == b"transfer-encoding" for name in headers or {}):
        head.append(b"Content-Length: %d" % len(body))
    return b"\r\n".join(head) + b"\r\n\r\n" + body


def send(
    url: str,
    method: bytes,
    target: bytes,
    body: bytes = b"",
    headers: dict[bytes, bytes] | None = None,
    *,
    rcvbuf: int | None = None,
    maxseg: int | None = None,
    timeout: float = 30.0,
) -> socket.socket:
    """Connect and send one request as written; the socket is left open for the answer."""
    sock = connect(url, rcvbuf=rcvbuf, maxseg=maxseg, timeout=timeout)
    sock.sendall(request_bytes(method, target, body, headers))
    return sock


def read_answer(sock: socket.socket) -> Answer:
    """Read a whole answer until the server closes (requests say Connection: close)."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    sock.close()
    return parse_answer(data)


def read_one_answer(sock: socket.socket) -> Answer:
    """Read one answer with a Content-Length, leaving the connection open (the server may still
    be waiting for the rest of the request)."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536) or _closed()
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(parse_answer(head + b"\r\n\r\n").headers["content-length"])
    while len(body) < length:
        body += sock.recv(65536) or _closed()
    return parse_answer(head + b"\r\n\r\n" + body)


class KeptAlive:
    """One client connection kept alive across requests, read answer by answer as an HTTP/1.1
    client reads them: each by its own framing (Content-Length, or chunked), so whatever a
    server sends past an answer's end is read as the start of the next answer."""

    def __init__(self, url: str, timeout: float = 30.0) -> None:
        self.sock = connect(url, timeout=timeout)
        self._data = b""

    def ask(self, method: bytes, target: bytes, body: bytes = b"", **headers: bytes) -> Answer:
        """Send one request on the connection and read its answer."""
        named = {name.replace("_", "-").encode(): value for name, value in headers.items()}
        self.sock.sendall(request_bytes(method, target, body, named, keep_alive=True))
        return self.read()

    def read(self) -> Answer:
        """The next answer; raises AssertionError on a status line that is not one."""
        head = self._until(b"\r\n\r\n")
        status_line = head.split(b"\r\n", 1)[0]
        assert status_line.startswith(b"HTTP/1.1 "), f"not a status line: {status_line[:80]!r}"
        headers = parse_answer(head).headers
        if headers.get("transfer-encoding") == "chunked":
            body = b""
            while size := int(self._until(b"\r\n")[:-2].split(b";")[0], 16):
                body += self._exactly(size + 2)[:-2]
            while self._until(b"\r\n") != b"\r\n":
                pass  # trailers
        else:
            body = self._exactly(int(headers.get("content-length", "0")))
        return Answer(int(status_line.split(b" ")[1]), headers, body)

    def close(self) -> None:
        self.sock.close()

    def _until(self, mark: bytes) -> bytes:
        while mark not in self._data:
            self._data += self.sock.recv(65536) or _closed()
        found, _, self._data = self._data.partition(mark)
        return found + mark

    def _exactly(self, n: int) -> bytes:
        while len(self._data) < n:
            self._data += self.sock.recv(65536) or _closed()
        found, self._data = self._data[:n], self._data[n:]
        return found


def _closed() -> bytes:
    raise ConnectionError("the server closed the connection before its whole answer")


def parse_answer(data: bytes) -> Answer:
    """An answer from all the bytes the server sent (a chunked body is decoded)."""
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    if headers.get("transfer-encoding") == "chunked":
        body = _unchunk(body)
    return Answer(int(status_line.split(" ")[1]), headers, body)


def exchange(url: str, method: bytes, target: bytes, body: bytes = b"", **kw: Any) -> Answer:
    """Send one request as written and read its whole answer (`kw`: `send`'s)."""
    return read_answer(send(url, method, target, body, **kw))


def _unchunk(data: bytes) -> bytes:
    out = b""
    while data:
        size_line, _, data = data.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            break
        out, data = out + data[:size], data[size + 2 :]
    return out
