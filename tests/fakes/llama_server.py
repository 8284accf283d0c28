"""A fake llama.cpp `llama-server` on a real socket, for end-to-end tests, benchmarks and demos.

It speaks just enough HTTP/1.1, by hand on asyncio streams, that resets, closes and hangs are
exactly what a test asks for. It answers like the real server where the gateway can tell:
OpenAI-shaped completions (streamed as SSE with `timings` and optional `usage`, or whole), a
simulated KV cache (`cache_n` grows with the prompt prefix shared with recent requests), HTTP 500
when more than `slots` completions run at once, and a closed connection after every stream
although the headers say keep-alive.

Tests run it in a background thread with its own event loop (`with FakeLlamaServer() as fake:`)
and turn its knobs from their own thread at any time. Standalone, for `make run` without GPUs:

    python -m tests.fakes.llama_server --port 9001 --slots 4 --token-delay 0.02 --model test-model
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

FAIL_MODES = (None, "refuse", "reset_before_headers", "reset_mid_stream", "error_500", "hang")
HEALTH_STATES = ("ok", "loading", "error")
COMPLETION_KINDS = {"/v1/chat/completions": "chat", "/v1/completions": "text"}
DEFAULT_MAX_TOKENS = 8
# reset_mid_stream cuts the connection after this many token events (or before the last one).
RESET_AFTER_TOKENS = 3
MAX_HEAD_BYTES = 64 * 1024
_TOKEN = "@@TOKEN@@"
_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    500: "Internal Server Error",
    503: "Service Unavailable",
}


@dataclass(slots=True)
class SeenRequest:
    """One request as the fake received it. Header names are lower case."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    json: object | None


@dataclass(slots=True)
class _Generation:
    kind: str
    model: str
    stream: bool
    include_usage: bool
    max_tokens: int
    prompt_n: int
    cache_n: int


