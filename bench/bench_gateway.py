"""Streaming chat completions through the gateway, against the same upstream direct.

    .venv/bin/python bench/bench_gateway.py             # make bench
    .venv/bin/python bench/bench_gateway.py --compare   # make bench-compare: LiteLLM too
    .venv/bin/python bench/bench_gateway.py --profile   # py-spy on the gateway (c=32, or N)
    .venv/bin/python bench/bench_gateway.py --rev HEAD  # a commit instead of the working tree
    .venv/bin/python bench/bench_gateway.py --server uvicorn   # another ASGI server (SERVERS)

Starts a lean fake llama-server (`bench/fake_upstream.py`), then crossbar as users run it
(daphne on a free port, a throwaway SQLite database, DEBUG off, log level WARNING), and drives
both with `bench/loadgen.py` in a process of its own. At each concurrency the same workload
goes direct to the upstream and then through the gateway, so "added" figures are the gateway's
share alone. The gateway's CPU comes from /proc/<pid>/stat (all its threads: the event loop,
sync_to_async workers, the recorder), its RSS from /proc/<pid>/status.

Prints a table and writes it, with the settings and the machine, to bench/results/ as JSON.
bench/README.md says what every column means.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path

# This directory is on sys.path when the script runs.
from loadgen import read_cpu_seconds
from profile_report import report

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
RESULTS = BENCH / "results"
LITELLM = BENCH / ".venv-litellm" / "bin" / "litellm"
PYTHON = sys.executable

CHUNKS = 64
TOKEN_DELAY = 0.002  # 500 tokens/s per stream: faster than any GPU, so the gateway dominates
# (concurrency, measured requests per client); every client also sends one warm-up request.
PLAN = ((1, 30), (8, 16), (32, 10), (128, 4), (512, 2))
PHASE_SECONDS = 8.0  # no client starts a new request after this; LiteLLM needs the cap
# The per-request part of the CPU cost: the same clients asking for one token each.
SPLIT_CONCURRENCY, SPLIT_REQUESTS = 8, 40
PROFILE_CONCURRENCY, PROFILE_SECONDS, PROFILE_RATE = 32, 20.0, 200
APP_DIRS = ("crossbar_site", "routing", "hosts", "accounting")
LOADGEN_BUSY = 0.8  # of one core: above this, the load generator may be what limits
APP = "crossbar_site.asgi:application"
# The ASGI servers `--server` can put crossbar behind: how each is started on 127.0.0.1:PORT,
# and the package whose version the results record. None writes an access log (`make run`
# has none); crossbar's own line per request is off at log level WARNING.
SERVERS: dict[str, tuple[list[str], str]] = {
    "daphne": (["daphne", "-v", "0", "-b", "127.0.0.1", "-p", "PORT", APP], "daphne"),
    # daphne's loop made by uvloop: the policy set before daphne builds its loop at import.
    "daphne-uvloop": ([PYTHON, str(BENCH / "daphne_uvloop.py"), "-v", "0",
                       "-b", "127.0.0.1", "-p", "PORT", APP], "daphne"),
    # What `make run` serves: daphne with backpressure, capped bodies, a graceful stop.
    "crossbar_serve": ([PYTHON, "manage.py", "crossbar_serve", "--port", "PORT"], "daphne"),
    # uvicorn[standard] picks uvloop and httptools by itself; no lifespan: no rows at exit here.
    "uvicorn": (["uvicorn", APP, "--host", "127.0.0.1", "--port", "PORT", "--no-access-log",
                 "--lifespan", "off"], "uvicorn"),
    # One worker process (a child of granian's main process); it picks uvloop by itself.
    "granian": (["granian", "--interface", "asgi", "--host", "127.0.0.1", "--port", "PORT",
                 "--workers", "1", "--no-access-log", APP], "granian"),
}  # fmt: skip

FLEET_TOML = """\
[[hosts]]
name = "fake"
url = "{upstream}"
notes = "bench/fake_upstream.py"

  [[hosts.models]]
  name = "test-model"
  parallel = 1024
  queue_max = 1024

