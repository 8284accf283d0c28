"""Read py-spy's raw (collapsed) stacks of the gateway and say where its CPU went.

    .venv/bin/python bench/profile_report.py bench/results/profile-STAMP.txt

Each line of the input is one distinct stack, `thread (tid): name;frame;frame;... count`, root
first, where a frame is `function (path:line)`. py-spy samples only threads that are running
(not idle ones), so shares of samples are shares of the CPU the process used.
"""

from __future__ import annotations

import re
import sys
from collections import Counter
from pathlib import Path

_FRAME = re.compile(r"(?P<function>.*) \((?P<path>[^():]*)(?::(?P<line>\d+))?\)$")
_NUMBERED = re.compile(r"[-_]?\d+")
_EXECUTOR = re.compile(r"ThreadPoolExecutor-(\d+)_")
# Leaves where a thread sleeps on a lock rather than runs: py-spy's idle filter misses some.
WAITS = {
    ("_worker", "concurrent/futures/thread.py", "81"): "executor thread waiting for work",
    ("Condition.wait", "threading.py", None): "waiting on a threading.Condition",
    ("Thread._wait_for_tstate_lock", "threading.py", None): "joining a thread",
}
TOP_FUNCTIONS = 30
TOP_SELF = 25
# The steps of one proxied request, each with the frames that mark it (function, path
# prefix); a sample counts for a step when any of its frames matches (steps overlap). Paths are
# matched by prefix, so a module may move within its package without the step going blank.
STEPS = (
    ("Django's ASGI handler around the request task",
     (("ASGIHandler.__call__", "django/"), ("GatewayHandler.handle", "crossbar_site/"))),
    ("  per-request executor: ThreadSensitiveContext", (("ThreadSensitiveContext.", "asgiref/"),)),
    ("  threads started from the event loop", (("Thread.start", "threading"),)),
    ("  sync_to_async calls made on the loop", (("SyncToAsync.__call__", "asgiref/"),)),
    ("  request_started signal (asend)", (("Signal.asend", "django/"),)),
    ("  read_body and create_request", (("ASGIHandler.read_body", "django/"),
                                         ("ASGIHandler.create_request", "django/"))),
    ("the request task: view, then streaming", (("ASGIHandler.handle.<locals>.process_request",
                                                "django/"),
                                               ("GatewayHandler.handle.<locals>.process_request",
                                                "crossbar_site/"))),
    ("  the proxy view up to the response head", (("proxy", "routing/"),)),
    ("    placement: lease, slot (Placer)", (("Placer.", "routing/"),)),
    ("    upstream request to response head (httpx)", (("_send", "routing/"),)),
    ("  streaming the body (send_response; crossbar's _send_streamed)",
     (("ASGIHandler.send_response", "django/"), ("_send_streamed", "crossbar_site/"))),
    ("    upstream reads: Relay.__anext__", (("Relay.__anext__", "routing/"),)),
    ("      httpx/httpcore/h11/anyio under it", (("Response.aiter_raw", "httpx/"),)),
    ("      asyncio.timeout per chunk", (("timeout", "asyncio/timeouts.py"),
                                        ("Timeout.", "asyncio/timeouts.py"))),
    ("      the tee", (("Tee.", "routing/"),)),
    ("      finish (row, metrics, log line)", (("Exchange.finish", "routing/"),
                                                   ("finish", "routing/proxy/record"))),
    ("    the server writing each chunk (daphne's handle_reply; uvicorn's send)",
     (("Server.handle_reply", "daphne/"), ("GatewayServer.handle_reply", "crossbar_site/"),
      ("RequestResponseCycle.send", "uvicorn/"))),
    ("      daphne's access log", (("AccessLogGenerator.", "daphne/"),)),
    ("Twisted socket callbacks (reads, writes)",
     (("AsyncioSelectorReactor._readOrWrite", "twisted/"),)),
    ("logging, anywhere", (("", "logging/"),)),
    ("the recorder thread (bulk_create)", (("Recorder._run", "accounting/"),)),
    ("the health poller", (("", "hosts/poller"),)),
)  # fmt: skip
# Owners (see `owner`) grouped into the layers a request crosses, so that crossbar's profile and
# its floor's compare layer by layer.
LAYERS = {
    "the ASGI server (Twisted, daphne; uvicorn, uvloop, httptools; granian)": (
        "twisted", "daphne", "zope", "uvicorn", "httptools", "uvloop", "granian",
    ),
    "the upstream client (httpx, httpcore, h11, anyio, sniffio; aiohttp)": (
        "httpx", "httpcore", "h11", "anyio", "sniffio", "aiohttp", "httpx_aiohttp", "yarl",
        "multidict", "aiohappyeyeballs", "propcache", "frozenlist", "aiosignal",
    ),
    "Django and asgiref": ("django", "asgiref"),
    "crossbar's own code (and prometheus_client)": (
        "routing", "accounting", "hosts", "crossbar_site", "prometheus_client",
    ),
    "the floor's own code (bench/floor_app.py)": ("floor_app",),
}  # fmt: skip

Frame = tuple[str, str, str]  # function, path, line