class FakeLlamaServer:
    """A llama-server stand-in listening on `host:port` (port 0 picks a free one).

    Knobs, settable from any thread at any time: `health` ("ok" | "loading" | "error"),
    `fail_mode` (see `FAIL_MODES`), `fail_count` (how many completion requests the fail mode
    still applies to; None = all; when it runs out the fake goes back to normal and both reset to
    None), `token_delay` (seconds before each token). Fail modes apply to completion requests
    only, so a gateway's health poller does not use them up; "refuse" is the exception: it closes
    the listening socket (and idle keep-alive connections) so every connect is refused, and
    setting `fail_mode` back to None listens again on the same port. `fail_count` does not apply
    to "refuse".

    Observations: `seen` (every request in arrival order, health polls included), `in_flight`
    and `max_concurrent` (completion requests, over-slot ones included), `disconnects` (requests
    whose client went away before the response finished). `reset_stats()` clears them but for
    `in_flight`. Like llama-server, a request gives its slot back just before its last bytes go
    out, so `in_flight` has dropped by the time a client has read the whole response.

    Hazard, faithfully reproduced: after a stream the connection is closed although the headers
    said keep-alive, so a client that reuses it at once may see "server disconnected".
    """

    def __init__(
        self,
        *,
        slots: int = 4,
        token_delay: float = 0.0,
        models: tuple[str, ...] = ("test-model",),
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        self.slots = slots
        self.token_delay = token_delay
        self.models = models
        self.host = host
        self.port = port
        self.fail_count: int | None = None
        self.seen: list[SeenRequest] = []
        self.in_flight = 0
        self.max_concurrent = 0
        self.disconnects = 0
        self._health = "ok"
        self._fail_mode: str | None = None
        self._stats_lock = threading.Lock()
        self._recent_prompts: deque[tuple[str, ...]] = deque(maxlen=max(slots, 1))
        self._next_id = 0
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[Any]] = set()
        self._idle: set[asyncio.StreamWriter] = set()

    @property
    def url(self) -> str:
        """The base URL, e.g. "http://127.0.0.1:41234"; the port is known once started."""
        return f"http://{self.host}:{self.port}"

    @property
    def health(self) -> str:
        return self._health

    @health.setter
    def health(self, state: str) -> None:
        if state not in HEALTH_STATES:
            raise ValueError(f"health must be one of {HEALTH_STATES}, not {state!r}")
        self._health = state

    @property
    def fail_mode(self) -> str | None:
        return self._fail_mode

    @fail_mode.setter
    def fail_mode(self, mode: str | None) -> None:
        """Set the failure to inject; "refuse" and back take effect before this returns."""
        if mode not in FAIL_MODES:
            raise ValueError(f"fail_mode must be one of {FAIL_MODES}, not {mode!r}")
        was_refusing = self._fail_mode == "refuse"
        self._fail_mode = mode
        if self._loop is not None and was_refusing != (mode == "refuse"):
            self._run_on_loop(self._refuse if mode == "refuse" else self._listen)

    def reset_stats(self) -> None:
        """Forget seen requests, disconnects and the concurrency peak (down to `in_flight`)."""
        with self._stats_lock:
            self.seen.clear()
            self.disconnects = 0
            self.max_concurrent = self.in_flight

    def start(self) -> FakeLlamaServer:
        """Listen in a background thread; returns once connections are accepted."""
        if self._thread is not None:
            raise RuntimeError("FakeLlamaServer already started")
        ready = threading.Event()
        failure: list[BaseException] = []
        self._thread = threading.Thread(
            target=self._run, args=(ready, failure), name="fake-llama-server", daemon=True
        )
        self._thread.start()
        ready.wait()
        if failure:
            self._thread.join()
            self._thread = None
            raise failure[0]
        return self

    def stop(self) -> None:
        """Close the listener and every connection (hung requests included); idempotent."""
        thread, loop = self._thread, self._loop
        if thread is None or loop is None:
            return
        asyncio.run_coroutine_threadsafe(self._shutdown(), loop).result()
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        self._thread = None

    def __enter__(self) -> FakeLlamaServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # Loop and listener. Everything below runs on the fake's own event loop.

    def _run(self, ready: threading.Event, failure: list[BaseException]) -> None:
        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(self._listen())
            if self._fail_mode == "refuse":
                loop.run_until_complete(self._refuse())
        except BaseException as exc:  # handed to start() in the caller's thread
            failure.append(exc)
            loop.close()
            ready.set()
            return
        self._loop = loop
        ready.set()
        try:
            loop.run_forever()
        finally:
            self._loop = None
            loop.close()

    def _run_on_loop(self, action: Callable[[], Awaitable[None]]) -> None:
        assert self._loop is not None
        if self._thread is threading.current_thread():
            self._loop.create_task(action())
        else:
            asyncio.run_coroutine_threadsafe(action(), self._loop).result(timeout=10)

    async def _listen(self) -> None:
        if self._server is not None:
            return
        self._server = await asyncio.start_server(
            self._serve_connection, self.host, self.port, limit=MAX_HEAD_BYTES, reuse_address=True
        )
        self.port = self._server.sockets[0].getsockname()[1]

    async def _refuse(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        # A dead server's idle keep-alive connections die with it.
        for writer in list(self._idle):
            writer.close()

    async def _shutdown(self) -> None:
        await self._refuse()
        tasks = list(self._connections)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        # Let the transports' close callbacks run before the loop stops.
        await asyncio.sleep(0)

    # HTTP.

    async def _serve_connection(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        try:
            while self._fail_mode != "refuse":
                self._idle.add(writer)
                try:
                    request = await _read_request(reader)
                finally:
                    self._idle.discard(writer)
                if request is None:
                    break
                if not await self._respond(*request, reader, writer):
                    break
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        except (ValueError, asyncio.LimitOverrunError):
            with contextlib.suppress(ConnectionError):
                await _send_error(writer, 400, "Malformed request", "invalid_request_error", False)
        finally:
            self._connections.discard(task)
            writer.close()

    async def _respond(
        self,
        request: SeenRequest,
        keep_alive: bool,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> bool:
        """Answer one request; True when the connection stays open for the next one."""
        self.seen.append(request)
        path = request.path.partition("?")[0]
        kind = COMPLETION_KINDS.get(path) if request.method == "POST" else None
        if self._health == "loading":
            # The real server answers every endpoint this way while it loads the model.
            return await _send_error(writer, 503, "Loading model", "unavailable_error", keep_alive)
        if kind is not None:
            return await self._complete(kind, request, reader, writer, keep_alive)
        if request.method == "GET" and path == "/health":
            if self._health == "ok":
                return await _send_json(writer, 200, {"status": "ok"}, keep_alive)
            return await _send_error(writer, 500, "Model failed", "server_error", keep_alive)
        if request.method == "GET" and path == "/v1/models":
            models = [
                {"id": model, "object": "model", "created": 0, "owned_by": "llamacpp"}
                for model in self.models
            ]
            return await _send_json(writer, 200, {"object": "list", "data": models}, keep_alive)
        if request.method == "GET" and path == "/props":
            return await _send_json(writer, 200, self._props(), keep_alive)
        return await _send_error(writer, 404, "File Not Found", "not_found_error", keep_alive)

    def _props(self) -> dict[str, object]:
        return {
            "default_generation_settings": {
                "n_ctx": 4096,
                "model": self.models[0] if self.models else "",
                "params": {"n_predict": -1, "temperature": 0.8},
            },
            "total_slots": self.slots,
            "model_path": f"/models/{self.models[0] if self.models else 'model'}.gguf",
            "build_info": "fake",
        }

    # Completions.

    async def _complete(
        self,
        kind: str,
        request: SeenRequest,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        keep_alive: bool,
    ) -> bool:
        hold = _InFlight(self)
        try:
            failure = self._take_failure()
            if failure == "reset_before_headers":
                hold.release()
                _reset(writer)
                return False
            if failure == "hang":
                await _wait_until_gone(reader)
                self._count_disconnect()
                return False
            if failure == "error_500":
                status, message, error_type = (
                    500,
                    "Internal server error (injected)",
                    "server_error",
                )
            elif self.in_flight > self.slots:
                status, message, error_type = 500, "Context size has been exceeded.", "server_error"
            elif not isinstance(request.json, dict):
                status, message, error_type = 400, "Invalid JSON body", "invalid_request_error"
            else:
                generation = self._generation(kind, request.json)
                cut = failure == "reset_mid_stream"
                if generation.stream:
                    return await self._stream(generation, hold, reader, writer, cut)
                return await self._answer_whole(generation, hold, reader, writer, keep_alive, cut)
            hold.release()
            return await _send_error(writer, status, message, error_type, keep_alive)
        finally:
            hold.release()

    def _take_failure(self) -> str | None:
        mode, count = self._fail_mode, self.fail_count
        if mode is None or mode == "refuse":
            return None
        if count is not None:
            if count <= 1:
                self._fail_mode = None
                self.fail_count = None
            else:
                self.fail_count = count - 1
        return mode

    def _generation(self, kind: str, body: dict[str, Any]) -> _Generation:
        words = tuple(_prompt_text(kind, body).split()) or ("<s>",)
        cached = max((_common_prefix(words, seen) for seen in self._recent_prompts), default=0)
        # The real server re-evaluates at least the last prompt token.
        cache_n = min(cached, len(words) - 1)
        self._recent_prompts.append(words)
        model = body.get("model")
        options = body.get("stream_options")
        return _Generation(
            kind=kind,
            model=model if isinstance(model, str) else (self.models[0] if self.models else ""),
            stream=body.get("stream") is True,
            include_usage=isinstance(options, dict) and options.get("include_usage") is True,
            max_tokens=_max_tokens(body),
            prompt_n=len(words) - cache_n,
            cache_n=cache_n,
        )

    async def _stream(
        self,
        generation: _Generation,
        hold: _InFlight,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        cut: bool,
    ) -> bool:
        """Send SSE token events; the connection is always closed afterwards."""
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: keep-alive\r\n"
            b"Transfer-Encoding: chunked\r\nServer: llama.cpp\r\n\r\n"
        )
        completion_id = self._new_id(generation.kind)
        created = int(time.time())
        before, after = _token_event_template(generation, completion_id, created)
        n = generation.max_tokens
        started = time.perf_counter()
        try:
            # Every token but the last, which carries finish_reason and timings.
            for i in range(n - 1):
                if not await self._next_token(reader, writer):
                    return False
                if cut and i == RESET_AFTER_TOKENS:
                    _reset(writer)
                    return False
                writer.write(_chunk(before + b"tok%d " % i + after))
                await writer.drain()
            if n and not await self._next_token(reader, writer):
                return False
            if cut:
                _reset(writer)
                return False
            last = _document(generation, completion_id, created, _text(max(n - 1, 0), n))
            last["choices"][0]["finish_reason"] = "stop"
            last["timings"] = _timings(generation, n, (time.perf_counter() - started) * 1000)
            end = _chunk(_sse(last))
            if generation.include_usage:
                final = _document(generation, completion_id, created, "")
                final["choices"] = []
                final["usage"] = _usage(generation, n)
                end += _chunk(_sse(final))
            end += _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"
            hold.release()
            writer.write(end)
            await writer.drain()
        except ConnectionError:
            self._count_disconnect()
        return False

    async def _answer_whole(
        self,
        generation: _Generation,
        hold: _InFlight,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        keep_alive: bool,
        cut: bool,
    ) -> bool:
        started = time.perf_counter()
        n = generation.max_tokens
        for _ in range(n):
            if not await self._next_token(reader, writer):
                return False
        elapsed_ms = (time.perf_counter() - started) * 1000
        completion_id = self._new_id(generation.kind)
        document = _document(generation, completion_id, int(time.time()), _text(0, n), whole=True)
        document["usage"] = _usage(generation, n)
        document["timings"] = _timings(generation, n, elapsed_ms)
        response = _json_response(200, document, keep_alive)
        hold.release()
        if cut:
            # Headers and part of the body, then a reset: a non-streamed "mid-stream" failure.
            writer.write(response[: len(response) - len(response) // 4])
            await writer.drain()
            _reset(writer)
            return False
        writer.write(response)
        try:
            await writer.drain()
        except ConnectionError:
            self._count_disconnect()
            return False
        return keep_alive

    async def _next_token(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Wait `token_delay`; False (and counted) when the client has gone meanwhile."""
        if self.token_delay > 0:
            await asyncio.sleep(self.token_delay)
        if reader.at_eof() or writer.transport.is_closing():
            self._count_disconnect()
            return False
        return True

    def _count_disconnect(self) -> None:
        with self._stats_lock:
            self.disconnects += 1

    def _new_id(self, kind: str) -> str:
        self._next_id += 1
        return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-fake{self._next_id}"


class _InFlight:
    """One completion request's place in `in_flight`, given back once.

    Given back just before the response's last bytes are written, as llama-server frees the slot
    before it sends the final result: a client that saw the end may at once send the next
    request without meeting its own previous one in the count.
    """

    __slots__ = ("_server", "_held")

    def __init__(self, server: FakeLlamaServer) -> None:
        self._server = server
        self._held = True
        with server._stats_lock:
            server.in_flight += 1
            server.max_concurrent = max(server.max_concurrent, server.in_flight)

    def release(self) -> None:
        if self._held:
            self._held = False
            with self._server._stats_lock:
                self._server.in_flight -= 1


# Wire helpers.


async def _read_request(reader: asyncio.StreamReader) -> tuple[SeenRequest, bool] | None:
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
    for line in header_lines:
        name, colon, value = line.partition(":")
        if not colon:
            raise ValueError(f"malformed header line {line!r}")
        name, value = name.strip().lower(), value.strip()
        headers[name] = f"{headers[name]}, {value}" if name in headers else value
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
    request = SeenRequest(method=method, path=target, headers=headers, body=body, json=document)
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


async def _wait_until_gone(reader: asyncio.StreamReader) -> None:
    try:
        while await reader.read(65536):
            pass
    except ConnectionError:
        pass


def _reset(writer: asyncio.StreamWriter) -> None:
    """Abort the connection with a TCP RST, as a crashing server would."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


def _json_response(status: int, document: object, keep_alive: bool) -> bytes:
    body = json.dumps(document, separators=(",", ":")).encode()
    head = (
        f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\n"
        "Content-Type: application/json; charset=utf-8\r\n"
        f"Content-Length: {len(body)}\r\n"
        f"Connection: {'keep-alive' if keep_alive else 'close'}\r\n"
        "Server: llama.cpp\r\n\r\n"
    )
    return head.encode() + body


async def _send_json(
    writer: asyncio.StreamWriter, status: int, document: object, keep_alive: bool
) -> bool:
    writer.write(_json_response(status, document, keep_alive))
    await writer.drain()
    return keep_alive


async def _send_error(
    writer: asyncio.StreamWriter, status: int, message: str, kind: str, keep_alive: bool
) -> bool:
    error = {"error": {"code": status, "message": message, "type": kind}}
    return await _send_json(writer, status, error, keep_alive)


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


def _sse(document: object) -> bytes:
    return b"data: " + json.dumps(document, separators=(",", ":")).encode() + b"\n\n"


# Completion documents.


def _prompt_text(kind: str, body: dict[str, Any]) -> str:
    if kind == "text":
        prompt = body.get("prompt")
        if isinstance(prompt, list):
            return " ".join(part for part in prompt if isinstance(part, str))
        return prompt if isinstance(prompt, str) else ""
    parts: list[str] = []
    messages = body.get("messages")
    for message in messages if isinstance(messages, list) else []:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            parts.extend(
                part["text"]
                for part in content
                if isinstance(part, dict) and isinstance(part.get("text"), str)
            )
    return " ".join(parts)


def _common_prefix(a: tuple[str, ...], b: tuple[str, ...]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _max_tokens(body: dict[str, Any]) -> int:
    for key in ("max_tokens", "max_completion_tokens", "n_predict"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
    return DEFAULT_MAX_TOKENS


def _text(first: int, end: int) -> str:
    return "".join(f"tok{i} " for i in range(first, end))


def _document(
    generation: _Generation, completion_id: str, created: int, text: str, *, whole: bool = False
) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "finish_reason": "stop" if whole else None}
    if generation.kind == "text":
        choice |= {"text": text, "logprobs": None}
        obj = "text_completion"
    elif whole:
        choice["message"] = {"role": "assistant", "content": text}
        obj = "chat.completion"
    else:
        choice["delta"] = {"content": text}
        obj = "chat.completion.chunk"
    return {
        "choices": [choice],
        "created": created,
        "id": completion_id,
        "model": generation.model,
        "system_fingerprint": "fake",
        "object": obj,
    }


def _token_event_template(
    generation: _Generation, completion_id: str, created: int
) -> tuple[bytes, bytes]:
    """The bytes around a token's text in its SSE event, so each token costs one concatenation."""
    event = _sse(_document(generation, completion_id, created, _TOKEN))
    before, _, after = event.partition(_TOKEN.encode())
    return before, after


def _usage(generation: _Generation, completion_tokens: int) -> dict[str, Any]:
    prompt_tokens = generation.prompt_n + generation.cache_n
    return {
        "completion_tokens": completion_tokens,
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": generation.cache_n},
    }


def _timings(generation: _Generation, predicted_n: int, predicted_ms: float) -> dict[str, Any]:
    prompt_ms = generation.prompt_n * 0.1
    return {
        "cache_n": generation.cache_n,
        "prompt_n": generation.prompt_n,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / generation.prompt_n,
        "prompt_per_second": 1000 * generation.prompt_n / prompt_ms,
        "predicted_n": predicted_n,
        "predicted_ms": predicted_ms,
        "predicted_per_token_ms": predicted_ms / predicted_n if predicted_n else 0.0,
        "predicted_per_second": 1000 * predicted_n / predicted_ms if predicted_ms else 0.0,
    }


def main(argv: list[str] | None = None) -> None:
    """Serve until Ctrl-C."""
    parser = argparse.ArgumentParser(description="A fake llama-server for trying crossbar.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9001)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--token-delay", type=float, default=0.02, help="seconds per token")
    parser.add_argument("--model", action="append", help="a model to list (repeatable)")
    args = parser.parse_args(argv)
    fake = FakeLlamaServer(
        slots=args.slots,
        token_delay=args.token_delay,
        models=tuple(args.model or ["test-model"]),
        host=args.host,
        port=args.port,
    )
    with fake:
        print(f"fake llama-server on {fake.url} serving {', '.join(fake.models)}; Ctrl-C stops")
        try:
            threading.Event().wait()
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