[[routes]]
name = "bench"
default_model = "test-model"
hosts = ["fake"]
"""

LITELLM_YAML = """\
model_list:
  - model_name: test-model
    litellm_params:
      model: openai/test-model
      api_base: {upstream}/v1
      api_key: x
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for(url: str, process: subprocess.Popen[bytes], log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            sys.exit(f"{process.args[0]} exited at start; its log ({log}):\n{log.read_text()}")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(url, timeout=1) as response:
                if response.status == 200:
                    return
        time.sleep(0.1)
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
    sys.exit(f"{url} did not answer within {timeout:g} s; the end of its log:\n{tail}")


@dataclass(frozen=True)
class Server:
    url: str  # the base URL, without a path
    pid: int


@contextlib.contextmanager
def serving(
    command: list[str],
    port: int,
    ready_path: str,
    log: Path,
    *,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    timeout: float = 60.0,
) -> Iterator[Server]:
    """Run a server until the block ends; ready once `ready_path` answers 200."""
    url = f"http://127.0.0.1:{port}"
    with log.open("wb") as output:
        process = subprocess.Popen(
            command, cwd=cwd or log.parent, env=env, stdout=output, stderr=subprocess.STDOUT
        )
        try:
            wait_for(url + ready_path, process, log, timeout)
            yield Server(url, process.pid)
        finally:
            process.terminate()
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()


def fake_upstream(
    work: Path, token_delay: float = TOKEN_DELAY
) -> contextlib.AbstractContextManager[Server]:
    port = free_port()
    command = [PYTHON, str(BENCH / "fake_upstream.py"), "--port", str(port)]
    command += ["--token-delay", str(token_delay)]
    return serving(command, port, "/health", work / "upstream.log")


@contextlib.contextmanager
def crossbar(
    work: Path, upstream: Server, source: Path, server: str, fleet_toml: str = FLEET_TOML
) -> Iterator[Server]:
    """crossbar from `source` behind `server` (a key of SERVERS), on a new SQLite database
    with `fleet_toml` (by default one host, the fake, and one route `bench`). The pid watched
    is the process that serves."""
    env = {
        **os.environ,
        "DATABASE_URL": f"sqlite:///{work / 'bench.sqlite3'}",
        "CROSSBAR_VAR_DIR": str(work),
        "DEBUG": "false",
        "CROSSBAR_LOG_LEVEL": "WARNING",
        "PYTHONUNBUFFERED": "1",
    }
    fleet = work / "fleet.toml"
    fleet.write_text(fleet_toml.format(upstream=upstream.url))
    manage = [PYTHON, str(source / "manage.py")]
    for step in (["migrate", "--noinput"], ["crossbar_config", "load", str(fleet)]):
        done = subprocess.run(manage + step, cwd=source, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"manage.py {' '.join(step)} failed:\n{done.stdout}{done.stderr}")
    port = free_port()
    command = [str(port) if arg == "PORT" else arg for arg in SERVERS[server][0]]
    if not command[0].startswith("/"):
        command[0] = str(Path(PYTHON).parent / command[0])
    if not Path(command[0]).exists():
        sys.exit(f"{command[0]} is not installed (bench/README.md says which versions)")
    with serving(command, port, "/health", work / "crossbar.log", env=env, cwd=source) as main:
        yield Server(main.url, worker_pid(main.pid)) if server == "granian" else main


def worker_pid(pid: int) -> int:
    """The one child of granian's main process: the worker, which runs the application."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    if len(children) != 1:
        sys.exit(f"expected one granian worker under pid {pid}, found {children}")
    return int(children[0])


def server_version(server: str) -> str:
    return metadata.version(SERVERS[server][1])


def source_tree(work: Path, rev: str | None) -> tuple[Path, dict[str, object]]:
    """The code to benchmark: the working tree as it is, or commit `rev` exported into `work`."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()

    commit = git("rev-parse", "--short", rev or "HEAD")
    if rev is None:
        changed = git("status", "--porcelain", "--untracked-files=no", "--", *APP_DIRS)
        return ROOT, {"commit": commit, "working_tree": True, "uncommitted": bool(changed)}
    source = work / "source"
    archive = subprocess.run(["git", "archive", commit], cwd=ROOT, capture_output=True, check=True)
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(source, filter="data")
    return source, {"commit": commit, "working_tree": False, "uncommitted": False}


def litellm(work: Path, upstream: Server) -> contextlib.AbstractContextManager[Server]:
    """LiteLLM's proxy, no database, one OpenAI-compatible model at the fake."""
    if not LITELLM.exists():
        sys.exit(
            f"LiteLLM is not installed at {LITELLM.parent.parent}: run `make bench-compare`, "
            "which installs it there with pip (litellm[proxy])."
        )
    config = work / "litellm.yaml"
    config.write_text(LITELLM_YAML.format(upstream=upstream.url))
    env = {
        **os.environ,
        # No master key: requests are not authenticated, as crossbar's are not.
        "LITELLM_DANGEROUSLY_PERMIT_WEAK_OR_UNSET_MASTER_KEY": "true",
        # The machine has no internet; do not wait on fetching the price list.
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        "LITELLM_LOG": "WARNING",
    }
    port = free_port()
    command = [str(LITELLM), "--config", str(config), "--host", "127.0.0.1", "--port", str(port)]
    log = work / "litellm.log"
    return serving(command, port, "/health/liveliness", log, env=env, timeout=120)


def load(
    url: str,
    pid: int,
    concurrency: int,
    requests: int,
    *,
    chunks: int = CHUNKS,
    reconnect: bool = False,
    seconds: float = PHASE_SECONDS,
) -> dict:
    command = [PYTHON, str(BENCH / "loadgen.py"), "--url", url, "--watch-pid", str(pid)]
    command += ["--concurrency", str(concurrency), "--requests", str(requests)]
    command += ["--chunks", str(chunks), "--max-seconds", str(seconds)]
    if reconnect:
        command.append("--reconnect")
    done = subprocess.run(command, check=True, capture_output=True, text=True)
    return summarize(json.loads(done.stdout))


def percentile(values: list[float], fraction: float) -> float:
    """Nearest rank: the smallest value with at least `fraction` of them at or below it."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * fraction // 1))
    return ordered[int(rank) - 1]


def summarize(result: dict) -> dict:
    samples = result.pop("samples")
    good = []
    errors: dict[str, int] = {}
    for s in samples:
        if s["status"] == 200 and not s["error"]:
            good.append(s)
        else:
            key = s["error"] or f"HTTP {s['status']}"
            errors[key] = errors.get(key, 0) + 1
    events = sum(s["events"] for s in good)
    n = len(samples)
    cpu = result.get("cpu_s", 0.0)
    return {
        **result,
        "requests": n,
        "errors": sum(errors.values()) + result["warmup_errors"],
        "error_kinds": errors,
        "events": events,
        "ttfb_p50_ms": percentile([s["ttfb_ms"] for s in good], 0.50),
        "ttfb_p99_ms": percentile([s["ttfb_ms"] for s in good], 0.99),
        "head_p50_ms": percentile([s["head_ms"] for s in good], 0.50),
        "total_p50_ms": percentile([s["total_ms"] for s in good], 0.50),
        "total_p99_ms": percentile([s["total_ms"] for s in good], 0.99),
        "chunks_per_s": events / result["wall_s"],
        "cpu_ms_per_request": cpu * 1000 / n if n else float("nan"),
        "cpu_us_per_chunk": cpu * 1e6 / events if events else float("nan"),
        "loadgen_core": result["loadgen_cpu_s"] / result["wall_s"],
    }


def idle_cpu_ms_per_s(pid: int, seconds: float = 2.0) -> float:
    before = read_cpu_seconds(pid)
    time.sleep(seconds)
    return (read_cpu_seconds(pid) - before) * 1000 / seconds


def run_target(
    name: str, completions: str, gateway: Server, upstream: Server, direct: dict[int, dict]
) -> dict:
    """Every concurrency of the plan through one gateway; direct runs fill `direct` once."""
    print(f"{name}: idle CPU", end=" ", flush=True)
    # The first request builds crossbar's runtime; then the idle cost of its timers.
    load(completions, gateway.pid, 1, 1)
    report: dict = {"idle_cpu_ms_per_s": idle_cpu_ms_per_s(gateway.pid), "phases": []}
    print(f"{report['idle_cpu_ms_per_s']:.1f} ms/s; concurrency", end="", flush=True)
    for concurrency, requests in PLAN:
        print(f" {concurrency}", end="", flush=True)
        if concurrency not in direct:
            # llama-server closes the connection after every stream: so does the fake, and
            # the direct clients connect anew each time, the connect counting in their time.
            direct[concurrency] = load(
                upstream.url + "/v1/chat/completions", upstream.pid, concurrency, requests,
                reconnect=True,
            )  # fmt: skip
        phase = load(completions, gateway.pid, concurrency, requests)
        report["phases"].append(added(phase, direct[concurrency]))
    print(" done", flush=True)
    return report


def added(phase: dict, direct: dict) -> dict:
    for key in ("ttfb_p50_ms", "ttfb_p99_ms", "total_p50_ms"):
        phase["added_" + key] = phase[key] - direct[key]
    phase["direct"] = direct
    return phase


def cost_split(gateway: Server, phases: list[dict]) -> dict:
    """CPU per request and per chunk, from the same clients asking for 1 and for 64 tokens."""
    completions = gateway.url + "/bench/v1/chat/completions"
    one = load(completions, gateway.pid, SPLIT_CONCURRENCY, SPLIT_REQUESTS, chunks=1)
    full = next(p for p in phases if p["concurrency"] == SPLIT_CONCURRENCY)
    per_chunk_ms = (full["cpu_ms_per_request"] - one["cpu_ms_per_request"]) / (CHUNKS - 1)
    return {
        "concurrency": SPLIT_CONCURRENCY,
        "one_token_cpu_ms_per_request": one["cpu_ms_per_request"],
        "cpu_ms_per_request": one["cpu_ms_per_request"] - per_chunk_ms,
        "cpu_us_per_chunk": per_chunk_ms * 1000,
        "one_token_errors": one["errors"],
    }


# Printing.


def print_table(name: str, report: dict) -> None:
    print(f"\n{name} (64-chunk streams, {TOKEN_DELAY * 1000:g} ms between upstream tokens)")
    print(
        f"{'conc':>5} {'reqs':>5} {'+TTFB p50':>10} {'+TTFB p99':>10} {'+total p50':>11}"
        f" {'chunks/s':>9} {'direct':>7} {'CPU/req':>9} {'CPU/chunk':>10} {'RSS':>7}"
        f" {'errors':>6} {'loadgen':>8}"
    )
    for p in report["phases"]:
        print(
            f"{p['concurrency']:>5} {p['requests']:>5} {p['added_ttfb_p50_ms']:>7.2f} ms"
            f" {p['added_ttfb_p99_ms']:>7.2f} ms {p['added_total_p50_ms']:>8.1f} ms"
            f" {p['chunks_per_s']:>9,.0f} {p['direct']['chunks_per_s']:>7,.0f}"
            f" {p['cpu_ms_per_request']:>6.2f} ms {p['cpu_us_per_chunk']:>7.1f} µs"
            f" {p['rss_peak_mb']:>4.0f} MB {p['errors']:>6} {p['loadgen_core']:>7.0%}"
        )
    print(
        f"{'':>5} {'':>5} {'TTFB p50':>10} {'TTFB p99':>10} {'total p50':>11}"
        f" {'busy':>5}   direct upstream, then through {name}, ms; busy: cores in use"
    )
    for p in report["phases"]:
        d = p["direct"]
        print(
            f"{p['concurrency']:>5} {d['requests']:>5} {d['ttfb_p50_ms']:>10.2f}"
            f" {d['ttfb_p99_ms']:>10.2f} {d['total_p50_ms']:>11.1f}"
            f" {d['machine_busy_cores']:>5.2f}   direct"
        )
        print(
            f"{'':>5} {p['requests']:>5} {p['ttfb_p50_ms']:>10.2f} {p['ttfb_p99_ms']:>10.2f}"
            f" {p['total_p50_ms']:>11.1f} {p['machine_busy_cores']:>5.2f}   {name}"
            f" (CPU: event loop {p['thread_cpu_s']['main']:.2f} s,"
            f" other threads {p['thread_cpu_s']['other']:.2f} s; {p['threads_peak']} threads)"
        )
    for p in report["phases"]:
        if p["error_kinds"] or p["warmup_errors"]:
            print(f"  errors at concurrency {p['concurrency']}: {p['error_kinds']}", end="")
            print(f" (+{p['warmup_errors']} in warm-up)")
        if p["loadgen_core"] > LOADGEN_BUSY:
            print(f"  at concurrency {p['concurrency']} the load generator was busy: its figures")
            print("  are a lower bound of what the gateway could do")
        if p["direct"]["loadgen_core"] > LOADGEN_BUSY:
            print(
                f"  at concurrency {p['concurrency']} the direct run kept the load generator busy"
                f" ({p['direct']['loadgen_core']:.0%} of a core): its latencies are high,"
                " and what the gateway adds is understated"
            )
    print(f"idle: {report['idle_cpu_ms_per_s']:.1f} ms of CPU per second")


def print_targets(report: dict) -> None:
    by = {p["concurrency"]: p for p in report["phases"]}
    split = report["split"]
    rows = [
        ("added TTFB p50 at concurrency 8", by[8]["added_ttfb_p50_ms"], 2.0, "ms"),
        ("added TTFB p99 at concurrency 32", by[32]["added_ttfb_p99_ms"], 10.0, "ms"),
        ("CPU per request (fixed part)", split["cpu_ms_per_request"], 1.5, "ms"),
        ("CPU per streamed chunk (marginal)", split["cpu_us_per_chunk"], 40.0, "µs"),
        ("errors at concurrency 512", by[512]["errors"], 0, ""),
        ("RSS at concurrency 512", by[512]["rss_peak_mb"], 300.0, "MB"),
    ]
    print(
        f"\ntargets (CPU split at concurrency {split['concurrency']}: 1-token requests cost"
        f" {split['one_token_cpu_ms_per_request']:.2f} ms; the rest is per chunk)"
    )
    for label, value, limit, unit in rows:
        verdict = "met" if value <= limit else f"{value / limit:.1f}x the target" if limit else "no"
        print(f"  {label:<36} {value:>8.2f} {unit:<2} target ≤ {limit:g} {unit:<2}  {verdict}")


def print_comparison(crossbar: dict, other: dict) -> None:
    print("\ncrossbar vs LiteLLM, same upstream, same load")
    print(
        f"{'conc':>5} {'CPU/req crossbar':>17} {'LiteLLM':>9} {'ratio':>6}"
        f" {'chunks/s crossbar':>18} {'LiteLLM':>8} {'ratio':>6}"
        f" {'+TTFB p50 crossbar':>19} {'LiteLLM':>9} {'errors':>7} {'RSS':>11}"
    )
    for c, o in zip(crossbar["phases"], other["phases"], strict=True):
        print(
            f"{c['concurrency']:>5} {c['cpu_ms_per_request']:>14.2f} ms"
            f" {o['cpu_ms_per_request']:>6.1f} ms"
            f" {o['cpu_ms_per_request'] / c['cpu_ms_per_request']:>5.1f}x"
            f" {c['chunks_per_s']:>18,.0f} {o['chunks_per_s']:>8,.0f}"
            f" {c['chunks_per_s'] / o['chunks_per_s']:>5.1f}x"
            f" {c['added_ttfb_p50_ms']:>16.2f} ms {o['added_ttfb_p50_ms']:>6.1f} ms"
            f" {c['errors']:>3}/{o['errors']:<3}"
            f" {c['rss_peak_mb']:>4.0f}/{o['rss_peak_mb']:<4.0f}MB"
        )
    print("  (targets: LiteLLM's CPU per request ≥ 10x crossbar's; crossbar's chunks/s ≥ 5x)")


def machine() -> dict:
    cpu = next(
        (line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
         if line.startswith("model name")),
        platform.processor(),
    )  # fmt: skip
    memory_kb = int(Path("/proc/meminfo").read_text().split()[1])
    return {
        "cpus": os.cpu_count(),
        "cpu_model": cpu,
        "memory_gb": round(memory_kb / 1024**2, 1),
        "python": platform.python_version(),
        "kernel": platform.release(),
    }


def litellm_version() -> str:
    python = LITELLM.parent / "python"
    done = subprocess.run(
        [str(python), "-c", "import importlib.metadata as m; print(m.version('litellm'))"],
        capture_output=True,
        text=True,
    )
    return done.stdout.strip() or "unknown"


# Profiling.


def profile(gateway: Server, out: Path, concurrency: int) -> None:
    """py-spy on the gateway while clients stream at `concurrency`; prints where CPU went.

    py-spy stops the process for each sample (its default), so every stack is whole; that
    slows the gateway by a fifth or so, which changes how much it gets done, not where.
    """
    pyspy = shutil.which("py-spy", path=str(Path(PYTHON).parent)) or shutil.which("py-spy")
    if pyspy is None:
        sys.exit("py-spy is not installed: `.venv/bin/pip install py-spy` (not a requirement)")
    raw = out.with_suffix(".txt")
    completions = gateway.url + "/bench/v1/chat/completions"
    load(completions, gateway.pid, concurrency, 1)  # the runtime and the connections
    recorder = subprocess.Popen(
        [pyspy, "record", "--pid", str(gateway.pid), "--rate", str(PROFILE_RATE),
         "--format", "raw", "--threads", "--output", str(raw),
         "--duration", str(int(PROFILE_SECONDS))],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    time.sleep(1.0)
    phase = load(completions, gateway.pid, concurrency, 10_000, seconds=PROFILE_SECONDS - 3)
    _, error = recorder.communicate()
    if recorder.returncode != 0 or not raw.exists():
        sys.exit(f"py-spy failed: {error.decode(errors='replace')}")
    text = (
        f"profiled {phase['requests']} requests at concurrency {concurrency}:"
        f" {phase['cpu_ms_per_request']:.2f} ms CPU per request,"
        f" {phase['cpu_us_per_chunk']:.1f} µs per chunk, {phase['errors']} errors\n\n"
        + report(raw.read_text(errors="replace"))
    )
    out.with_suffix(".report.txt").write_text(text + "\n")
    print(text)
    print(f"\nraw stacks: {raw.relative_to(ROOT)}; this report: {raw.stem}.report.txt")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compare", action="store_true", help="also through LiteLLM's proxy")
    parser.add_argument(
        "--profile",
        type=int,
        nargs="?",
        const=PROFILE_CONCURRENCY,
        metavar="CONCURRENCY",
        help=f"py-spy the gateway instead, at this concurrency ({PROFILE_CONCURRENCY})",
    )
    parser.add_argument("--rev", help="benchmark this commit (default: the working tree)")
    parser.add_argument(
        "--server",
        choices=SERVERS,
        default="daphne",
        help="the ASGI server in front of crossbar (default daphne)",
    )
    args = parser.parse_args(argv)
    RESULTS.mkdir(exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    started = time.monotonic()
    results: dict = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "server": {"name": args.server, "version": server_version(args.server)},
        "load_average_before": os.getloadavg(),
        "workload": {
            "chunks": CHUNKS,
            "token_delay_s": TOKEN_DELAY,
            "plan": PLAN,
            "phase_seconds": PHASE_SECONDS,
        },
    }
    load_before = os.getloadavg()[0]
    if load_before > 0.5:
        print(f"note: the machine is busy (load average {load_before:.1f}): figures will be noisy")
    with tempfile.TemporaryDirectory(prefix="crossbar-bench-") as tmp:
        work = Path(tmp)
        source, results["code"] = source_tree(work, args.rev)
        code = results["code"]
        print(
            f"crossbar at {code['commit']}"
            + (" + uncommitted changes" if code["uncommitted"] else "")
            + ("" if code["working_tree"] else " (exported)")
            + f", served by {args.server} {results['server']['version']}"
        )
        with (
            fake_upstream(work) as upstream,
            crossbar(work, upstream, source, args.server) as gateway,
        ):
            try:
                if args.profile is not None:
                    profile(gateway, RESULTS / f"profile-c{args.profile}-{stamp}", args.profile)
                    return
                direct: dict[int, dict] = {}
                completions = gateway.url + "/bench/v1/chat/completions"
                report = run_target("crossbar", completions, gateway, upstream, direct)
                report["split"] = cost_split(gateway, report["phases"])
                results["crossbar"] = report
                if args.compare:
                    with litellm(work, upstream) as proxy:
                        completions = proxy.url + "/v1/chat/completions"
                        results["litellm"] = run_target(
                            "LiteLLM", completions, proxy, upstream, direct
                        )
                    results["litellm"]["version"] = litellm_version()
            finally:
                for name in ("crossbar", "litellm"):
                    if (work / f"{name}.log").exists():
                        shutil.copy(work / f"{name}.log", RESULTS / f"{name}-{stamp}.log")
    print_table("crossbar", results["crossbar"])
    print_targets(results["crossbar"])
    if args.compare:
        print_table("LiteLLM", results["litellm"])
        print_comparison(results["crossbar"], results["litellm"])
    log = (RESULTS / f"crossbar-{stamp}.log").read_text(errors="replace")
    problems = [line for line in log.splitlines() if "ERROR" in line or "Traceback" in line]
    print(f"\ngateway log: {len(problems)} error lines (bench/results/crossbar-{stamp}.log)")
    for line in problems[:10]:
        print("  " + line[:200])
    path = RESULTS / f"{'compare' if args.compare else 'bench'}-{stamp}.json"
    path.write_text(json.dumps(results, indent=1, default=str))
    print(f"results: {path.relative_to(ROOT)}; {time.monotonic() - started:.0f} s in all")


if __name__ == "__main__":
    main()
