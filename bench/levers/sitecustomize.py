"""Bench-only changes to crossbar, for measuring what a change would save without making it.

`bench_gateway.py --targets crossbar+LEVER` starts crossbar with this directory (and bench/)
first in PYTHONPATH and `CROSSBAR_BENCH_LEVERS=LEVER,...`; Python imports this module at start
(`sitecustomize`), before crossbar's own code, and each lever patches one module right after it
is first imported. Nothing under routing/ or crossbar_site/ changes, and no other process (the
tests, `make run`) sees any of it: only a process started with that environment does.

Levers:
- `notee`: the tee does not look at chunks (no token counts in the rows).
- `noaccounting`: no row to the recorder and no Prometheus series per request (the log line
  stays, as the log level decides).
- `gctime`: the cyclic garbage collector's passes and the time they took, per generation,
  written at exit to bench/results/gctime-<pid>.txt (the target's log is copied before it
  stops) with the process's CPU time: a collection is C work that a profile without
  native frames lays on whatever Python frame allocated last.
- `stages`: timestamps of each request's way to its first token, written at exit as JSON
  lines to `CROSSBAR_BENCH_STAGES` (bench/stages.py reads them). Also for floors: the
  timestamps common to both are taken where both pass (the server's `run`, httpx, aiohttp).
"""

from __future__ import annotations

import atexit
import contextvars
import importlib.abc
import importlib.machinery
import json
import os
import sys
import time
from collections.abc import AsyncIterator, Callable
from types import ModuleType, SimpleNamespace
from typing import Any


def _notee(module: ModuleType) -> None:
    module.Tee.feed = lambda self, chunk: None


def _noaccounting(module: Any) -> None:
    class _NoRecorder:
        def record(self, row: object) -> None:
            pass

    module.get_recorder = lambda: _NoRecorder()
    module.metrics = SimpleNamespace(observe=lambda record: None)


# -- stages: where a request's first token waits ------------------------------------------
#
# One dict per proxied request, of `time.perf_counter()` seconds (the system's monotonic clock,
# as the load generator's) at each stage it passes, the first time it passes it:
#   app            the server calls the ASGI application (the request's head has arrived)
#   body           the application has the last of the body (`receive`)
#   view           crossbar's proxy view starts (Django's request and URLconf done)
#   placed         placement done (crossbar's `Lifecycle.place`: runtime, route, access, body, slot)
#   upstream_send  httpx's `AsyncClient.send` is called (the upstream request built)
#   connected      aiohttp has a new connection to the host (a trace)
#   request_sent   aiohttp has written the request's head (a trace)
#   upstream_head  `send` returns with the host's response head
#   client_head    the application sends `http.response.start`
#   upstream_first the host's first body chunk comes out of `aiter_raw`
#   client_first   the application sends the first body bytes to the server...
#   client_first_out  ...and the server's `send` returns
#   end            the application returns
# and the client's port, to find the load generator's sample of the same request.
STAGES = contextvars.ContextVar[dict[str, float]]("crossbar_bench_stages")
_RECORDS: list[dict[str, float]] = []


def _mark(name: str) -> None:
    record = STAGES.get(None)
    if record is not None and name not in record:
        record[name] = time.perf_counter()


def _timed_application(application: Any) -> Any:
    """The ASGI application, timing every HTTP request but `/health`."""

    async def timed(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] == "/health":
            return await application(scope, receive, send)
        record = {"app": time.perf_counter(), "port": (scope.get("client") or ("", 0))[1]}
        token = STAGES.set(record)  # the tasks the application starts inherit it

        async def receiving() -> Any:
            message = await receive()
            if message["type"] == "http.request" and not message.get("more_body", False):
                record.setdefault("body", time.perf_counter())
            return message

        async def sending(message: Any) -> None:
            if message["type"] == "http.response.start":
                record.setdefault("client_head", time.perf_counter())
            elif message.get("body") and "client_first" not in record:
                record["client_first"] = time.perf_counter()
                await send(message)
                record["client_first_out"] = time.perf_counter()
                return
            await send(message)

        try:
            await application(scope, receiving, sending)
        finally:
            record["end"] = time.perf_counter()
            _RECORDS.append(record)
            STAGES.reset(token)

    return timed


def _server(module: Any) -> None:
    run = module.run

    def timed_run(application: Any, *args: Any, **kwargs: Any) -> None:
        run(_timed_application(application), *args, **kwargs)

    module.run = timed_run


def _httpx(module: Any) -> None:
    send = module.AsyncClient.send
    aiter_raw = module.Response.aiter_raw

    async def timed_send(self: Any, *args: Any, **kwargs: Any) -> Any:
        _mark("upstream_send")
        response = await send(self, *args, **kwargs)
        _mark("upstream_head")
        return response

    def timed_aiter_raw(self: Any, *args: Any, **kwargs: Any) -> AsyncIterator[bytes]:
        chunks = aiter_raw(self, *args, **kwargs)
        return chunks if STAGES.get(None) is None else _first_marked(chunks)

    module.AsyncClient.send = timed_send
    module.Response.aiter_raw = timed_aiter_raw


