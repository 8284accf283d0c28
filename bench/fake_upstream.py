"""A lean fake llama-server for benchmarks: streamed chat completions at a few µs per token.

    python bench/fake_upstream.py --port 9001 --token-delay 0.002
    python bench/fake_upstream.py --count 200 --ports-file ports.json   # one process, 200 hosts

The fake of the tests (`tests/fakes/llama_server.py`) models a KV cache, slots and failures;
for that it compares every prompt with the recent ones (with 512 slots, milliseconds per
request) and sleeps a task per token, which on a 2-core machine takes CPU from the gateway it
is meant to measure. This one answers only what a benchmark sends, as llama-server does:
`POST /v1/chat/completions` (SSE when `stream` is true, else one JSON document), `GET /health`,
`GET /v1/models`. A stream's head goes out at once, then one SSE event per token every
`token-delay` seconds (a timer per stream, no task), the last with `finish_reason` and
`timings`, then `data: [DONE]`; and, like llama-server, the connection is closed after every
stream although the head says keep-alive. No slot limit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import time

MODEL = "test-model"
DEFAULT_MAX_TOKENS = 16
STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: keep-alive\r\n"
    b"Transfer-Encoding: chunked\r\nServer: llama.cpp\r\n\r\n"
)
TOKEN = b"@@TOKEN@@"
DONE_AND_END = b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n"


def json_response(status: int, document: object) -> bytes:
    body = json.dumps(document, separators=(",", ":")).encode()
    head = (
        f"HTTP/1.1 {status} {'OK' if status == 200 else 'Error'}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        "Connection: keep-alive\r\nServer: llama.cpp\r\n\r\n"
    )
    return head.encode() + body


def sse_chunk(document: object) -> bytes:
    event = b"data: " + json.dumps(document, separators=(",", ":")).encode() + b"\n\n"
    return b"%x\r\n%b\r\n" % (len(event), event)


def chat_document(number: int, content: str, finish: str | None, whole: bool) -> dict:
    choice: dict[str, object] = {"index": 0, "finish_reason": finish}
    choice["message" if whole else "delta"] = {"role": "assistant", "content": content}
    return {
        "choices": [choice],
        "created": int(time.time()),
        "id": f"chatcmpl-bench{number}",
        "model": MODEL,
        "object": "chat.completion" if whole else "chat.completion.chunk",
    }


def timings(tokens: int, elapsed_ms: float) -> dict[str, float]:
    return {
        "cache_n": 0,
        "prompt_n": 8,
        "prompt_ms": 1.0,
        "predicted_n": tokens,
        "predicted_ms": elapsed_ms,
    }


class Upstream(asyncio.Protocol):
    """One client connection: requests one after the other, each answered whole or streamed."""

    served = 0

    def __init__(self, token_delay: float) -> None:
        self.token_delay = token_delay
        self.transport: asyncio.Transport | None = None
        self.buffer = b""
        self.streaming: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        if self.streaming is not None:
            self.streaming.cancel()
        self.transport = None

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while self.transport is not None and self.streaming is None:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buffer[:end].decode("latin-1").split("\r\n")
            length = 0
            for line in head[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value)
            if len(self.buffer) < end + 4 + length:
                return
            body = self.buffer[end + 4 : end + 4 + length]
            self.buffer = self.buffer[end + 4 + length :]
            method, path = head[0].split(" ")[:2]
            self.answer(method, path.partition("?")[0], body)

    def answer(self, method: str, path: str, body: bytes) -> None:
        assert self.transport is not None
        if method == "GET" and path == "/health":
            self.transport.write(json_response(200, {"status": "ok"}))
        elif method == "GET" and path == "/v1/models":
            models = [{"id": MODEL, "object": "model", "created": 0, "owned_by": "llamacpp"}]
            self.transport.write(json_response(200, {"object": "list", "data": models}))
        elif method == "POST" and path == "/v1/chat/completions":
            try:
                request = json.loads(body)
                tokens = int(request.get("max_tokens") or DEFAULT_MAX_TOKENS)
            except (ValueError, TypeError, AttributeError):
                self.transport.write(json_response(400, {"error": {"message": "bad body"}}))
                return
            Upstream.served += 1
            if request.get("stream") is True:
                self.stream(Upstream.served, tokens)
            else:
                text = "".join(f"tok{i} " for i in range(tokens))
                document = chat_document(Upstream.served, text, "stop", whole=True)
                document["usage"] = {"prompt_tokens": 8, "completion_tokens": tokens}
                document["timings"] = timings(tokens, 0.0)
                self.transport.write(json_response(200, document))
        else:
            self.transport.write(json_response(404, {"error": {"message": "not found"}}))

    def stream(self, number: int, tokens: int) -> None:
        assert self.transport is not None
        self.transport.write(STREAM_HEAD)
        before, _, after = sse_chunk(chat_document(number, TOKEN.decode(), None, False)).partition(
            TOKEN
        )
        # The chunk-size line counts the token's bytes too: rebuild it per token.
        before = before.split(b"\r\n", 1)[1]
        after = after[: -len(b"\r\n")]
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        sent = 0

        def next_token() -> None:
            nonlocal sent
            if self.transport is None:
                return
            if sent < tokens - 1:
                event = before + b"tok%d " % sent + after
                self.transport.write(b"%x\r\n%b\r\n" % (len(event), event))
                sent += 1
                self.streaming = loop.call_later(self.token_delay, next_token)
                return
            last = chat_document(number, f"tok{sent} ", "stop", False)
            last["timings"] = timings(tokens, (time.perf_counter() - started) * 1000)
            end = sse_chunk(last) if tokens else b""
            self.transport.write(end + DONE_AND_END)
            self.transport.close()
            self.streaming = None

        self.streaming = loop.call_later(self.token_delay, next_token)


async def serve(
    host: str, ports: list[int], token_delay: float, ports_file: str | None = None
) -> None:
    """Answer on every port of `ports` (one per host of a benchmark's fleet; 0: one the system
    picks) until a signal. With `ports_file`, the ports listened on are written there as a JSON
    list once all listen."""
    loop = asyncio.get_running_loop()
    servers = [
        await loop.create_server(
            lambda: Upstream(token_delay), host, port, backlog=4096, reuse_address=True
        )
        for port in ports
    ]
    ports = [server.sockets[0].getsockname()[1] for server in servers]
    if ports_file:
        _write_ports(ports, ports_file)
    stop = loop.create_future()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set_result, None)
    where = f"http://{host}:{ports[0]}" + (f" and {len(ports) - 1} more ports" if ports[1:] else "")
    print(f"fake upstream on {where} (pid {os.getpid()})", flush=True)
    await stop
    for server in servers:
        server.close()


def _write_ports(ports: list[int], path: str) -> None:
    """All at once (a reader never sees half of the list)."""
    partial = f"{path}.partial"
    with open(partial, "w") as out:
        json.dump(ports, out)
    os.replace(partial, path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="A lean fake llama-server for benchmarks.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument(
        "--port", type=int, action="append", help="a port to answer on (repeat for more; 9001)"
    )
    parser.add_argument("--token-delay", type=float, default=0.002, help="seconds per token")
    parser.add_argument(
        "--count", type=int, default=0, help="listen on this many ports the system picks"
    )
    parser.add_argument("--ports-file", help="write the ports listened on here (JSON)")
    args = parser.parse_args(argv)
    ports = args.port or ([0] * args.count if args.count else [9001])
    asyncio.run(serve(args.host, ports, args.token_delay, args.ports_file))


if __name__ == "__main__":
    main()