def parse(text: str) -> list[tuple[str, list[Frame], int]]:
    """(thread name, frames root first, samples) for every stack."""
    stacks = []
    for line in text.splitlines():
        body, _, count = line.rpartition(" ")
        if not body or not count.isdigit():
            continue
        thread, *frames = body.split(";")
        parsed = []
        for frame in frames:
            match = _FRAME.match(frame)
            if match:
                parsed.append((match["function"], match["path"], match["line"] or ""))
            else:
                parsed.append((frame, "", ""))
        stacks.append((thread.partition(": ")[2] or thread, parsed, int(count)))
    return stacks


def package(path: str) -> str:
    """`django/core/handlers/asgi.py` -> `django`; `threading.py` -> `threading`."""
    return path.split("/", 1)[0].removesuffix(".py") or "?"


def owner(frames: list[Frame]) -> str:
    """The innermost package outside the standard library: who asked for the work."""
    for _, path, _ in reversed(frames):
        name = package(path)
        if name not in sys.stdlib_module_names and name != "?":
            return name
    return "standard library only (event loop, threads)"


# crossbar_serve's servers: daphne's and uvicorn's, extended (serve.py in older sources).
SERVER_MODULES = (
    "crossbar_site/serve.py",
    "crossbar_site/daphne_server.py",
    "crossbar_site/uvicorn_server.py",
)


def layer(frames: list[Frame]) -> str:
    """The layer (LAYERS) of the innermost frame outside the standard library."""
    for _, path, _ in reversed(frames):
        name = package(path)
        if name in sys.stdlib_module_names or name == "?":
            continue
        if path.startswith(SERVER_MODULES):
            return next(iter(LAYERS))
        return next((layer for layer, names in LAYERS.items() if name in names), "other")
    return "the event loop and threads alone (standard library only)"


def waiting(frames: list[Frame]) -> str | None:
    if not frames:
        return None
    function, path, line = frames[-1]
    return WAITS.get((function, path, line)) or WAITS.get((function, path, None))


def report(text: str, cpu_ms_per_request: float | None = None) -> str:
    """The tables; with `cpu_ms_per_request` (measured while profiling) layers also in ms."""
    stacks = parse(text)
    total = sum(count for _, _, count in stacks)
    if not total:
        return "no samples"
    waits: Counter[str] = Counter()
    threads: Counter[str] = Counter()
    owners: Counter[str] = Counter()
    layers: Counter[str] = Counter({name: 0 for name in LAYERS})
    leaves: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    steps: Counter[str] = Counter({label: 0 for label, _ in STEPS})
    executors = {int(m[1]) for thread, _, _ in stacks if (m := _EXECUTOR.match(thread))}
    for thread, frames, count in stacks:
        wait = waiting(frames)
        if wait is not None:
            waits[f"{wait} ({_NUMBERED.sub('-*', thread, count=1)})"] += count
            continue
        threads[_NUMBERED.sub("-*", thread, count=1)] += count
        owners[owner(frames)] += count
        layers[layer(frames)] += count
        leaves[_name(frames[-1]) if frames else "(no Python frame: C code or the GIL)"] += count
        for key in {_name(frame) for frame in frames}:
            inclusive[key] += count
        for label, marks in STEPS:
            if any(_matches(frame, marks) for frame in frames):
                steps[label] += count
    running = total - sum(waits.values())

    def share(count: int) -> str:
        return f"{100 * count / running:5.1f}%"

    lines = [
        f"{running} samples of running threads ({total - running} more were waits, below);"
        f" sync_to_async executors (a new thread each) numbered {min(executors, default=0)}"
        f" to {max(executors, default=0)} ran in them"
    ]
    lines.append("\nby thread")
    lines += [f"  {share(n)}  {name}" for name, n in threads.most_common()]
    lines.append(
        "\nby layer: the owners below, grouped (crossbar_site's server modules count as the server)"
        + (", and as ms of CPU per request" if cpu_ms_per_request else "")
    )
    for name, n in layers.items():
        ms = f"  {cpu_ms_per_request * n / running:5.2f} ms" if cpu_ms_per_request else ""
        lines.append(f"  {share(n)}{ms}  {name}")
    lines.append("\nby owner: the innermost frame outside the standard library")
    lines += [f"  {share(n)}  {name}" for name, n in owners.most_common(15)]
    lines.append("\nthe steps of a request (inclusive; a sample counts in every step it is under)")
    lines += [f"  {share(n)}  {label}" for label, n in steps.items()]
    lines.append(f"\ntop {TOP_SELF} functions by self time")
    lines += [f"  {share(n)}  {name}" for name, n in leaves.most_common(TOP_SELF)]
    lines.append(f"\ntop {TOP_FUNCTIONS} functions by inclusive time (under 90%)")
    shown = [(name, n) for name, n in inclusive.most_common() if n < 0.9 * running]
    lines += [f"  {share(n)}  {name}" for name, n in shown[:TOP_FUNCTIONS]]
    lines.append("\nwaits, as a share of the running samples")
    lines += [f"  {share(n)}  {name}" for name, n in waits.most_common()]
    return "\n".join(lines)


def _matches(frame: Frame, marks: tuple[tuple[str, str], ...]) -> bool:
    function, path, _ = frame
    return any(
        path.startswith(prefix)
        and (function == name or name.endswith(".") and function.startswith(name) or not name)
        for name, prefix in marks
    )


def _name(frame: Frame) -> str:
    function, path, _ = frame
    return f"{function} ({path})"


if __name__ == "__main__":
    print(report(Path(sys.argv[1]).read_text(errors="replace")))  # shares only: no CPU figure