async def _first_marked(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    async for chunk in chunks:
        _mark("upstream_first")
        yield chunk


def _aiohttp(module: Any) -> None:
    init = module.ClientSession.__init__

    async def connected(*_: Any) -> None:
        _mark("connected")

    async def request_sent(*_: Any) -> None:
        _mark("request_sent")

    def traced_init(self: Any, *args: Any, **kwargs: Any) -> None:
        trace = module.TraceConfig()
        trace.on_connection_create_end.append(connected)
        trace.on_request_headers_sent.append(request_sent)
        kwargs["trace_configs"] = [*(kwargs.get("trace_configs") or ()), trace]
        init(self, *args, **kwargs)

    module.ClientSession.__init__ = traced_init


def _view(module: Any) -> None:
    proxy = module.proxy

    async def timed_proxy(request: Any) -> Any:
        _mark("view")
        return await proxy(request)

    timed_proxy.csrf_exempt = True  # type: ignore[attr-defined]  # as the view it wraps
    module.proxy = timed_proxy


def _lifecycle(module: Any) -> None:
    place = module.Lifecycle.place

    async def timed_place(self: Any, *args: Any, **kwargs: Any) -> None:
        await place(self, *args, **kwargs)
        _mark("placed")

    module.Lifecycle.place = timed_place


_GC: dict[int, list[float]] = {0: [0, 0.0], 1: [0, 0.0], 2: [0, 0.0]}  # gen -> [passes, s]
_GC_STARTED = [0.0]
_GC_PASSES: list[tuple[float, int, float]] = []  # (perf_counter at its start, generation, s)


def _gc_timed(phase: str, info: dict[str, int]) -> None:
    if phase == "start":
        _GC_STARTED[0] = time.perf_counter()
    else:
        now = time.perf_counter()
        totals = _GC[info["generation"]]
        totals[0] += 1
        totals[1] += now - _GC_STARTED[0]
        _GC_PASSES.append((_GC_STARTED[0], info["generation"], now - _GC_STARTED[0]))


def _write_gc() -> None:
    passes = ", ".join(f"gen{g} {n:.0f} passes {s * 1000:.1f} ms" for g, (n, s) in _GC.items())
    results = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results")
    with open(os.path.join(results, f"gctime-{os.getpid()}.txt"), "w") as out:
        out.write(f"{' '.join(sys.argv)}\n{passes}; process CPU {time.process_time():.2f} s\n")
        out.write(json.dumps(_GC_PASSES) + "\n")  # for a phase's window (bench JSON)


def _write_stages() -> None:
    with open(os.environ["CROSSBAR_BENCH_STAGES"], "w") as out:
        for record in _RECORDS:
            out.write(json.dumps(record) + "\n")


# lever -> the modules it patches, and how
LEVERS: dict[str, tuple[tuple[str, Callable[[ModuleType], None]], ...]] = {
    "notee": (("routing.core.tee", _notee),),
    "noaccounting": (("routing.proxy.record", _noaccounting),),
    "gctime": (),  # installed at start (_install), not after an import
    "stages": (
        ("crossbar_site.daphne_server", _server),
        ("crossbar_site.uvicorn_server", _server),
        ("httpx", _httpx),
        ("aiohttp", _aiohttp),
        ("routing.proxy.view", _view),
        ("routing.proxy.lifecycle", _lifecycle),
    ),
}


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Finds the patched modules as usual, then runs their patch once they have executed."""

    def __init__(self, patches: dict[str, list[Callable[[ModuleType], None]]]) -> None:
        self.patches = patches

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in self.patches:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        execute = loader.exec_module
        patches = self.patches.pop(name)

        def exec_module(module: ModuleType) -> None:
            execute(module)
            for patch in patches:
                patch(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]  # this loader runs the patches
        return spec


def _install() -> None:
    wanted = [name for name in os.environ.get("CROSSBAR_BENCH_LEVERS", "").split(",") if name]
    unknown = [name for name in wanted if name not in LEVERS]
    if unknown:
        raise SystemExit(f"unknown bench levers {unknown}: known are {', '.join(LEVERS)}")
    patches: dict[str, list[Callable[[ModuleType], None]]] = {}
    for name in wanted:
        for module, patch in LEVERS[name]:
            patches.setdefault(module, []).append(patch)
    if "stages" in wanted:
        atexit.register(_write_stages)
    if "gctime" in wanted:
        import gc

        gc.callbacks.append(_gc_timed)
        atexit.register(_write_gc)
    if patches:
        sys.meta_path.insert(0, _PatchAfterImport(patches))
        print(f"bench levers: {', '.join(wanted)}", file=sys.stderr, flush=True)


_install()
