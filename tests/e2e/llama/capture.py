"""Records how a real llama-server answers every endpoint, for whoever implements the gateway.

    .venv/bin/python -m tests.e2e.llama.capture [--out /tmp/llama-captures]

Starts several llama-servers on the tiny model (plain with --metrics, with an alias, with
--embeddings, with --reranking, with --api-key, with one slot), sends each request over a raw
socket and writes one file per request: the request, the status line, every response header as
sent, and the body's first ~2 KB (and its last KB when longer). SUMMARY.md gathers one line per
request plus what was measured (when the head is sent, whether connections close). Writes
outside the repository on purpose: the captures depend on the llama.cpp version.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tests.e2e.llama.locate import NOT_BUILT, find_binary, vocab_path
from tests.e2e.llama.rawhttp import Exchange, exchange
from tests.e2e.llama.server import BASE_ARGS, LlamaServer, running_llama_server
from tests.e2e.llama.tiny_model import write_tiny_model

HEAD_BYTES = 2048
TAIL_BYTES = 1024
MODEL = "crossbar-tiny"
KEY = "secret"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
ORIGIN = "http://example.com"


@dataclass
class Capture:
    name: str
    instance: str
    method: str
    path: str
    variant: str
    request_headers: dict[str, str]
    body: object | None
    result: Exchange | None
    error: str = ""


@dataclass
class Recorder:
    out: Path
    captures: list[Capture] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def send(
        self,
        server: LlamaServer,
        instance: str,
        method: str,
        path: str,
        body: object | None = None,
        *,
        variant: str = "",
        headers: dict[str, str] | None = None,
        linger: float = 0.3,
    ) -> Exchange | None:
        headers = headers or {}
        slug = re.sub(r"[^A-Za-z0-9]+", "_", path.strip("/")) or "root"
        name = f"{len(self.captures) + 1:03d}-{instance}-{method}-{slug}"
        if variant:
            name += f"-{re.sub(r'[^A-Za-z0-9]+', '_', variant)}"
        capture = Capture(name, instance, method, path, variant, headers, body, None)
        try:
            capture.result = exchange(
                server.port, method, path, headers=headers, body=body, linger=linger
            )
        except (OSError, ValueError) as exc:
            capture.error = f"{type(exc).__name__}: {exc}"
        self.captures.append(capture)
        (self.out / f"{name}.txt").write_text(_render(capture), encoding="utf-8")
        return capture.result

    def note(self, text: str) -> None:
        print(text)
        self.notes.append(text)


def _show_body(body: bytes) -> str:
    def text(b: bytes) -> str:
        return b.decode("utf-8", errors="backslashreplace")

    if len(body) <= HEAD_BYTES + TAIL_BYTES:
        return text(body)
    return (
        text(body[:HEAD_BYTES])
        + f"\n\n[... {len(body) - HEAD_BYTES - TAIL_BYTES} bytes left out ...]\n\n"
        + text(body[-TAIL_BYTES:])
    )


def _render(capture: Capture) -> str:
    lines = [f"# {capture.method} {capture.path}  instance={capture.instance}"]
    if capture.variant:
        lines.append(f"# variant: {capture.variant}")
    lines.append("## request headers")
    lines += [f"{k}: {v}" for k, v in capture.request_headers.items()] or ["(none but Host)"]
    if capture.body is not None:
        shown = capture.body if isinstance(capture.body, bytes) else json.dumps(capture.body)
        lines += ["## request body", str(shown)[:HEAD_BYTES]]
    result = capture.result
    if result is None:
        lines += ["## no response", capture.error]
        return "\n".join(lines) + "\n"
    lines += [
        "## response",
        f"HTTP/1.1 {result.status} {result.reason}",
        *(f"{k}: {v}" for k, v in result.headers),
        "",
        f"## timing: head after {result.head_at * 1000:.1f} ms, first body bytes after "
        + (f"{result.first_body_at * 1000:.1f} ms" if result.first_body_at is not None else "-")
        + f", end after {result.end_at * 1000:.1f} ms",
        f"## body: {len(result.body)} bytes"
        + (f" in {result.chunks} chunks" if result.chunks else "")
        + f"; server closed the connection after it: {result.closed_by_server}",
        _show_body(result.body),
    ]
    return "\n".join(lines) + "\n"


def _shape(result: Exchange) -> str:
    """A short description of a body: JSON keys, or SSE events and their keys."""
    content_type = (result.header("Content-Type") or "").split(";")[0]
    text = result.body.decode("utf-8", errors="replace")
    if content_type == "text/event-stream":
        data = [line[5:].strip() for line in text.splitlines() if line.startswith("data:")]
        events = [line[6:].strip() for line in text.splitlines() if line.startswith("event:")]
        comments = sum(1 for line in text.splitlines() if line.startswith(":"))
        parsed = []
        for item in data:
            with contextlib.suppress(ValueError):
                parsed.append(json.loads(item))
        first = sorted(parsed[0]) if parsed and isinstance(parsed[0], dict) else "-"
        last = sorted(parsed[-1]) if parsed and isinstance(parsed[-1], dict) else "-"
        kinds = sorted(set(events))
        return (
            f"SSE {len(data)} data lines"
            + (f", events {kinds}" if kinds else "")
            + (f", {comments} comment lines" if comments else "")
            + f"; first keys {first}; last keys {last}"
            + ("; ends with [DONE]" if data and data[-1] == "[DONE]" else "; no [DONE]")
        )
    try:
        document = json.loads(text)
    except ValueError:
        return f"{content_type or 'no type'}: {text[:80]!r}"
    if isinstance(document, dict):
        if "error" in document and isinstance(document["error"], dict):
            error = document["error"]
            return f"error {{code: {error.get('code')}, type: {error.get('type')}, message: {str(error.get('message'))[:70]!r}}}"  # noqa: E501
        return f"keys {sorted(document)}"
    if isinstance(document, list):
        inner = sorted(document[0]) if document and isinstance(document[0], dict) else ""
        return f"list of {len(document)} {inner}"
    return repr(document)[:80]


def _summary_line(capture: Capture) -> str:
    what = f"{capture.method} {capture.path}"
    if capture.variant:
        what += f" ({capture.variant})"
    result = capture.result
    if result is None:
        return f"| {capture.instance} | {what} | - | {capture.error} | | |"
    content_type = result.header("Content-Type") or "-"
    framing = f"chunked×{result.chunks}" if result.chunks else f"len {len(result.body)}"
    cors = result.header("Access-Control-Allow-Origin")
    extra = f" ACAO={cors}" if cors else ""
    return (
        f"| {capture.instance} | {what} | {result.status} | {content_type} {framing}{extra} | "
        f"{_shape(result)} | {capture.name}.txt |"
    )


# --------------------------------------------------------------------------- what to send


def capture_plain(rec: Recorder, srv: LlamaServer) -> None:
    """Every endpoint of a plain server (no alias, --metrics)."""
    name = "plain"
    for path in (
        "/health",
        "/v1/health",
        "/props",
        "/slots",
        "/metrics",
        "/v1/models",
        "/models",
        "/lora-adapters",
        "/",
        "/nope",
    ):
        rec.send(srv, name, "GET", path)
    rec.send(srv, name, "HEAD", "/health")
    rec.send(srv, name, "GET", "/v1/chat/completions", variant="wrong method")
    rec.send(srv, name, "POST", "/props", {"n_ctx": 10}, variant="without --props")

    completion = {"prompt": "Once upon a time", "n_predict": 8, "temperature": 0}
    for path in ("/completion", "/completions"):
        rec.send(srv, name, "POST", path, completion)
        rec.send(srv, name, "POST", path, {**completion, "stream": True}, variant="stream")
    oai = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}
    rec.send(srv, name, "POST", "/v1/completions", oai)
    rec.send(srv, name, "POST", "/v1/completions", {**oai, "stream": True}, variant="stream")
    rec.send(
        srv,
        name,
        "POST",
        "/v1/completions",
        {**oai, "stream": True, "stream_options": {"include_usage": True}},
        variant="stream include_usage",
    )
    rec.send(srv, name, "POST", "/v1/completions", {**oai, "n": 2}, variant="n=2")

    chat = {"model": MODEL, "messages": CHAT, "max_tokens": 8, "temperature": 0}
    for path in ("/chat/completions", "/v1/chat/completions"):
        rec.send(srv, name, "POST", path, chat)
        rec.send(
            srv,
            name,
            "POST",
            path,
            {**chat, "stream": True, "stream_options": {"include_usage": True}},
            variant="stream include_usage",
        )
    rec.send(
        srv,
        name,
        "POST",
        "/v1/chat/completions",
        {**chat, "stream": True},
        variant="stream without include_usage",
    )
    rec.send(
        srv,
        name,
        "POST",
        "/v1/chat/completions",
        {**chat, "model": "no-such-model"},
        variant="unknown model name",
    )
    rec.send(
        srv,
        name,
        "POST",
        "/v1/chat/completions",
        {"messages": CHAT, "max_tokens": 4},
        variant="no model field",
    )
    rec.send(srv, name, "POST", "/v1/chat/completions", b"{not json", variant="invalid JSON")
    rec.send(srv, name, "POST", "/v1/chat/completions", {"model": MODEL}, variant="no messages")
    long_prompt = "hello " * 900  # over one slot's 512 tokens
    rec.send(
        srv,
        name,
        "POST",
        "/v1/chat/completions",
        {**chat, "messages": [{"role": "user", "content": long_prompt}]},
        variant="prompt longer than the slot's context",
    )
    rec.send(
        srv,
        name,
        "POST",
        "/v1/chat/completions",
        {**chat, "stream": True, "messages": [{"role": "user", "content": long_prompt}]},
        variant="stream, prompt longer than the slot's context",
    )
    rec.send(
        srv,
        name,
        "POST",
        "/v1/chat/completions",
        {**chat, "max_tokens": 40, "stream": True, "timings_per_token": True},
        variant="stream timings_per_token",
    )

    rec.send(
        srv,
        name,
        "POST",
        "/infill",
        {"input_prefix": "def add(a, b):\n    return ", "input_suffix": "\n", "n_predict": 8},
    )
    rec.send(srv, name, "POST", "/tokenize", {"content": "Hello world"})
    rec.send(
        srv,
        name,
        "POST",
        "/tokenize",
        {"content": "Hello world", "with_pieces": True},
        variant="with_pieces",
    )
    rec.send(srv, name, "POST", "/detokenize", {"tokens": [1, 15043, 3186]})
    rec.send(srv, name, "POST", "/apply-template", {"messages": CHAT})

    for path, body in (
        ("/embedding", {"content": "hello"}),
        ("/embeddings", {"content": "hello"}),
        ("/v1/embeddings", {"model": MODEL, "input": "hello"}),
        ("/rerank", {"query": "q", "documents": ["a", "b"]}),
    ):
        rec.send(srv, name, "POST", path, body, variant="without --embeddings/--reranking")

    responses = {"model": MODEL, "input": "Hello", "max_output_tokens": 8, "temperature": 0}
    for path in ("/v1/responses", "/responses"):
        rec.send(srv, name, "POST", path, responses)
    rec.send(srv, name, "POST", "/v1/responses", {**responses, "stream": True}, variant="stream")

    messages = {
        "model": MODEL,
        "max_tokens": 8,
        "messages": [{"role": "user", "content": "Hi"}],
        "system": "Be brief.",
        "temperature": 0,
    }
    rec.send(srv, name, "POST", "/v1/messages", messages)
    rec.send(srv, name, "POST", "/v1/messages", {**messages, "stream": True}, variant="stream")
    rec.send(
        srv,
        name,
        "POST",
        "/v1/messages/count_tokens",
        {"model": MODEL, "messages": messages["messages"], "system": "Be brief."},
    )
    for path in ("/chat/completions/input_tokens", "/v1/chat/completions/input_tokens"):
        rec.send(srv, name, "POST", path, {"model": MODEL, "messages": CHAT})
    rec.send(srv, name, "POST", "/v1/responses/input_tokens", {"model": MODEL, "input": "Hello"})

    # CORS: a browser's preflight, and a plain request carrying an Origin.
    rec.send(
        srv,
        name,
        "OPTIONS",
        "/v1/chat/completions",
        variant="CORS preflight",
        headers={
            "Origin": ORIGIN,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        },
    )
    rec.send(
        srv,
        name,
        "POST",
        "/v1/chat/completions",
        chat,
        variant="with Origin",
        headers={"Origin": ORIGIN},
    )
    rec.send(
        srv,
        name,
        "GET",
        "/health",
        variant="with localhost Origin",
        headers={"Origin": "http://localhost:3000"},
    )


def capture_alias(rec: Recorder, srv: LlamaServer) -> None:
    for path in ("/props", "/v1/models", "/models"):
        rec.send(srv, "alias", "GET", path)
    rec.send(
        srv,
        "alias",
        "POST",
        "/v1/chat/completions",
        {"model": "other-name", "messages": CHAT, "max_tokens": 2},
        variant="model differs from the alias",
    )


def capture_embeddings(rec: Recorder, srv: LlamaServer) -> None:
    name = "embeddings"
    rec.send(srv, name, "POST", "/embedding", {"content": "hello world"})
    rec.send(srv, name, "POST", "/embeddings", {"content": ["hello", "world"]})
    rec.send(srv, name, "POST", "/v1/embeddings", {"model": MODEL, "input": ["hello", "world"]})
    rec.send(
        srv,
        name,
        "POST",
        "/v1/embeddings",
        {"model": MODEL, "input": "hello", "encoding_format": "base64"},
        variant="base64",
    )
    rec.send(
        srv,
        name,
        "POST",
        "/v1/chat/completions",
        {"model": MODEL, "messages": CHAT, "max_tokens": 4},
        variant="chat on an embeddings server",
    )
    rec.send(srv, name, "GET", "/props")


def capture_rerank(rec: Recorder, srv: LlamaServer) -> None:
    body = {
        "model": MODEL,
        "query": "What is a llama?",
        "documents": ["A llama is an animal.", "Paris is in France.", "hi"],
        "top_n": 2,
    }
    for path in ("/rerank", "/reranking", "/v1/rerank", "/v1/reranking"):
        rec.send(srv, "rerank", "POST", path, body)
    rec.send(
        srv, "rerank", "POST", "/v1/rerank", {**body, "return_text": True}, variant="return_text"
    )


def capture_api_key(rec: Recorder, srv: LlamaServer) -> dict[str, dict[str, int]]:
    """Each endpoint with no key, the right key three ways, and a wrong one: the statuses."""
    variants = {
        "no key": {},
        "Bearer secret": {"Authorization": f"Bearer {KEY}"},
        "X-Api-Key secret": {"X-Api-Key": KEY},
        "Authorization secret (no Bearer)": {"Authorization": KEY},
        "Bearer wrong": {"Authorization": "Bearer wrong"},
    }
    endpoints: list[tuple[str, str, object | None]] = [
        ("GET", "/health", None),
        ("GET", "/v1/health", None),
        ("GET", "/models", None),
        ("GET", "/v1/models", None),
        ("GET", "/props", None),
        ("GET", "/slots", None),
        ("GET", "/metrics", None),
        ("POST", "/tokenize", {"content": "hi"}),
        ("POST", "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 2}),
        (
            "POST",
            "/v1/messages",
            {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]},
        ),
        ("OPTIONS", "/v1/chat/completions", None),
    ]
    table: dict[str, dict[str, int]] = {}
    for method, path, body in endpoints:
        row = table.setdefault(f"{method} {path}", {})
        for variant, headers in variants.items():
            if method == "OPTIONS":
                headers = {**headers, "Origin": ORIGIN, "Access-Control-Request-Method": "POST"}
            result = rec.send(srv, "api-key", method, path, body, variant=variant, headers=headers)
            row[variant] = result.status if result else -1
    return table


# --------------------------------------------------------------------------- measurements


def measure_connections(rec: Recorder, srv: LlamaServer) -> None:
    """Keep-alive: how many requests one connection carries, and how long it may idle."""
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as sock:
        served = 0
        for _ in range(20):
            try:
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                data = b""
                while b"\r\n\r\n" not in data:
                    part = sock.recv(4096)
                    if not part:
                        raise ConnectionError("closed")
                    data += part
                head, _, rest = data.partition(b"\r\n\r\n")
                length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))  # type: ignore[union-attr]  # /health answers have a Content-Length
                while len(rest) < length:
                    rest += sock.recv(4096)
                served += 1
                if b"connection: close" in head.lower():
                    break
            except (ConnectionError, OSError):
                break
    rec.note(f"- keep-alive: one connection carried {served} of 20 sequential GET /health")

    with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        time.sleep(0.5)
        sock.recv(65536)
        started = time.monotonic()
        sock.settimeout(15)
        try:
            closed = sock.recv(1) == b""
        except TimeoutError:
            closed = False
        idle = time.monotonic() - started
    rec.note(
        "- idle keep-alive: "
        + (
            f"the server closed an idle connection after {idle:.1f} s"
            if closed
            else f"an idle connection was still open after {idle:.0f} s"
        )
    )


def _random_words(n: int, seed: int) -> str:
    """A prompt no slot has cached: about one token per word."""
    rng = random.Random(seed)
    words = ("apple", "river", "stone", "cloud", "music", "green", "fast", "slow")
    return " ".join(rng.choice(words) for _ in range(n))


def measure_head_timing(rec: Recorder, srv: LlamaServer) -> None:
    """When a stream's head is sent: with its slot free, and queued behind a busy slot.

    `srv` has one slot. First a 3000-token prompt on the free slot: the head comes when the slot
    takes the task, the first event only after the prompt is evaluated. Then a long generation
    holds the slot and a second stream waits in llama-server's own queue: no head until the
    slot frees.
    """
    for path, body in (
        ("/completion", {"prompt": _random_words(3000, 1), "n_predict": 4, "stream": True}),
        (
            "/v1/chat/completions",
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": _random_words(3000, 2)}],
                "max_tokens": 4,
                "stream": True,
            },
        ),
    ):
        free = rec.send(srv, "one-slot", "POST", path, body, variant="stream, 3000-token prompt")
        if free is not None:
            rec.note(
                f"- free slot, {path} stream with a 3000-token prompt: head after "
                f"{free.head_at * 1000:.0f} ms, first event after "
                f"{(free.first_body_at or 0) * 1000:.0f} ms, end after "
                f"{free.end_at * 1000:.0f} ms -> the head goes out when a slot takes the task, "
                "before the prompt is evaluated; the first event (even the chat role delta) "
                "comes with the first token"
            )

    blocker_body = {
        "prompt": "Once upon a time",
        "n_predict": 3000,
        "ignore_eos": True,
        "stream": True,
        "temperature": 0,
    }
    blocker: dict[str, Exchange] = {}

    def run_blocker() -> None:
        blocker["result"] = exchange(
            srv.port, "POST", "/completion", body=blocker_body, timeout=300
        )

    thread = threading.Thread(target=run_blocker, daemon=True)
    started = time.monotonic()
    thread.start()
    time.sleep(0.3)  # the blocker takes the slot first (it is sent first and starts at once)
    rec.send(srv, "one-slot", "GET", "/slots", variant="while busy")
    rec.send(srv, "one-slot", "GET", "/metrics", variant="while busy")
    sent = time.monotonic() - started
    probe = rec.send(
        srv,
        "one-slot",
        "POST",
        "/v1/chat/completions",
        {"model": MODEL, "messages": CHAT, "max_tokens": 4, "stream": True},
        variant="stream queued behind a 3000-token generation",
    )
    thread.join(timeout=300)
    done = blocker.get("result")
    if probe is None or done is None:
        rec.note("- head timing: the measurement failed (see the one-slot captures)")
        return
    blocker_end = done.end_at - sent
    rec.note(
        f"- busy slot (a 3000-token generation, {done.end_at:.2f} s): a stream sent while it ran "
        f"got its head {probe.head_at:.2f} s after its request and its first event "
        f"{probe.first_body_at or 0:.2f} s after; the blocker ended {blocker_end:.2f} s after "
        "it was sent -> "
        + (
            "a request queued inside llama-server gets no head (and no SSE ping) until a slot "
            "takes it"
            if probe.head_at > 0.5 * blocker_end
            else "the head is sent at once even while queued"
        )
    )


def note_streams(rec: Recorder) -> None:
    streamed = [
        c
        for c in rec.captures
        if c.result
        and c.result.chunks
        and (c.result.header("Content-Type") or "").startswith("text/event-stream")
    ]
    closed = sorted({c.result.closed_by_server for c in streamed if c.result})
    rec.note(
        f"- after a streamed response the server closed the connection: {closed} "
        f"(over {len(streamed)} streams)"
    )
    whole = [c for c in rec.captures if c.result and not c.result.chunks and c.result.body]
    rec.note(
        f"- after a whole response the server closed the connection: "
        f"{sorted({c.result.closed_by_server for c in whole if c.result})}"
    )


def note_headers(rec: Recorder) -> None:
    """Which response headers come back, and which responses say `Connection: close`."""
    answered = [(c, c.result) for c in rec.captures if c.result is not None]
    names: dict[str, int] = {}
    for _, result in answered:
        for key, _ in result.headers:
            names[key] = names.get(key, 0) + 1
    rec.note(
        f"- response header names over {len(answered)} responses: "
        + ", ".join(f"{k} ({n})" for k, n in sorted(names.items()))
    )
    closing = sorted({r.status for _, r in answered if (r.header("Connection") or "") == "close"})
    rec.note(f"- statuses sent with `Connection: close`: {closing}")
    empty = sum(
        1
        for c, result in answered
        if "Origin" not in c.request_headers and result.header("Access-Control-Allow-Origin") == ""
    )
    rec.note(f"- responses to requests without Origin carrying an empty ACAO header: {empty}")


def note_metrics(rec: Recorder) -> None:
    for capture in rec.captures:
        wanted = (capture.instance, capture.variant) in (("plain", ""), ("one-slot", "while busy"))
        if capture.path == "/metrics" and capture.result and wanted:
            text = capture.result.body.decode("utf-8", errors="replace")
            samples = [line for line in text.splitlines() if line and not line.startswith("#")]
            where = f"{capture.instance}, {capture.variant or 'idle'}"
            rec.note(f"- /metrics ({where}): " + "; ".join(samples))


def note_props(rec: Recorder) -> None:
    for capture in rec.captures:
        if capture.instance == "api-key" or capture.result is None:
            continue
        if capture.method == "GET" and capture.path in ("/props", "/v1/models"):
            try:
                document = capture.result.json()
            except ValueError:
                continue
            if capture.path == "/props" and isinstance(document, dict):
                settings = document.get("default_generation_settings") or {}
                rec.note(
                    f"- /props ({capture.instance}): total_slots={document.get('total_slots')}, "
                    f"n_ctx={settings.get('n_ctx')}, model_path={document.get('model_path')!r}, "
                    f"model_alias={document.get('model_alias')!r}, "
                    f"build_info={document.get('build_info')!r}, keys={sorted(document)}"
                )
            elif isinstance(document, dict):
                ids = [m.get("id") for m in document.get("data", []) if isinstance(m, dict)]
                rec.note(
                    f"- /v1/models ({capture.instance}): ids={ids}; {json.dumps(document)[:400]}"
                )


# --------------------------------------------------------------------------- the run


def write_summary(
    rec: Recorder, version: str, args: dict[str, list[str]], keys: dict[str, dict[str, int]]
) -> Path:
    lines = [
        "# How llama-server answers",
        "",
        f"`{version}`, tiny random model (tests/e2e/llama/tiny_model.py). Instances:",
        "",
        *(f"- **{name}**: `llama-server {' '.join(a)}`" for name, a in args.items()),
        "",
        "## Findings",
        "",
        *rec.notes,
        "",
        "## With `--api-key secret`: statuses",
        "",
        "| endpoint | " + " | ".join(next(iter(keys.values()))) + " |",
        "|---" * (1 + len(next(iter(keys.values())))) + "|",
        *(
            f"| {ep} | " + " | ".join(str(s) for s in row.values()) + " |"
            for ep, row in keys.items()
        ),
        "",
        "## Every request",
        "",
        "| instance | request | status | type, framing | shape | file |",
        "|---|---|---|---|---|---|",
        *(_summary_line(c) for c in rec.captures),
        "",
    ]
    path = rec.out / "SUMMARY.md"
    path.write_text("\n".join(lines), encoding="utf-8")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/llama-captures"))
    args = parser.parse_args(argv)
    binary = find_binary()
    vocab = vocab_path()
    if binary is None or vocab is None:
        print(f"capture: {NOT_BUILT}", file=sys.stderr)
        return 2
    if args.out.exists():
        shutil.rmtree(args.out)
    args.out.mkdir(parents=True)
    version = subprocess.run([str(binary), "--version"], capture_output=True, text=True)
    version_line = " ".join((version.stdout + version.stderr).split())
    rec = Recorder(args.out)

    with tempfile.TemporaryDirectory(prefix="llama-capture-") as tmp:
        work = Path(tmp)
        model = write_tiny_model(work / "tiny.gguf", vocab)
        instances: dict[str, tuple[tuple[str, ...], tuple[str, ...], str | None]] = {
            "plain": (BASE_ARGS, ("--metrics",), None),
            "alias": (BASE_ARGS, (), MODEL),
            "embeddings": (BASE_ARGS, ("--embeddings", "--pooling", "mean"), MODEL),
            "rerank": (BASE_ARGS, ("--reranking",), MODEL),
            "api-key": (BASE_ARGS, ("--api-key", KEY, "--metrics"), MODEL),
            "one-slot": (("-np", "1", "-t", "1", "-c", "8192", "--no-ui"), ("--metrics",), MODEL),
        }
        shown = {
            name: [*base, *extra, *(["--alias", a] if a else [])]
            for name, (base, extra, a) in instances.items()
        }
        keys: dict[str, dict[str, int]] = {}

        @contextlib.contextmanager
        def start(name: str) -> Iterator[LlamaServer]:
            base, extra, alias = instances[name]
            with running_llama_server(binary, model, work, extra, base=base, alias=alias) as srv:
                yield srv
            shutil.copy(srv.log_path, args.out / f"server-{name}.log")

        with start("plain") as srv:
            capture_plain(rec, srv)
            measure_connections(rec, srv)
        with start("alias") as srv:
            capture_alias(rec, srv)
        with start("embeddings") as srv:
            capture_embeddings(rec, srv)
        with start("rerank") as srv:
            capture_rerank(rec, srv)
        with start("api-key") as srv:
            keys = capture_api_key(rec, srv)
        with start("one-slot") as srv:
            measure_head_timing(rec, srv)
        note_streams(rec)
        note_headers(rec)
        note_metrics(rec)
        note_props(rec)
        summary = write_summary(rec, version_line, shown, keys)
    print(f"{len(rec.captures)} captures and {summary} in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
