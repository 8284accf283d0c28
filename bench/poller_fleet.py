"""Many llama-server stand-ins in one process, for measuring the health poller.

    python bench/poller_fleet.py --hosts 200

Listens on `--hosts` free ports of 127.0.0.1, prints them as one JSON line, and answers
`GET /health`, `/props` and `/v1/models` on each the way llama-server does where a poller can
tell: a `/props` of the size a real one has (its chat template makes it a few KiB), and the
keep-alive of its HTTP library (cpp-httplib): `Keep-Alive: timeout=5, max=100`, an idle
connection closed after 5 s and any connection after its 100th request (measured on
llama-server b11434). One asyncio protocol per connection and no task per request, so the
fleet costs little next to the poller it serves. Each line read on stdin prints, as one JSON
line, the connections it accepted and the requests it answered by path since the last; the
end of stdin stops it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections import Counter

IDLE_CLOSE = 5.0  # cpp-httplib's keep-alive timeout, which llama-server keeps
MAX_REQUESTS = 100  # and its keep-alive max count

PROPS = {
    "default_generation_settings": {"n_ctx": 4096, "params": {"temperature": 0.8}},
    "total_slots": 4,
    "model_alias": "test-model",
    "model_path": "/models/test-model.gguf",
    "build_info": "b11434-unknown",
    "chat_template": "{% for message in messages %}" + "x" * 3000 + "{% endfor %}",
}
MODELS = {"object": "list", "data": [{"id": "test-model", "object": "model", "owned_by": "me"}]}
BODIES = {
    b"/health": b'{"status":"ok"}',
    b"/props": json.dumps(PROPS).encode(),
    b"/v1/models": json.dumps(MODELS).encode(),
}


def answer(body: bytes | None, last: bool) -> bytes:
    if body is None:
        body, status = b'{"error":"not found"}', b"404 Not Found"
    else:
        status = b"200 OK"
    keep = b"Connection: close\r\n" if last else b"Keep-Alive: timeout=5, max=100\r\n"
    return (
        b"HTTP/1.1 " + status + b"\r\nServer: llama.cpp\r\n"
        b"Content-Type: application/json; charset=utf-8\r\n"
        b"Content-Length: %d\r\n" % len(body) + keep + b"\r\n" + body
    )


class Host(asyncio.Protocol):
    """One connection: GET requests without bodies, answered in order."""

    def __init__(self, seen: Counter[bytes]) -> None:
        self.seen = seen
        self.buffer = b""
        self.served = 0
        self.idle: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.seen[b"connections"] += 1
        self.transport = transport
        self._arm()

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while b"\r\n\r\n" in self.buffer:
            head, _, self.buffer = self.buffer.partition(b"\r\n\r\n")
            path = head.split(b" ", 2)[1].split(b"?")[0]
            self.seen[path] += 1
            self.served += 1
            last = self.served >= MAX_REQUESTS
            self.transport.write(answer(BODIES.get(path), last))
            if last:
                self.transport.close()
                return
        self._arm()

    def _arm(self) -> None:
        if self.idle is not None:
            self.idle.cancel()
        self.idle = asyncio.get_running_loop().call_later(IDLE_CLOSE, self.transport.close)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.idle is not None:
            self.idle.cancel()


async def serve(hosts: int) -> None:
    loop = asyncio.get_running_loop()
    seen: Counter[bytes] = Counter()
    servers = [await loop.create_server(lambda: Host(seen), "127.0.0.1", 0) for _ in range(hosts)]
    ports = [server.sockets[0].getsockname()[1] for server in servers]
    print(json.dumps(ports), flush=True)
    while await loop.run_in_executor(None, sys.stdin.readline):
        print(json.dumps({path.decode(): n for path, n in sorted(seen.items())}), flush=True)
        seen.clear()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=200)
    asyncio.run(serve(parser.parse_args().hosts))


if __name__ == "__main__":
    main()
