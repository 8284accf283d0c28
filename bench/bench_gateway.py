"""Streaming chat completions through crossbar and its floor, against the same upstream direct.

    .venv/bin/python bench/bench_gateway.py             # make bench: crossbar and the floor
    .venv/bin/python bench/bench_gateway.py --compare   # make bench-compare: LiteLLM too
    .venv/bin/python bench/bench_gateway.py --targets crossbar floor floor+httpcore
    .venv/bin/python bench/bench_gateway.py --profile   # py-spy on the first target (c=32, or N)
    .venv/bin/python bench/bench_gateway.py --rev HEAD  # a commit instead of the working tree
    .venv/bin/python bench/bench_gateway.py --server uvicorn   # another ASGI server (SERVERS)
    .venv/bin/python bench/bench_gateway.py --targets crossbar+stages floor+stages --concurrency 8

Starts a lean fake llama-server (`bench/fake_upstream.py`), then every target (bench/targets.py:
crossbar as users run it, on its own SQLite database, DEBUG off, log level INFO; the floor,
bench/floor_app.py, a bare pass-through on the same server and client library; LiteLLM...),
and drives them with `bench/loadgen.py` in a process of its own. At each concurrency the same
workload goes direct to the upstream, then through each target in turn (the order turning from
one concurrency to the next), so "added" figures are each target's share alone and the noise
of the machine falls on all of them alike. A target's
CPU comes from /proc/<pid>/stat (all its threads), its RSS from /proc/<pid>/status; for a
target of several processes (`+workers2`), summed over the supervisor and its workers. A target
with a Redis (`+redis`, `+workers2`) also reports the Redis commands and round trips per request
of each phase, and the memory and keys Redis holds after the warm-up and at the end.

Prints a table per target, then the targets side by side with their ratios to the floor and
to direct, then the issue's targets; writes all of it, with the settings and the machine, to
bench/results/ as JSON. bench/README.md says what every column means.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import stages
import tables

# This directory is on sys.path when the script runs.
from loadgen import read_cpu_seconds, read_tree_cpu, tree_cpu_between
from processes import (
    BENCH,
    PYTHON,
    RESULTS,
    ROOT,
    SERVERS,
    TOKEN_DELAY,
    Server,
    fake_upstream,
    litellm_version,
    machine,
    redis_state,
    server_version,
    source_tree,
)
from profile_report import report
from targets import Target, parse_all, start

CHUNKS = 64
# (concurrency, measured requests per client); every client also sends one warm-up request.
PLAN = ((1, 15), (8, 16), (32, 10), (128, 4), (512, 1))
PHASE_SECONDS = 8.0  # no client starts a new request after this; LiteLLM needs the cap
# The per-request part of the CPU cost: the same clients asking for one token each.
SPLIT_CONCURRENCY, SPLIT_REQUESTS = 8, 40
IDLE_SECONDS = 2.0
PROFILE_CONCURRENCY, PROFILE_SECONDS, PROFILE_RATE = 32, 20.0, 200
DEFAULT_TARGETS = ("crossbar", "floor")
# `--compare` (make bench-compare): what issue 22 judges, on both of crossbar_serve's servers
# (N = 1 and 2 workers side by side), and LiteLLM; at the concurrencies it judges, with more
# requests per client than PLAN's, for steadier medians.
COMPARE_TARGETS = (
    "crossbar", "floor", "crossbar@uvicorn", "floor@uvicorn", "crossbar+workers2",
    "crossbar@uvicorn+workers2", "litellm",
)  # fmt: skip
COMPARE_PLAN = ((8, 24), (32, 12))


def completions_url(target: Target, server: Server) -> str:
    if target.kind == "litellm":
        return server.url + "/v1/chat/completions"
    return server.url + "/bench/v1/chat/completions"  # the floors ignore the route segment


def load(
    url: str,
    server: Server,
    concurrency: int,
    requests: int,
    *,
    chunks: int = CHUNKS,
    reconnect: bool = False,
    seconds: float = PHASE_SECONDS,
    new_conversations: bool = False,
    keep_samples: bool = False,
) -> dict:
    command = [PYTHON, str(BENCH / "loadgen.py"), "--url", url, "--watch-pid", str(server.pid)]
    if server.tree:
        command.append("--watch-tree")
    if server.redis_url:
        command += ["--redis-url", server.redis_url]
    command += ["--concurrency", str(concurrency), "--requests", str(requests)]
    command += ["--chunks", str(chunks), "--max-seconds", str(seconds)]
    if reconnect:
        command.append("--reconnect")
    if new_conversations:
        command.append("--new-conversations")
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"the load generator failed against {url}:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout)
    samples = result["samples"] if keep_samples else None
    summary = summarize(result)
    summary["window"] = (started, time.perf_counter())
    if samples is not None:
        summary["samples"] = samples  # for bench/stages.py; dropped once it has read them
    return summary


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
    if "redis" in result:
        redis = result["redis"]
        for key in ("commands", "round_trips", "scripts"):
            redis[key + "_per_request"] = redis[key] / n if n else float("nan")
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


def added(phase: dict, direct: dict) -> dict:
    for key in ("ttfb_p50_ms", "ttfb_p99_ms", "total_p50_ms"):
        phase["added_" + key] = phase[key] - direct[key]
    phase["direct"] = direct
    return phase


def cpu_seconds(server: Server) -> dict[int, tuple[float, float]]:
    """The CPU of the process, or of each process of its tree (loadgen.read_tree_cpu)."""
    if server.tree:
        return read_tree_cpu(server.pid)
    return {server.pid: (read_cpu_seconds(server.pid), 0.0)}


def run_plan(
    running: list[tuple[Target, Server]], upstream: Server, plan: tuple[tuple[int, int], ...]
) -> dict[str, dict]:
    """Every concurrency of the plan: direct first, then each target; reports by label."""
    # `served`: every request the target answered, warm-ups included (for its log's lines).
    reports: dict[str, dict] = {target.label: {"phases": [], "served": 1} for target, _ in running}
    print("warm-up", end="", flush=True)
    for target, server in running:
        # The first request builds crossbar's runtime and the connections.
        load(completions_url(target, server), server, 1, 1)
    for target, server in running:
        if server.redis_url:
            reports[target.label]["redis_after_warmup"] = redis_state(server.redis_url)
    # Every target idles at once: the cost of its timers (health poller, config watcher).
    before = {target.label: cpu_seconds(server) for target, server in running}
    time.sleep(IDLE_SECONDS)
    for target, server in running:
        used = tree_cpu_between(before[target.label], cpu_seconds(server))
        idle = sum(total for total, _ in used.values()) * 1000 / IDLE_SECONDS
        reports[target.label]["idle_cpu_ms_per_s"] = idle
    print("; concurrency", end="", flush=True)
    for step, (concurrency, requests) in enumerate(plan):
        print(f" {concurrency}", end="", flush=True)
        # llama-server closes the connection after every stream: so does the fake, and the
        # direct clients connect anew each time, the connect counting in their time.
        direct = load(
            upstream.url + "/v1/chat/completions", upstream, concurrency, requests,
            reconnect=True,
        )  # fmt: skip
        # The order turns at each concurrency: whoever runs right after direct (the fake still
        # closing its connections) or last (after the others) is not always the same target.
        turn = step % len(running)
        for target, server in running[turn:] + running[:turn]:
            phase = load(completions_url(target, server), server, concurrency, requests,
                         keep_samples=server.stages is not None)  # fmt: skip
            reports[target.label]["phases"].append(added(phase, direct))
            reports[target.label]["served"] += phase["requests"] + concurrency  # and warm-ups
    print("; per-request cost", end="", flush=True)
    for target, server in running:
        if target.kind != "litellm":  # ~40 ms a request: 320 more would take long
            if split := cost_split(target, server, reports[target.label]):
                reports[target.label]["split"] = split
                reports[target.label]["served"] += split["one_token_requests"]
    for target, server in running:
        if server.redis_url:  # after all its load, the gateway still running
            reports[target.label]["redis_end"] = redis_state(server.redis_url)
    print(" done", flush=True)
    return reports


def cost_split(target: Target, server: Server, report: dict) -> dict:
    """CPU per request and per chunk, from the same clients asking for 1 and for 64 tokens."""
    full = next((p for p in report["phases"] if p["concurrency"] == SPLIT_CONCURRENCY), None)
    if full is None:
        return {}  # the plan left that concurrency out
    url = completions_url(target, server)
    one = load(url, server, SPLIT_CONCURRENCY, SPLIT_REQUESTS, chunks=1)
    per_chunk_ms = (full["cpu_ms_per_request"] - one["cpu_ms_per_request"]) / (CHUNKS - 1)
    return {
        "concurrency": SPLIT_CONCURRENCY,
        "one_token_cpu_ms_per_request": one["cpu_ms_per_request"],
        "cpu_ms_per_request": one["cpu_ms_per_request"] - per_chunk_ms,
        "cpu_us_per_chunk": per_chunk_ms * 1000,
        "one_token_errors": one["errors"],
        "one_token_requests": one["requests"] + SPLIT_CONCURRENCY,  # and its warm-ups
        **({"one_token_redis": one["redis"]} if "redis" in one else {}),
    }


def profile(
    target: Target, server: Server, out: Path, concurrency: int, chunks: int = CHUNKS
) -> None:
    """py-spy on a target while clients stream at `concurrency` (`chunks` tokens a request: 1
    for a profile of the fixed cost of a request); prints where CPU went.

    py-spy stops the process for each sample (its default), so every stack is whole; that
    slows the process by a fifth or so, which changes how much it gets done, not where.
    """
    pyspy = shutil.which("py-spy", path=str(Path(PYTHON).parent)) or shutil.which("py-spy")
    if pyspy is None:
        sys.exit("py-spy is not installed: `.venv/bin/pip install -r bench/requirements.txt`")
    if server.tree:
        sys.exit(f"--profile follows one process; {target.label} runs several (profile"
                 " crossbar+redis for the code they run)")  # fmt: skip
    raw = out.with_suffix(".txt")
    url = completions_url(target, server)
    load(url, server, concurrency, 1)  # the runtime and the connections
    recorder = subprocess.Popen(
        [pyspy, "record", "--pid", str(server.pid), "--rate", str(PROFILE_RATE),
         "--format", "raw", "--threads", "--output", str(raw),
         "--duration", str(int(PROFILE_SECONDS))],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    time.sleep(1.0)
    phase = load(url, server, concurrency, 10_000, chunks=chunks, seconds=PROFILE_SECONDS - 3)
    _, error = recorder.communicate()
    if recorder.returncode != 0 or not raw.exists():
        sys.exit(f"py-spy failed: {error.decode(errors='replace')}")
    text = (
        f"{target.label}: profiled {phase['requests']} requests at concurrency {concurrency}:"
        f" {phase['cpu_ms_per_request']:.2f} ms CPU per request,"
        f" {phase['cpu_us_per_chunk']:.1f} µs per chunk, {phase['errors']} errors\n\n"
        + report(raw.read_text(errors="replace"), phase["cpu_ms_per_request"])
    )
    out.with_suffix(".report.txt").write_text(text + "\n")
    print(text)
    print(f"\nraw stacks: {raw.relative_to(ROOT)}; this report: {raw.stem}.report.txt")


def stage_reports(running: list[tuple[Target, Server]], reports: dict[str, dict]) -> None:
    """For each `+stages` target, once it has stopped (its lever writes at exit): where the
    first token waited, per concurrency (bench/stages.py); the samples are dropped then."""
    for target, server in running:
        report = reports[target.label]
        if server.stages is None:
            continue
        by_port = stages.read_records(server.stages)
        report["stages"] = {
            p["concurrency"]: stages.summary(p.pop("samples"), by_port) for p in report["phases"]
        }


def plan_of(
    concurrencies: list[int] | None, compare: bool, requests: int | None = None
) -> tuple[tuple[int, int], ...]:
    """The phases to run: the concurrencies asked for (with PLAN's or COMPARE_PLAN's requests
    per client), else COMPARE_PLAN for `--compare`, else PLAN; `requests` measured requests
    per client at every concurrency, when given."""
    base: tuple[tuple[int, int], ...] = COMPARE_PLAN if compare else PLAN
    if concurrencies:
        known = dict(PLAN) | dict(base)
        base = tuple((c, known.get(c, 10)) for c in concurrencies)
    if requests is not None:
        base = tuple((c, requests) for c, _ in base)
    return base


def log_lines(log: Path, served: int) -> str:
    """What a gateway's log says per request: its proxy lines (one per proxied request at
    INFO, routing/proxy/record.py) against the requests served, and its other lines."""
    lines = log.read_text(errors="replace").splitlines()
    proxied = sum(1 for line in lines if " crossbar.proxy route=" in line)
    return (
        f"{proxied} proxy lines for {served} requests ({proxied / served:.2f} per request),"
        f" {len(lines) - proxied} other lines"
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--compare",
        action="store_true",
        help="add the target litellm; without --targets, measure "
        + " ".join(COMPARE_TARGETS) + "; without --concurrency, at "
        + " and ".join(str(c) for c, _ in COMPARE_PLAN),
    )  # fmt: skip
    parser.add_argument(
        "--targets",
        nargs="+",
        metavar="TARGET",
        help="what to measure, KIND[@SERVER][+LEVER...] (bench/targets.py; default: "
        + " ".join(DEFAULT_TARGETS) + ")",
    )  # fmt: skip
    parser.add_argument(
        "--concurrency",
        type=int,
        nargs="+",
        metavar="N",
        help="only these concurrencies (default: "
        + " ".join(str(c) for c, _ in PLAN) + "; some tables need 8, 128 and 512)",
    )  # fmt: skip
    parser.add_argument(
        "--profile",
        type=int,
        nargs="?",
        const=PROFILE_CONCURRENCY,
        metavar="CONCURRENCY",
        help=f"py-spy the first target instead, at this concurrency ({PROFILE_CONCURRENCY})",
    )
    parser.add_argument(
        "--profile-chunks",
        type=int,
        default=CHUNKS,
        metavar="N",
        help=f"tokens per request while profiling ({CHUNKS}; 1: the fixed cost of a request)",
    )
    parser.add_argument(
        "--requests",
        type=int,
        metavar="N",
        help="measured requests per client at every concurrency (default: PLAN's, 16 at 8"
        " and 10 at 32; more for steadier CPU figures, fewer for a shorter run)",
    )
    parser.add_argument("--rev", help="benchmark this commit (default: the working tree)")
    parser.add_argument(
        "--server",
        choices=SERVERS,
        default="crossbar_serve",
        help="the ASGI server of every target without @SERVER (default crossbar_serve,"
        " what `make run` serves)",
    )
    args = parser.parse_args(argv)
    if args.targets is None:
        args.targets = list(COMPARE_TARGETS if args.compare else DEFAULT_TARGETS)
    if args.compare and "litellm" not in args.targets:
        args.targets.append("litellm")
    args.plan = plan_of(args.concurrency, args.compare, args.requests)
    try:
        args.parsed = parse_all(args.targets, args.server)
    except ValueError as exc:
        parser.error(str(exc))
    if args.profile is not None:
        args.parsed = args.parsed[:1]
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    targets: list[Target] = args.parsed
    RESULTS.mkdir(exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    started = time.monotonic()
    servers = sorted({t.server for t in targets if t.server})
    results: dict = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "server": {"name": args.server, "version": server_version(args.server)},
        "servers": {name: server_version(name) for name in servers},
        "load_average_before": os.getloadavg(),
        "workload": {
            "chunks": CHUNKS,
            "token_delay_s": TOKEN_DELAY,
            "plan": args.plan,
            "phase_seconds": PHASE_SECONDS,
        },
        "targets": {},
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
            + f"; targets {', '.join(t.label for t in targets)}"
            + f"; server {args.server} {results['server']['version']}"
        )
        with contextlib.ExitStack() as stack:
            upstream = stack.enter_context(fake_upstream(work))
            running = []
            for index, target in enumerate(targets):
                code = source
                if target.rev is not None:
                    code, exported = source_tree(work, target.rev)
                    results.setdefault("revs", {})[target.label] = exported
                running.append(
                    (target, stack.enter_context(start(target, work, upstream, code, index)))
                )
            try:
                if args.profile is not None:
                    target, server = running[0]
                    name = f"profile-{target.label}-c{args.profile}-t{args.profile_chunks}-{stamp}"
                    profile(target, server, RESULTS / name, args.profile, args.profile_chunks)
                    return
                reports = run_plan(running, upstream, args.plan)
            finally:
                for target, server in running:
                    if server.log.exists():
                        shutil.copy(server.log, RESULTS / f"{target.label}-{stamp}.log")
                    if server.redis_log is not None and server.redis_log.exists():
                        shutil.copy(server.redis_log, RESULTS / f"{target.label}-redis-{stamp}.log")
        stage_reports(running, reports)  # the targets have stopped: their levers have written
    for target in targets:
        reports[target.label]["target"] = {
            "kind": target.kind, "server": target.server, "levers": list(target.levers),
            "processes": target.workers + (target.workers > 1),  # a supervisor with workers
            "redis": target.has_redis,
        }  # fmt: skip
        if target.kind == "litellm":
            reports[target.label]["version"] = litellm_version()
    results["targets"] = reports
    if "crossbar" in reports:
        results["crossbar"] = reports["crossbar"]  # where runs before the targets kept it
    kind = "compare" if any(t.kind == "litellm" for t in targets) else "bench"
    path = RESULTS / f"{kind}-{stamp}.json"
    path.write_text(json.dumps(results, indent=1, default=str))  # before the tables: kept
    for target in targets:
        tables.print_table(target.label, reports[target.label], TOKEN_DELAY)
    tables.print_side_by_side(targets, reports)
    stages.print_stages(reports)
    tables.print_targets(targets, reports)
    problems = []
    for target in targets:
        log = RESULTS / f"{target.label}-{stamp}.log"
        lines = log.read_text(errors="replace").splitlines() if log.exists() else []
        problems += [
            (target.label, line) for line in lines if "ERROR" in line or "Traceback" in line
        ]
    print(f"\nlogs: {len(problems)} error lines (bench/results/*-{stamp}.log)")
    for target in targets:
        log = RESULTS / f"{target.label}-{stamp}.log"
        if target.is_gateway and log.exists():
            print(f"  {target.label}: {log_lines(log, reports[target.label]['served'])}")
    for label, line in problems[:10]:
        print(f"  {label}: {line[:200]}")
    warnings = [
        (target.label, line)
        for target in targets
        if (log := RESULTS / f"{target.label}-{stamp}.log").exists()
        for line in log.read_text(errors="replace").splitlines()
        if " WARNING " in line
    ]
    if warnings:  # e.g. Redis unreachable for a moment, a worker replaced
        print(f"logs: {len(warnings)} warning lines; the first:")
        for label, line in warnings[:5]:
            print(f"  {label}: {line[:200]}")
    print(f"results: {path.relative_to(ROOT)}; {time.monotonic() - started:.0f} s in all")


if __name__ == "__main__":
    main()
