"""A fake llama.cpp `llama-server` on a real socket, for end-to-end tests, benchmarks and demos.

It speaks HTTP/1.1 by hand on asyncio streams, so that resets, closes and hangs are exactly
what a test asks for, and answers every endpoint llama-server serves the way it does where a
client can tell (see `ROUTES`): OpenAI's chat completions, completions, embeddings, Responses
and models (with and without `/v1`), reranking, Anthropic's messages and token counting,
llama-server's native `/completion`, `/infill`, `/tokenize`, `/detokenize`,
`/apply-template`, `/embedding`, `/props`, `/slots`, `/metrics`, `/lora-adapters` and
`/health`, CORS preflights, the `--api-key` check, and router mode (`--models-dir`,
`--models-max`) with `/models/load` and `/models/unload`.

What it simulates: the KV cache of a llama-server started as docs/config.md says (`-np`,
`--cache-ram`, `--slot-prompt-similarity 0.95`), where a conversation finds its history in its
slot or, when another took the slot, in the prompt cache: `cache_n` is the longest prompt
prefix, in words, shared with one of the last `slots + cache_ram` prompts (`cache_ram=0` keeps
what the slots alone hold); every prompt starts with the same token, as a chat template's or
a BOS does, so a host that holds any prompt reports at least that one cached;
`forget_cache()` empties it all, as a restart does), `slots` requests at a time (one more gets
HTTP 500), a request naming a busy slot (`id_slot`) waiting for that slot however idle the
others (llama-server defers its task until that slot is free), a closed connection after
every stream although the headers say keep-alive, and model loads in router mode.

Tests run it in a background thread with its own event loop (`with FakeLlamaServer() as fake:`)
and turn its knobs from their own thread at any time. Standalone, for `make run` without GPUs:

    python -m tests.fakes.llama_server --port 9001 --slots 4 --token-delay 0.02 --model test-model
    python -m tests.fakes.llama_server --port 9002 --router-model a --router-model b --models-max 1
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from types import TracebackType
from typing import Any

from tests.fakes import llama_docs as docs
from tests.fakes.llama_formats import FORMATS, Format, Generation
from tests.fakes.llama_router import LoadFailed, ModelTable
from tests.fakes.llama_wire import (
    JSON_TYPE,
    LAST_CHUNK,
    MAX_HEAD_BYTES,
    PREFLIGHT_HEADERS,
    SeenRequest,
    chunk,
    dumps,
    error_document,
    head,
    read_request,
    reset,
    stream_head,
    wait_until_gone,
    whole_response,
)

__all__ = ["FAIL_MODES", "HEALTH_STATES", "ROUTES", "FakeLlamaServer", "SeenRequest", "main"]

FAIL_MODES = (
    None, "refuse", "reset_before_headers", "reset_mid_stream", "error_500", "hang",
    "odd_status", "short_stream",
)  # fmt: skip
HEALTH_STATES = ("ok", "loading", "error")
DEFAULT_MAX_TOKENS = 8
# The token every prompt starts with (a BOS, a chat template's opening): a host holding any
# prompt has at least this one of the next, as llama-server reports.
OPENING = "<s>"
# Prompts `--cache-ram` keeps beyond the slots: its default 8 GiB holds hundreds of a small
# model's short conversations, so trying crossbar with the fake loses none to it.
CACHE_RAM_PROMPTS = 256
# reset_mid_stream cuts the connection after this many token events (or before the last one).
RESET_AFTER_TOKENS = 3
# short_stream sends this event of a stream whose Content-Length says this many bytes more.
SHORT_STREAM_EVENT = b'data: {"choices":[{"index":0,"delta":{"content":"Hi"}}]}\n\n'
SHORT_STREAM_MISSING = 42
# The paths llama-server answers without an API key (besides its web UI's files).
PUBLIC_PATHS = frozenset({"/health", "/v1/health", "/models", "/v1/models"})
# Long waits (first token, model loads) look this often whether the client is still there.
_POLL = 0.05
_NOT_SUPPORTED = "not_supported_error"
_INVALID = "invalid_request_error"

# (method, path) -> (handler name, argument, proxied): a proxied route is, in router mode,
# answered by the model the request names (body "model", or "?model=" for GET).
ROUTES: dict[tuple[str, str], tuple[str, str, bool]] = {
    ("GET", "/health"): ("_health_answer", "", False),
    ("GET", "/v1/health"): ("_health_answer", "", False),
    ("GET", "/models"): ("_models_answer", "", False),
    ("GET", "/v1/models"): ("_models_answer", "", False),
    ("GET", "/props"): ("_props_answer", "", False),
    ("POST", "/props"): ("_props_change", "", True),
    ("GET", "/slots"): ("_slots_answer", "", True),
    ("GET", "/metrics"): ("_metrics_answer", "", True),
    ("GET", "/lora-adapters"): ("_lora_answer", "", True),
    ("POST", "/lora-adapters"): ("_lora_change", "", True),
    ("POST", "/completion"): ("_generate", "native", True),
    ("POST", "/completions"): ("_generate", "native", True),
    ("POST", "/infill"): ("_generate", "infill", True),
    ("POST", "/v1/completions"): ("_generate", "text", True),
    ("POST", "/chat/completions"): ("_generate", "chat", True),
    ("POST", "/v1/chat/completions"): ("_generate", "chat", True),
    ("POST", "/responses"): ("_generate", "responses", True),
    ("POST", "/v1/responses"): ("_generate", "responses", True),
    ("POST", "/v1/messages"): ("_generate", "anthropic", True),
    ("POST", "/chat/completions/input_tokens"): ("_count_tokens", "chat", True),
    ("POST", "/v1/chat/completions/input_tokens"): ("_count_tokens", "chat", True),
    ("POST", "/responses/input_tokens"): ("_count_tokens", "responses", True),
    ("POST", "/v1/responses/input_tokens"): ("_count_tokens", "responses", True),
    ("POST", "/v1/messages/count_tokens"): ("_count_tokens", "anthropic", True),
    ("POST", "/embedding"): ("_embeddings", "native", True),
    ("POST", "/embeddings"): ("_embeddings", "native", True),
    ("POST", "/v1/embeddings"): ("_embeddings", "oai", True),
    ("POST", "/rerank"): ("_rerank", "", True),
    ("POST", "/reranking"): ("_rerank", "", True),
    ("POST", "/v1/rerank"): ("_rerank", "", True),
    ("POST", "/v1/reranking"): ("_rerank", "", True),
    ("POST", "/tokenize"): ("_tokenize", "", True),
    ("POST", "/detokenize"): ("_detokenize", "", True),
    ("POST", "/apply-template"): ("_apply_template", "", True),
}
# Only a router serves these.
ROUTER_ROUTES: dict[tuple[str, str], tuple[str, str, bool]] = {
    ("POST", "/models/load"): ("_model_load", "", False),
    ("POST", "/models/unload"): ("_model_unload", "", False),
}


class _Call:
    """One request being answered: what came in, where the answer goes, and how to write it."""

    __slots__ = ("request", "reader", "writer", "keep_alive", "head_only", "origin", "model")

    def __init__(
        self,
        request: SeenRequest,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        keep_alive: bool,
    ) -> None:
        self.request = request
        self.reader = reader
        self.writer = writer
        self.keep_alive = keep_alive
        self.head_only = request.method == "HEAD"
        self.origin = request.headers.get("origin", "")
        # The model instance that answers, in router mode; None for a single-model server.
        self.model: str | None = None

    def whole(
        self,
        status: int,
        body: bytes,
        content_type: str = JSON_TYPE,
        extra: tuple[tuple[str, str], ...] = (),
    ) -> bytes:
        return whole_response(
            status,
            body,
            content_type,
            origin=self.origin,
            keep_alive=self.keep_alive,
            head_only=self.head_only,
            extra=extra,
        )

    async def send(
        self,
        status: int,
        body: bytes,
        content_type: str = JSON_TYPE,
        extra: tuple[tuple[str, str], ...] = (),
    ) -> bool:
        """Write a whole answer; True when the connection stays open for the next request."""
        self.writer.write(self.whole(status, body, content_type, extra))
        await self.writer.drain()
        return self.keep_alive

    async def json(self, status: int, document: object) -> bool:
        return await self.send(status, dumps(document))

    async def error(self, status: int, message: str, kind: str) -> bool:
        return await self.json(status, error_document(status, message, kind))

    def body(self) -> dict[str, Any] | None:
        document = self.request.json
        return document if isinstance(document, dict) else None


class FakeLlamaServer:
    """A llama-server stand-in listening on `host:port` (port 0 picks a free one).

    Options: `slots` (its `-np`), `cache_ram` (prompts its `--cache-ram` keeps beyond the
    slots'), `token_delay` (seconds before each token), `models` (the
    names a single-model server answers to and lists, each as a model of its own), `aliases`
    (other names of its first model, like `--alias first,other`: listed in its entry),
    `api_key` (like `--api-key`; several keys comma-separated), `first_token_delay` (seconds
    between a stream's head and its first event; a whole answer waits it too), `metrics`,
    `slots_endpoint`, `props` (like `--metrics`, `--no-slots`, `--props`), `embeddings` and
    `reranking` (whether those endpoints work or answer 501), `lora_adapters` (paths of
    `--lora` adapters). Router mode,
    when `router_models` names the models it can load: `models_max` (0: no limit),
    `load_delay` (seconds a load takes), `models_autoload`, `load_on_startup` (models loading
    from the start), `failing_models` (whose loads fail).

    Knobs, settable from any thread at any time: `health` ("ok" | "loading" | "error"),
    `fail_mode` (see `FAIL_MODES`), `fail_count` (how many slot-taking requests the fail mode
    still applies to; None = all; when it runs out the fake goes back to normal and both reset
    to None), `odd_status` (what "odd_status" answers after `HTTP/1.1 `, e.g. "999 Weird",
    in UTF-8, a surrogate escape as its raw byte: a status no HTTP client should relay;
    "short_stream" sends an SSE stream's head with a Content-Length, then
    `SHORT_STREAM_EVENT`, `SHORT_STREAM_MISSING` bytes short of it, and closes),
    `token_delay`, `first_token_delay`, `prompt_token_ms` (what the timings say each
    evaluated prompt token took: 0.1 ms, 10,000 a second; reported, not waited), `cache_n_said`
    (what the answers say came from the cache, in place of the cache's own count), `api_key`,
    `load_delay`, `models_max`, `models_autoload`, `failing_models`; `props_open` (an Event,
    set at first: while it is clear, `/props` answers only once it is set again, as a host's
    first read may be slow); `forget_cache()` empties its KV cache. Fail modes apply to
    requests that take a slot (generations, embeddings, reranking) only, so a gateway's
    health poller does not use them up; "refuse" is the exception: it closes the listening
    socket (and idle keep-alive connections) so every connect is refused, and setting
    `fail_mode` back to None listens again on the same port.
    `fail_count` does not apply to "refuse".

    Observations: `seen` (every request in arrival order, with its method, path, headers and
    body; health polls included), `in_flight` and `max_concurrent` (requests holding a slot,
    over-slot ones included), `disconnects` (requests whose client went away before the
    response finished), `model_status(name)` in router mode; `requests_to(path)` filters
    `seen`. `reset_stats()` clears them but
    for `in_flight`. Like llama-server, a request gives its slot back just before its last
    bytes go out, so `in_flight` has dropped by the time a client has read the whole response.

    Hazard, faithfully reproduced: after a stream the connection is closed although the headers
    said keep-alive, so a client that reuses it at once may see "server disconnected".
    """

    def __init__(
        self,
        *,
        slots: int = 4,
        cache_ram: int = CACHE_RAM_PROMPTS,
        token_delay: float = 0.0,
        models: tuple[str, ...] = ("test-model",),
        aliases: tuple[str, ...] = (),
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
        first_token_delay: float = 0.0,
        metrics: bool = True,
        slots_endpoint: bool = True,
        props: bool = False,
        embeddings: bool = True,
        reranking: bool = True,
        lora_adapters: tuple[str, ...] = (),
        router_models: tuple[str, ...] = (),
        models_max: int = 4,
        load_delay: float = 0.0,
        models_autoload: bool = True,
        load_on_startup: tuple[str, ...] = (),
        failing_models: frozenset[str] = frozenset(),
    ) -> None:
        _check_options(slots, token_delay, first_token_delay, models_max, load_delay)
        _check_router(router_models, models_max, load_on_startup, failing_models)
        self.slots = slots
        self.cache_ram = cache_ram
        self.token_delay = token_delay
        self.first_token_delay = first_token_delay
        self.prompt_token_ms = 0.1
        self.cache_n_said: int | None = None
        self.models = models
        self.aliases = aliases
        self.host = host
        self.port = port
        self.api_key = api_key
        self.metrics = metrics
        self.slots_endpoint = slots_endpoint
        self.props = props
        self.embeddings = embeddings
        self.reranking = reranking
        self.lora_adapters = lora_adapters
        self.router_models = router_models
        self.models_max = models_max
        self.load_delay = load_delay
        self.models_autoload = models_autoload
        self.load_on_startup = load_on_startup
        self.failing_models = set(failing_models)
        self.fail_count: int | None = None
        self.props_open = threading.Event()
        self.props_open.set()
        self.odd_status = "999 Weird"
        self.seen: list[SeenRequest] = []
        self.in_flight = 0
        self.max_concurrent = 0
        self.disconnects = 0
        self._health = "ok"
        self._fail_mode: str | None = None
        self._stats_lock = threading.Lock()
        # Per model instance (None: the single model): recent prompts, busy slots, counters.
        self._recent: dict[str | None, deque[tuple[str, ...]]] = {}
        self._busy: dict[str | None, dict[int, _InFlight]] = {}
        # Set, and replaced by a new one, whenever a slot is given back (`_named_slot_freed`).
        self._slot_freed = asyncio.Event()
        self._counters: dict[str | None, docs.Counters] = {}
        self._vocabulary = docs.Vocabulary()
        self._lora_scales: dict[int, float] = {}
        self._router = ModelTable(router_models) if router_models else None
        self._routes = {**ROUTES, **(ROUTER_ROUTES if router_models else {})}
        self._started_at = int(time.time())
        self._next_id = 0
        self._next_task = 0
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

    def model_status(self, name: str) -> str:
        """A router's model: "unloaded", "loading" or "loaded"."""
        if self._router is None:
            raise ValueError("model_status is for a router (router_models)")
        return self._router.status(name)

    def requests_to(self, path: str) -> list[SeenRequest]:
        """The requests seen for `path` (without query string), in arrival order."""
        return [seen for seen in self.seen if seen.route == path]

    def forget_cache(self) -> None:
        """Empty every slot's KV cache, as a restart of llama-server does (or the eviction of
        every prompt): the next request finds nothing cached."""
        self._recent = {}  # one assignment: the server's loop reads either the old or the new

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
        self.props_open.set()  # a /props held open would keep its thread waiting
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
            loop.run_until_complete(self._load_startup_models())
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

    def _run_on_loop(self, action: Callable[[], Coroutine[Any, Any, None]]) -> None:
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

    async def _load_startup_models(self) -> None:
        if self._router is not None:
            for name in self.load_on_startup:
                self._router.load(name, **self._load_options(name))

    async def _refuse(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        # A dead server's idle keep-alive connections die with it.
        for writer in list(self._idle):
            writer.close()

    async def _shutdown(self) -> None:
        await self._refuse()
        if self._router is not None:
            self._router.stop()
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
                    request = await read_request(reader)
                finally:
                    self._idle.discard(writer)
                if request is None:
                    break
                if not await self._respond(_Call(request[0], reader, writer, request[1])):
                    break
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        except asyncio.CancelledError:
            # Only stop() cancels connections; ending normally keeps Python 3.11's stream
            # server from logging each cancelled handler as an error.
            pass
        except (ValueError, asyncio.LimitOverrunError):
            with contextlib.suppress(ConnectionError):
                writer.write(
                    whole_response(
                        400,
                        dumps(error_document(400, "Malformed request", _INVALID)),
                        JSON_TYPE,
                        origin="",
                        keep_alive=False,
                    )
                )
                await writer.drain()
        finally:
            self._connections.discard(task)
            writer.close()

    async def _respond(self, call: _Call) -> bool:
        """Answer one request; True when the connection stays open for the next one.

        In llama-server's order: CORS preflights first, then "loading model", then the API
        key, then the route (an unknown one is 404).
        """
        request = call.request
        self.seen.append(request)
        if request.method == "OPTIONS":
            # Browsers send no credentials with a preflight, so it is answered before the key.
            return await call.send(200, b"", "text/html", PREFLIGHT_HEADERS)
        if self._health == "loading":
            # The real server answers every endpoint this way while it loads the model.
            return await call.error(503, "Loading model", "unavailable_error")
        if not self._authorized(request):
            return await call.error(401, "Invalid API Key", "authentication_error")
        method = "GET" if request.method == "HEAD" else request.method
        route = self._routes.get((method, request.route))
        if route is None and method == "POST" and request.route.startswith("/slots/"):
            route = ("_slot_action", "", True)
        if route is None:
            return await call.error(404, "File Not Found", "not_found_error")
        name, argument, proxied = route
        if proxied and self._router is not None:
            refused = await self._route_to_model(call)
            if refused is not None:
                return refused
        handler = getattr(self, name)
        return await (handler(call, argument) if argument else handler(call))

    def _authorized(self, request: SeenRequest) -> bool:
        """llama-server's check: `Authorization` (with or without "Bearer "), else
        `X-Api-Key`, must be one of the keys; public paths need none."""
        keys = [key.strip() for key in (self.api_key or "").split(",") if key.strip()]
        if not keys or request.route in PUBLIC_PATHS:
            return True
        given = request.headers.get("authorization", "") or request.headers.get("x-api-key", "")
        return given.removeprefix("Bearer ") in keys

    # Router mode: which model answers, loading it first if it must.

    def _load_options(self, name: str) -> dict[str, Any]:
        return {
            "models_max": self.models_max,
            "load_delay": self.load_delay,
            "fails": name in self.failing_models,
        }

    async def _route_to_model(self, call: _Call) -> bool | None:
        """Find the model a request names and make sure it runs: None when it does (then
        `call.model` names it), else the result of the error answer sent."""
        assert self._router is not None
        request = call.request
        if request.method == "POST":
            if request.body and request.json is None:
                return await call.error(500, "invalid JSON in request body", "server_error")
            body = call.body()
            name = body.get("model") if body is not None else None
        else:
            name = request.query.get("model")
        if not isinstance(name, str) or not name:
            return await call.error(400, "model name is missing from the request", _INVALID)
        if name not in self._router:
            return await call.error(400, f"model '{name}' not found", _INVALID)
        autoload = request.query.get("autoload")
        if (autoload is None and self.models_autoload) or autoload in ("true", "1"):
            try:
                await self._router.ensure_loaded(name, **self._load_options(name))
            except LoadFailed as exc:
                return await call.error(500, str(exc), "server_error")
        elif not self._router.is_running(name):
            return await call.error(400, "model is not loaded", _INVALID)
        elif self._router.status(name) == "loading":
            return await call.error(503, "Loading model", "unavailable_error")
        if request.method == "POST":
            self._router.touch(name)
        call.model = name
        return None

    async def _model_load(self, call: _Call) -> bool:
        assert self._router is not None
        body = call.body() or {}
        name = body.get("model")
        if not isinstance(name, str) or name not in self._router:
            return await call.error(404, "model is not found", "not_found_error")
        if self._router.is_running(name):
            return await call.error(400, "model is already running", _INVALID)
        self._router.load(name, **self._load_options(name))
        return await call.json(200, {"success": True})

    async def _model_unload(self, call: _Call) -> bool:
        assert self._router is not None
        body = call.body() or {}
        name = body.get("model")
        if not isinstance(name, str) or name not in self._router:
            return await call.error(400, "model is not found", _INVALID)
        if not self._router.is_running(name):
            return await call.error(400, "model is not running", _INVALID)
        self._router.unload(name)
        return await call.json(200, {"success": True})

    # Server state.

    def _model_name(self, call: _Call, body: dict[str, Any] | None = None) -> str:
        asked = body.get("model") if body is not None else None
        if isinstance(asked, str):
            return asked
        if call.model is not None:
            return call.model
        return self.models[0] if self.models else ""

    async def _health_answer(self, call: _Call) -> bool:
        if self._health == "ok":
            return await call.json(200, {"status": "ok"})
        return await call.error(500, "Model failed", "server_error")

    async def _models_answer(self, call: _Call) -> bool:
        if self._router is not None:
            entries = self._router.entries()
            return await call.json(200, docs.router_model_list(entries, int(time.time())))
        return await call.json(200, docs.model_list(self.models, int(time.time()), self.aliases))

    async def _props_answer(self, call: _Call) -> bool:
        if not self.props_open.is_set():
            await asyncio.to_thread(self.props_open.wait)
        if self._router is not None:
            if "model" not in call.request.query:
                return await call.json(
                    200, docs.router_props(self.models_max, self.models_autoload)
                )
            refused = await self._route_to_model(call)
            if refused is not None:
                return refused
        document = docs.props(
            model=self._model_name(call),
            total_slots=self.slots,
            endpoint_slots=self.slots_endpoint,
            endpoint_props=self.props,
            endpoint_metrics=self.metrics,
        )
        return await call.json(200, document)

    async def _props_change(self, call: _Call) -> bool:
        if not self.props:
            message = (
                "This server does not support changing global properties. Start it with `--props`"
            )
            return await call.error(501, message, _NOT_SUPPORTED)
        return await call.json(200, {"success": True})

    async def _slots_answer(self, call: _Call) -> bool:
        if not self.slots_endpoint:
            message = "This server does not support slots endpoint. Start it with `--slots`"
            return await call.error(501, message, _NOT_SUPPORTED)
        busy = self._busy.get(call.model, {})
        if call.request.query.get("fail_on_no_slot") and len(busy) >= self.slots:
            return await call.error(503, "no slot available", "unavailable_error")
        views = [
            docs.SlotView(i, busy[i].task, busy[i].n_decoded)
            if i in busy
            else docs.SlotView(i, None, 0)
            for i in range(self.slots)
        ]
        return await call.json(200, docs.slots(views))

    async def _slot_action(self, call: _Call) -> bool:
        message = "This server does not support slots action. Start it with `--slot-save-path`"
        return await call.error(501, message, _NOT_SUPPORTED)

    async def _metrics_answer(self, call: _Call) -> bool:
        if not self.metrics:
            message = "This server does not support metrics endpoint. Start it with `--metrics`"
            return await call.error(501, message, _NOT_SUPPORTED)
        counters = self._counters.get(call.model, docs.Counters())
        text = docs.metrics_text(counters, len(self._busy.get(call.model, {})))
        extra = (("Process-Start-Time-Unix", str(self._started_at)),)
        return await call.send(200, text.encode(), "text/plain; version=0.0.4", extra)

    async def _lora_answer(self, call: _Call) -> bool:
        return await call.json(200, docs.lora_adapters(self.lora_adapters, self._lora_scales))

    async def _lora_change(self, call: _Call) -> bool:
        entries = call.request.json
        if not isinstance(entries, list):
            return await call.error(400, "Request body must be an array", _INVALID)
        for entry in entries:
            if isinstance(entry, dict) and isinstance(entry.get("id"), int):
                scale = entry.get("scale", 0.0)
                if 0 <= entry["id"] < len(self.lora_adapters) and isinstance(scale, int | float):
                    self._lora_scales[entry["id"]] = float(scale)
        return await call.json(200, {"success": True})

    # Requests that need no slot.

    async def _tokenize(self, call: _Call) -> bool:
        body = call.body()
        if body is None:
            return await call.error(400, "Invalid JSON body", _INVALID)
        try:
            return await call.json(200, docs.tokenize_answer(self._vocabulary, body))
        except docs.BadRequest as exc:
            return await call.error(400, str(exc), _INVALID)

    async def _detokenize(self, call: _Call) -> bool:
        body = call.body()
        if body is None:
            return await call.error(400, "Invalid JSON body", _INVALID)
        try:
            content = self._vocabulary.detokenize(body.get("tokens", []))
        except docs.BadRequest as exc:
            return await call.error(400, str(exc), _INVALID)
        return await call.json(200, {"content": content})

    async def _apply_template(self, call: _Call) -> bool:
        body = call.body()
        if body is None:
            return await call.error(400, "Invalid JSON body", _INVALID)
        prompt = docs.apply_template(docs.chat_messages("chat", body))
        return await call.json(200, {"prompt": prompt})

    async def _count_tokens(self, call: _Call, kind: str) -> bool:
        """Token counting: the prompt tokens a generation of this body would report."""
        body = call.body()
        if body is None:
            return await call.error(400, "Invalid JSON body", _INVALID)
        try:
            docs.check_generation_body(kind, body)
        except docs.BadRequest as exc:
            return await call.error(400, str(exc), _INVALID)
        except docs.ServerFailure as exc:
            return await call.error(500, str(exc), "server_error")
        document: dict[str, Any] = {
            "input_tokens": len(docs.words(docs.prompt_text(kind, body))) or 1
        }
        if kind != "anthropic":
            document["object"] = "response.input_tokens"
        return await call.json(200, document)

    # Requests that take a slot.

    async def _with_slot(
        self, call: _Call, work: Callable[[_InFlight, bool], Awaitable[bool]]
    ) -> bool:
        """Hold a slot while `work(hold, cut)` answers, unless a failure is injected or no slot
        is free (HTTP 500). `cut` asks the answer to break off mid-way (reset_mid_stream)."""
        hold = _InFlight(self, call.model, _named_slot(call, self.slots))
        try:
            failure = self._take_failure()
            if failure == "reset_before_headers":
                hold.release()
                reset(call.writer)
                return False
            if failure == "hang":
                await wait_until_gone(call.reader)
                self._count_disconnect()
                return False
            if failure == "error_500":
                hold.release()
                return await call.error(500, "Internal server error (injected)", "server_error")
            if failure in ("odd_status", "short_stream"):
                hold.release()
                await self._send_broken_head(call, failure)
                return False
            if hold.named is not None and not await self._named_slot_freed(call, hold):
                return False  # the client left while its task waited for the slot it named
            if hold.slot is None:
                hold.release()
                return await call.error(500, "Context size has been exceeded.", "server_error")
            return await work(hold, failure == "reset_mid_stream")
        finally:
            hold.release()

    async def _named_slot_freed(self, call: _Call, hold: _InFlight) -> bool:
        """Wait until the slot `hold` names is free, and take it; False when the client left
        first. llama-server defers a task whose `id_slot` is busy and takes it up again once
        a slot is released (any slot, so its task counter runs on meanwhile), however idle
        its other slots: the task waits for that slot, never takes another."""
        while not hold.take_named():
            if _gone(call):
                self._count_disconnect()
                return False
            self._next_task += 1  # deferred, and asked again
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._slot_freed.wait(), _POLL)
        return True

    async def _send_broken_head(self, call: _Call, failure: str) -> None:
        """An answer no gateway may pass on as it is, then the connection closed: a head with
        the status line `odd_status`, or an SSE stream cut short of its declared length."""
        if failure == "odd_status":
            body = dumps(error_document(500, "odd status (injected)", "server_error"))
            start = head(200, JSON_TYPE, origin=call.origin, keep_alive=False, length=len(body))
            status_line = f"HTTP/1.1 {self.odd_status}".encode("utf-8", "surrogateescape")
            call.writer.write(status_line + start[start.index(b"\r\n") :] + body)
        else:
            declared = len(SHORT_STREAM_EVENT) + SHORT_STREAM_MISSING
            start = head(
                200, "text/event-stream", origin=call.origin, keep_alive=True, length=declared
            )
            call.writer.write(start + SHORT_STREAM_EVENT)
        with contextlib.suppress(ConnectionError):
            await call.writer.drain()

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

    async def _generate(self, call: _Call, kind: str) -> bool:
        async def work(hold: _InFlight, cut: bool) -> bool:
            body = call.body()
            if body is None:
                hold.release()
                return await call.error(400, "Invalid JSON body", _INVALID)
            try:
                docs.check_generation_body(kind, body)
            except docs.BadRequest as exc:
                hold.release()
                return await call.error(400, str(exc), _INVALID)
            except docs.ServerFailure as exc:
                hold.release()
                return await call.error(500, str(exc), "server_error")
            generation = self._generation(kind, body, call, hold)
            self._next_id += 1
            output = FORMATS[kind](generation, self._next_id, int(time.time()))
            if generation.stream:
                return await self._stream(output, hold, call, cut)
            return await self._answer_whole(output, hold, call, cut)

        return await self._with_slot(call, work)

    def _generation(
        self, kind: str, body: dict[str, Any], call: _Call, hold: _InFlight
    ) -> Generation:
        text = docs.prompt_text(kind, body)
        words = (OPENING, *docs.words(text))
        kept = max(self.slots, 1) + self.cache_ram
        recent = self._recent.setdefault(call.model, deque(maxlen=kept))
        cached = max((_common_prefix(words, seen) for seen in recent), default=0)
        # The real server re-evaluates at least the last prompt token.
        cache_n = min(cached, len(words) - 1)
        recent.append(words)
        options = body.get("stream_options")
        return Generation(
            kind=kind,
            model=self._model_name(call, body),
            stream=body.get("stream") is True,
            include_usage=isinstance(options, dict) and options.get("include_usage") is True,
            max_tokens=docs.max_tokens(body, DEFAULT_MAX_TOKENS),
            prompt_n=len(words) - cache_n,
            cache_n=cache_n if self.cache_n_said is None else self.cache_n_said,
            prompt=text,
            id_slot=hold.slot or 0,
            prompt_token_ms=self.prompt_token_ms,
        )

    async def _stream(self, output: Format, hold: _InFlight, call: _Call, cut: bool) -> bool:
        """Send the SSE stream; the connection is always closed afterwards."""
        writer = call.writer
        n = output.generation.max_tokens
        try:
            writer.write(stream_head(call.origin))
            await writer.drain()
            started = time.perf_counter()
            if not await self._first_token(call):
                return False
            for i in range(n):
                if not await self._next_token(call):
                    return False
                if cut and i == min(RESET_AFTER_TOKENS, n - 1):
                    reset(writer)
                    return False
                event = output.token(i, n)
                if event:
                    writer.write(chunk(event))
                    await writer.drain()
                hold.n_decoded = i + 1
            if cut:
                reset(writer)
                return False
            elapsed_ms = (time.perf_counter() - started) * 1000
            end = chunk(output.end(n, elapsed_ms)) + LAST_CHUNK
            self._count_generation(output.generation, n, elapsed_ms, call.model)
            hold.release()
            writer.write(end)
            await writer.drain()
        except ConnectionError:
            self._count_disconnect()
        return False

    async def _answer_whole(self, output: Format, hold: _InFlight, call: _Call, cut: bool) -> bool:
        started = time.perf_counter()
        n = output.generation.max_tokens
        if not await self._first_token(call):
            return False
        for i in range(n):
            if not await self._next_token(call):
                return False
            hold.n_decoded = i + 1
        elapsed_ms = (time.perf_counter() - started) * 1000
        self._count_generation(output.generation, n, elapsed_ms, call.model)
        response = call.whole(200, dumps(output.whole(n, elapsed_ms)))
        hold.release()
        return await self._send_held(call, response, cut)

    async def _send_held(self, call: _Call, response: bytes, cut: bool) -> bool:
        if cut:
            # Headers and part of the body, then a reset: a non-streamed "mid-stream" failure.
            call.writer.write(response[: len(response) - len(response) // 4])
            await call.writer.drain()
            reset(call.writer)
            return False
        call.writer.write(response)
        try:
            await call.writer.drain()
        except ConnectionError:
            self._count_disconnect()
            return False
        return call.keep_alive

    async def _embeddings(self, call: _Call, flavour: str) -> bool:
        if not self.embeddings:
            message = "This server does not support embeddings. Start it with `--embeddings`"
            return await call.error(501, message, _NOT_SUPPORTED)

        def answer(body: dict[str, Any]) -> object:
            ask = docs.embeddings_ask(body, oai=flavour == "oai")
            return docs.embeddings_answer(ask, self._model_name(call, body))

        return await self._with_slot(call, lambda hold, cut: self._compute(call, hold, cut, answer))

    async def _rerank(self, call: _Call) -> bool:
        if not self.reranking:
            message = "This server does not support reranking. Start it with `--reranking`"
            return await call.error(501, message, _NOT_SUPPORTED)

        def answer(body: dict[str, Any]) -> object:
            return docs.rerank_answer(body, self._model_name(call))

        return await self._with_slot(call, lambda hold, cut: self._compute(call, hold, cut, answer))

    async def _compute(
        self,
        call: _Call,
        hold: _InFlight,
        cut: bool,
        answer: Callable[[dict[str, Any]], object],
    ) -> bool:
        """A one-pass answer (embeddings, reranking): one `token_delay` of work in the slot."""
        body = call.body()
        if body is None:
            hold.release()
            return await call.error(400, "Invalid JSON body", _INVALID)
        try:
            document = answer(body)
        except docs.BadRequest as exc:
            hold.release()
            return await call.error(400, str(exc), _INVALID)
        if not await self._next_token(call):
            return False
        response = call.whole(200, dumps(document))
        hold.release()
        return await self._send_held(call, response, cut)

    # Pacing.

    async def _first_token(self, call: _Call) -> bool:
        """Wait `first_token_delay`; False (and counted) when the client has gone meanwhile."""
        deadline = time.monotonic() + self.first_token_delay
        while (left := deadline - time.monotonic()) > 0:
            await asyncio.sleep(min(left, _POLL))
            if _gone(call):
                self._count_disconnect()
                return False
        return True

    async def _next_token(self, call: _Call) -> bool:
        """Wait `token_delay`; False (and counted) when the client has gone meanwhile."""
        if self.token_delay > 0:
            await asyncio.sleep(self.token_delay)
        if _gone(call):
            self._count_disconnect()
            return False
        return True

    def _count_disconnect(self) -> None:
        with self._stats_lock:
            self.disconnects += 1

    def _count_generation(
        self, generation: Generation, n: int, elapsed_ms: float, model: str | None
    ) -> None:
        counters = self._counters.setdefault(model, docs.Counters())
        counters.add(generation.prompt_n, generation.prompt_n * 0.1, n, elapsed_ms)


class _InFlight:
    """One request's slot and place in `in_flight`, given back once.

    `slot` is the slot id it runs in, None when every slot was busy (the request is refused)
    or, for a request that names a slot (`named`, llama-server's `id_slot`), while that one
    is busy (it waits for it: `take_named`). Given back just before the response's last bytes
    are written, as llama-server frees the slot before it sends the final result: a client
    that saw the end may at once send the next request without meeting its own previous one
    in the count.
    """

    __slots__ = ("_server", "_held", "_busy", "named", "slot", "task", "n_decoded")

    def __init__(self, server: FakeLlamaServer, model: str | None, named: int | None) -> None:
        self._server = server
        self._held = True
        self._busy = server._busy.setdefault(model, {})
        self.named = named
        self.slot: int | None = None
        if named is None:
            self.slot = next((i for i in range(server.slots) if i not in self._busy), None)
            if self.slot is not None:
                self._busy[self.slot] = self
        else:
            self.take_named()
        server._next_task += 1
        self.task = server._next_task
        self.n_decoded = 0
        with server._stats_lock:
            server.in_flight += 1
            server.max_concurrent = max(server.max_concurrent, server.in_flight)

    def take_named(self) -> bool:
        """Take the slot this request names, if it is free; whether it holds it now."""
        if self.slot is None and self.named is not None and self.named not in self._busy:
            self.slot = self.named
            self._busy[self.slot] = self
        return self.slot is not None

    def release(self) -> None:
        if self._held:
            self._held = False
            if self.slot is not None:
                self._busy.pop(self.slot, None)
                freed, self._server._slot_freed = self._server._slot_freed, asyncio.Event()
                freed.set()
            with self._server._stats_lock:
                self._server.in_flight -= 1


def _named_slot(call: _Call, slots: int) -> int | None:
    """The slot the request names (llama-server's `id_slot`), when it names one of `slots`;
    -1 or none leaves the choice to the server."""
    body = call.body()
    named = body.get("id_slot") if body is not None else None
    if isinstance(named, int) and not isinstance(named, bool) and 0 <= named < slots:
        return named
    return None


def _gone(call: _Call) -> bool:
    return call.reader.at_eof() or call.writer.transport.is_closing()


def _common_prefix(a: tuple[str, ...], b: tuple[str, ...]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _check_options(
    slots: int, token_delay: float, first_token_delay: float, models_max: int, load_delay: float
) -> None:
    if slots < 1:
        raise ValueError(f"slots must be at least 1, not {slots}")
    for name, value in (
        ("token_delay", token_delay),
        ("first_token_delay", first_token_delay),
        ("load_delay", load_delay),
    ):
        if value < 0:
            raise ValueError(f"{name} must not be negative, not {value}")
    if models_max < 0:
        raise ValueError(f"models_max must be 0 (no limit) or more, not {models_max}")


def _check_router(
    names: tuple[str, ...], models_max: int, startup: tuple[str, ...], failing: frozenset[str]
) -> None:
    if len(set(names)) != len(names):
        raise ValueError(f"router_models names a model twice: {names}")
    unknown = sorted((set(startup) | set(failing)) - set(names))
    if unknown:
        raise ValueError(f"not in router_models: {', '.join(unknown)}")
    if models_max and len(set(startup)) > models_max:
        raise ValueError(
            f"number of models to load on startup ({len(set(startup))}) exceeds models_max "
            f"({models_max})"
        )


def _models_in(directory: str) -> tuple[str, ...]:
    """The models llama-server's `--models-dir` would offer: *.gguf files and subfolders."""
    path = Path(directory)
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"--models-dir {directory}: not a directory")
    names = [
        entry.stem if entry.is_file() else entry.name
        for entry in sorted(path.iterdir())
        if entry.is_dir() or entry.suffix == ".gguf"
    ]
    return tuple(names)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="A fake llama-server for trying crossbar.",
        epilog="Router mode: give --router-model (repeatable) or --models-dir.",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9001)
    parser.add_argument("--slots", type=int, default=4, help="like -np: requests at a time")
    parser.add_argument(
        "--cache-ram",
        type=int,
        default=CACHE_RAM_PROMPTS,
        help="prompts kept beyond the slots (like --cache-ram; 0: the slots' alone)",
    )
    parser.add_argument("--token-delay", type=float, default=0.02, help="seconds per token")
    parser.add_argument(
        "--first-token-delay", type=float, default=0.0, help="seconds from head to first event"
    )
    parser.add_argument("--model", action="append", help="a model to list (repeatable)")
    parser.add_argument("--api-key", help="required key(s), comma-separated, like --api-key")
    parser.add_argument("--no-metrics", action="store_true", help="/metrics answers 501")
    parser.add_argument("--no-slots", action="store_true", help="/slots answers 501")
    parser.add_argument("--props", action="store_true", help="POST /props is allowed")
    parser.add_argument("--no-embeddings", action="store_true", help="embeddings answer 501")
    parser.add_argument("--no-reranking", action="store_true", help="reranking answers 501")
    parser.add_argument("--lora", action="append", default=[], help="a LoRA adapter path")
    parser.add_argument("--router-model", action="append", default=[], help="a model to load")
    parser.add_argument("--models-dir", type=_models_in, help="offer its *.gguf files")
    parser.add_argument("--models-max", type=int, default=4, help="models loaded at once, 0: any")
    parser.add_argument("--load-delay", type=float, default=0.0, help="seconds a load takes")
    parser.add_argument("--no-models-autoload", action="store_true")
    parser.add_argument("--load-on-startup", action="append", default=[], help="a model to load")
    return parser


def main(argv: list[str] | None = None) -> None:
    """Serve until Ctrl-C."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        fake = FakeLlamaServer(
            slots=args.slots,
            cache_ram=args.cache_ram,
            token_delay=args.token_delay,
            first_token_delay=args.first_token_delay,
            models=tuple(args.model or ["test-model"]),
            host=args.host,
            port=args.port,
            api_key=args.api_key,
            metrics=not args.no_metrics,
            slots_endpoint=not args.no_slots,
            props=args.props,
            embeddings=not args.no_embeddings,
            reranking=not args.no_reranking,
            lora_adapters=tuple(args.lora),
            router_models=tuple(args.router_model) + (args.models_dir or ()),
            models_max=args.models_max,
            load_delay=args.load_delay,
            models_autoload=not args.no_models_autoload,
            load_on_startup=tuple(args.load_on_startup),
        )
        fake.start()
    except (ValueError, OSError) as exc:
        parser.error(str(exc))
    try:
        served = fake.router_models or fake.models
        mode = "router for" if fake.router_models else "serving"
        print(f"fake llama-server on {fake.url} {mode} {', '.join(served)}; Ctrl-C stops")
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        fake.stop()


if __name__ == "__main__":
    main()
