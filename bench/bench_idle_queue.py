"""The gateway's CPU while requests wait in a queue and nothing changes.

    .venv/bin/python bench/bench_idle_queue.py                     # the working tree
    .venv/bin/python bench/bench_idle_queue.py --rev HEAD~1 --rev HEAD   # commits, one run

Starts the gateway as `make run` does (`manage.py crossbar_serve` on a free port, its own
SQLite database in a temporary directory, DEBUG off, log level WARNING) in front of the lean
fake upstream (`bench/fake_upstream.py`), with one model whose `parallel = 1` and
`queue_max = 200`. One streaming request takes the slot and holds it: the fake sends its
response head at once and its first token only after `HOLD_SECONDS`, so the slot stays taken
and no byte moves (the gateway's server holds that head until the first body byte). Then
`--queued` more streaming requests (150) join the queue and wait. Once
`/metrics` shows them all queued, the gateway's CPU (utime + stime of all its threads, from
/proc/<pid>/stat, in 10 ms ticks: 1 ms/s of resolution over 10 s) is read over `--seconds`
while nothing changes, and printed as ms of CPU per second; the same is read over
`--baseline-seconds` before the queue fills (the slot held, nobody waiting), which is what the
gateway costs with no queue: its health poller and config watcher. Afterwards `/metrics` must
still show the slot held and every request queued, else the figure is not of a still queue and
the run says so.

With `--rev` (repeatable) each commit is exported with `git archive` (as `bench_gateway.py
--rev` does) and measured in turn, so a change and its parent compare in one run. Results go to
bench/results/idle-queue-STAMP.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
import tempfile
import time
import urllib.request
from datetime import UTC, datetime
from pathlib import Path

# This directory is on sys.path when the script runs.
from loadgen import read_cpu_seconds, thread_count
from processes import RESULTS, ROOT, crossbar, fake_upstream, machine, source_tree

HOLD_SECONDS = 120.0  # the fake's delay before the holder's first token: past any measurement
MODEL = "test-model"
FLEET_TOML = """\
[[hosts]]
name = "fake"
url = "{{upstream}}"
notes = "bench/fake_upstream.py"

  [[hosts.models]]
  name = "{model}"
  parallel = 1
  queue_max = {queue_max}

[[routes]]
name = "bench"
default_model = "{model}"
hosts = ["fake"]
"""
QUEUE_MAX = 200
QUEUE_WAIT = 60.0  # seconds the queue may take to fill (a busy machine; crossbar admits fast)
QUIET = {"CROSSBAR_LOG_LEVEL": "WARNING"}  # as this bench's figures were measured


def request_bytes(port: int, number: int) -> bytes:
    body = json.dumps(
        {
            "model": MODEL,
            "stream": True,
            "max_tokens": 1,
            "messages": [{"role": "user", "content": f"idle-queue client {number}"}],
        }
    ).encode()
    head = (
        f"POST /bench/v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nAccept: text/event-stream\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def gauge(url: str, name: str) -> float | None:
    """One series of /metrics for the fake host and the model; None when it is not there."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    pattern = rf'^{name}\{{(?=[^}}]*host="fake")(?=[^}}]*model="{MODEL}")[^}}]*\}} (\S+)$'
    match = re.search(pattern, text, re.MULTILINE)
    return float(match[1]) if match else None


async def wait_for_gauge(url: str, name: str, value: float, within: float) -> float | None:
    deadline = time.monotonic() + within
    seen = None
    while time.monotonic() < deadline:
        seen = await asyncio.to_thread(gauge, url, name)
        if seen == value:
            return seen
        await asyncio.sleep(0.2)
    return seen


def cpu_ms_per_s(pid: int, seconds: float) -> float:
    before = read_cpu_seconds(pid)
    time.sleep(seconds)
    return (read_cpu_seconds(pid) - before) * 1000 / seconds


async def measure(url: str, pid: int, queued: int, seconds: float, baseline: float) -> dict:
    """Hold the slot, measure, fill the queue, measure again; every connection closed after."""
    port = int(url.rsplit(":", 1)[1])
    connections: list[asyncio.StreamWriter] = []
    try:
        # Its response head stays in the server until the first body byte (daphne writes
        # both at once), so the slot is seen taken in /metrics rather than by a head.
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        connections.append(writer)
        writer.write(request_bytes(port, 0))
        if await wait_for_gauge(url, "crossbar_in_flight", 1.0, QUEUE_WAIT) != 1.0:
            sys.exit("the gateway's /metrics never showed the slot held (crossbar_in_flight 1)")
        await asyncio.sleep(1.0)  # the metrics request's own work settles
        idle = await asyncio.to_thread(cpu_ms_per_s, pid, baseline) if baseline > 0 else None

        for number in range(1, queued + 1):
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(request_bytes(port, number))
            connections.append(writer)
        seen = await wait_for_gauge(url, "crossbar_queued", float(queued), QUEUE_WAIT)
        if seen != float(queued):
            sys.exit(f"{queued} requests sent, /metrics shows {seen} queued after {QUEUE_WAIT:g} s")
        await asyncio.sleep(1.0)
        threads = thread_count(pid)
        waiting = await asyncio.to_thread(cpu_ms_per_s, pid, seconds)
        still = (
            await asyncio.to_thread(gauge, url, "crossbar_in_flight"),
            await asyncio.to_thread(gauge, url, "crossbar_queued"),
        )
    finally:
        for writer in connections:
            writer.close()
    return {
        "queued": queued,
        "seconds": seconds,
        "cpu_ms_per_s_queued": waiting,
        "baseline_seconds": baseline,
        "cpu_ms_per_s_no_queue": idle,
        "threads": threads,
        "still": still == (1.0, float(queued)),
        "after": {"in_flight": still[0], "queued": still[1]},
    }


def run_one(rev: str | None, queued: int, seconds: float, baseline: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="crossbar-idle-queue-") as tmp:
        work = Path(tmp)
        source, code = source_tree(work, rev)
        if not (source / "crossbar_site" / "serve.py").exists():
            sys.exit(f"{code['commit']} has no `manage.py crossbar_serve` (crossbar_site/serve.py)")
        label = rev or "working tree"
        dirty = " + uncommitted" if code["uncommitted"] else ""
        print(f"{label} ({code['commit']}{dirty}): starting", end="", flush=True)
        fleet = FLEET_TOML.format(model=MODEL, queue_max=QUEUE_MAX)
        with (
            fake_upstream(work, token_delay=HOLD_SECONDS) as upstream,
            crossbar(work, upstream, source, "crossbar_serve", fleet, env=QUIET) as gateway,
        ):
            print(", measuring", end="", flush=True)
            result = asyncio.run(measure(gateway.url, gateway.pid, queued, seconds, baseline))
        print(" done", flush=True)
        return {"rev": label, **code, **result}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rev",
        action="append",
        help="measure this commit (repeat to compare; default: the working tree)",
    )
    parser.add_argument("--queued", type=int, default=150, help=f"requests waiting (≤ {QUEUE_MAX})")
    parser.add_argument("--seconds", type=float, default=10.0, help="the measured window")
    parser.add_argument(
        "--baseline-seconds", type=float, default=5.0, help="the window with no queue (0: skip)"
    )
    args = parser.parse_args(argv)
    if not 1 <= args.queued <= QUEUE_MAX:
        parser.error(f"--queued must be between 1 and {QUEUE_MAX}")
    if args.seconds <= 0:
        parser.error("--seconds must be positive")
    RESULTS.mkdir(exist_ok=True)
    started = time.monotonic()
    load = os.getloadavg()[0]
    if load > 0.5:
        print(f"note: the machine is busy (load average {load:.1f}): figures will be noisy")
    runs = [
        run_one(rev, args.queued, args.seconds, args.baseline_seconds)
        for rev in (args.rev or [None])
    ]
    print(
        f"\nCPU of the gateway process (manage.py crossbar_serve): one stream holds the only slot"
        f" and sends nothing;\n{args.queued} streaming requests wait behind it."
    )
    print(f"{'code':<24} {'no queue':>10} {f'{args.queued} queued':>12} {'threads':>8}")
    for run in runs:
        idle = run["cpu_ms_per_s_no_queue"]
        name = f"{run['rev']} ({run['commit']})"
        print(
            f"{name:<24} {'-' if idle is None else f'{idle:.1f} ms/s':>10}"
            f" {run['cpu_ms_per_s_queued']:>7.1f} ms/s {run['threads']:>8}"
            + ("" if run["still"] else f"  NOT STILL: afterwards {run['after']}")
        )
    print(
        f"(windows of {args.baseline_seconds:g} s and {args.seconds:g} s; /proc/<pid>/stat ticks"
        f" are 10 ms, so ±{10 / args.seconds:.0f} ms/s)"
    )
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    path = RESULTS / f"idle-queue-{stamp}.json"
    document: dict[str, object] = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine(),
    }
    document |= {"load_average_before": load, "runs": runs}
    path.write_text(json.dumps(document, indent=1))
    print(f"results: {path.relative_to(ROOT)}; {time.monotonic() - started:.0f} s in all")


if __name__ == "__main__":
    main()
