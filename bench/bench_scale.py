"""How crossbar's cost grows with its fleet and its conversations: `make bench-scale`.

    .venv/bin/python bench/bench_scale.py                      # everything, about 9 minutes
    .venv/bin/python bench/bench_scale.py --backings local --hosts 2 200 --conversations
    .venv/bin/python bench/bench_scale.py --rev HEAD~1         # a commit instead of the tree

For each backing (`local`: the state in the gateway's process; `redis`: shared through a
redis-server of its own) and each fleet size (`--hosts`, default 2, 20, 200): one gateway as
`make run` serves it (`manage.py crossbar_serve`, DEBUG off, log level WARNING), one route over
all the hosts, each host a port of one fake upstream process (bench/fake_upstream.py), 4 slots
per host. Measured, in this order:

- idle CPU: the gateway's CPU (and redis-server's) over `--idle-seconds` with no traffic, once
  every host has been polled up: the health poller's and the shared state's upkeep;
- CPU per request: `--concurrency` clients (16) streaming chats of `--chunks` chunks (16), every
  request a new conversation, `--requests` per client (40); the gateway's CPU over the measured
  part divided by the requests, with its peak RSS; on Redis, redis-server's CPU too and the
  round trips per request (INFO stats: the commands Redis read).

Then, at the largest fleet, for each `--conversations` count (default 1k, 10k, 100k): that many
conversations are made live first (in-process: by requests through the gateway, one token each,
which costs the gateway what they cost; on Redis: written into Redis as the gateway would, so a
100k run stays short), then the same CPU-per-request measure, and the memory each conversation
costs (RSS, or Redis's used_memory, before and after).

The figures are printed as tables and written to bench/results/scale-<time>.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import cast

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # routing, for the lease ids

from bench_gateway import load  # noqa: E402
from processes import (  # noqa: E402  (bench/ is not a package)
    BENCH,
    PYTHON,
    Server,
    crossbar,
    machine,
    redis_server,
    redis_state,
    source_tree,
    stop,
    wait_for,
)
from profile_report import report  # noqa: E402

RESULTS = BENCH / "results"
SLOTS_PER_HOST = 4
CLOCK_TICKS = 100


def fleet_toml(ports: list[int], slots: int) -> str:
    """One host per port of the fake upstream, one route `bench` over them all. (Formatted
    once more by processes.crossbar: the braces are doubled.)"""
    hosts = []
    for index, port in enumerate(ports):
        hosts.append(
            f'[[hosts]]\nname = "h{index:04d}"\nurl = "http://127.0.0.1:{port}"\n\n'
            f'  [[hosts.models]]\n  name = "test-model"\n  parallel = {slots}\n'
            f"  queue_max = {slots}\n"
        )
    names = ", ".join(f'"h{index:04d}"' for index in range(len(ports)))
    route = f'[[routes]]\nname = "bench"\ndefault_model = "test-model"\nhosts = [{names}]\n'
    return "\n".join(hosts) + "\n" + route


@contextlib.contextmanager
def upstream(work: Path, hosts: int) -> Iterator[tuple[Server, list[int]]]:
    """One fake upstream process answering on `hosts` ports the system picks."""
    listing = work / f"upstream-{hosts}.ports"
    log = work / f"upstream-{hosts}.log"
    listing.unlink(missing_ok=True)  # another backing's run of the same fleet left its own
    command = [PYTHON, str(BENCH / "fake_upstream.py"), "--token-delay", "0.002"]
    command += ["--count", str(hosts), "--ports-file", str(listing)]
    with log.open("wb") as output:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 30
            while not listing.exists():
                if process.poll() is not None or time.monotonic() > deadline:
                    sys.exit(f"the fake upstream did not start; its log ({log}):\n"
                             f"{log.read_text()}")  # fmt: skip
                time.sleep(0.05)
            ports = json.loads(listing.read_text())
            url = f"http://127.0.0.1:{ports[0]}"
            wait_for(url + "/health", process, "fake_upstream", log, 30)
            yield Server(url, process.pid, log), ports
        finally:
            stop(process)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def memory_bytes(pid: int, redis_url: str | None) -> float:
    """What holds the conversations: Redis's used_memory, or the gateway's RSS."""
    if redis_url:
        return float(cast(int, redis_state(redis_url)["used_memory"]))
    return rss_mb(pid) * 2**20


def hosts_up(url: str) -> int:
    """How many hosts the gateway's /metrics says are up."""
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    return sum(
        1
        for line in text.splitlines()
        if line.startswith("crossbar_host_state{") and 'state="up"' in line
        and line.rstrip().endswith(" 1.0")
    )  # fmt: skip


def wait_up(url: str, hosts: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while hosts_up(url) < hosts:
        if time.monotonic() > deadline:
            sys.exit(f"only {hosts_up(url)} of {hosts} hosts came up within {timeout:g} s")
        time.sleep(0.5)


def idle(pids: dict[str, int], seconds: float) -> dict[str, float]:
    """Each process's CPU over `seconds` of no traffic, as a share of one core."""
    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    time.sleep(seconds)
    return {name: (cpu_seconds(pid) - before[name]) / seconds for name, pid in pids.items()}


def idle_profile(pid: int, seconds: float, out: Path) -> None:
    """py-spy on the idle gateway for `seconds`: where its upkeep goes, into `out`."""
    pyspy = shutil.which("py-spy", path=str(Path(PYTHON).parent)) or shutil.which("py-spy")
    if pyspy is None:
        sys.exit("py-spy is not installed: `.venv/bin/pip install -r bench/requirements.txt`")
    raw = out.with_suffix(".txt")
    subprocess.run(
        [pyspy, "record", "--pid", str(pid), "--rate", "200", "--format", "raw",
         "--output", str(raw), "--duration", str(int(seconds))],
        check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    text = report(raw.read_text(errors="replace"))
    out.with_suffix(".report.txt").write_text(text + "\n")
    print(text, flush=True)


def reads(url: str) -> int:
    """The requests Redis has read from its clients so far: its round trips."""
    import redis

    client = redis.Redis.from_url(url, socket_timeout=5)
    try:
        return int(client.info("stats")["total_reads_processed"])
    finally:
        client.close()


def redis_pid(url: str) -> int:
    import redis

    client = redis.Redis.from_url(url, socket_timeout=5)
    try:
        return int(client.info("server")["process_id"])
    finally:
        client.close()


def seed_redis(url: str, count: int, hosts: list[str], ttl_s: float = 3600.0) -> None:
    """`count` live conversations in Redis, as RedisLeases.keep writes them, in pipelines."""
    import redis

    from routing.core.leases import LeaseKey
    from routing.shared.leases import lease_id

    client = redis.Redis.from_url(url, socket_timeout=30)
    prefix = "crossbar:"
    expires = int((time.time() + ttl_s) * 1000)
    try:
        for start in range(0, count, 5000):
            pipe = client.pipeline(transaction=False)
            for number in range(start, min(count, start + 5000)):
                host = hosts[number % len(hosts)]
                ident = lease_id(LeaseKey("bench", f"seeded-{number}", "test-model"))
                pipe.set(prefix + "lease:" + ident, host, px=int(ttl_s * 1000))
                pipe.zadd(prefix + "leases", {ident: expires})
                pipe.zadd(prefix + "lease-host:" + host, {ident: expires})
            pipe.execute()
        pipe = client.pipeline(transaction=False)
        pipe.sadd(prefix + "lease-hosts", *hosts)
        for key in [prefix + "leases", prefix + "lease-hosts"] + [
            prefix + "lease-host:" + host for host in hosts
        ]:
            pipe.pexpireat(key, expires)
        pipe.execute()
    finally:
        client.close()


def seed_by_requests(url: str, server: Server, count: int) -> None:
    """`count` new conversations through the gateway: one token each, 32 at a time."""
    per_client = -(-count // 32)
    load(url, server, 32, per_client, chunks=1, seconds=3600.0, new_conversations=True)


def measure(url: str, server: Server, args: argparse.Namespace, redis: int | None) -> dict:
    """CPU per request of the gateway (and of redis-server, its pid `redis`), new
    conversations at `args.concurrency`: the round of `args.rounds` with the median gateway
    CPU per request, each round's figure kept beside it (a round now and then runs beside
    some other process's burst; the median is what a quiet machine gives)."""
    rounds = []
    for _ in range(args.rounds):
        redis_before = cpu_seconds(redis) if redis else 0.0
        report = load(
            url, server, args.concurrency, args.requests, chunks=args.chunks, seconds=600.0,
            new_conversations=True,
        )  # fmt: skip
        wanted = {
            key: report[key]
            for key in ("requests", "errors", "cpu_ms_per_request", "rss_peak_mb", "wall_s")
        }
        if redis:
            requests = max(1, report["requests"])
            redis_cpu = cpu_seconds(redis) - redis_before
            wanted["redis_cpu_ms_per_request"] = redis_cpu * 1000 / requests
            wanted["round_trips_per_request"] = report["redis"]["round_trips_per_request"]
        rounds.append(wanted)
    ordered = sorted(rounds, key=lambda each: each["cpu_ms_per_request"])
    median = dict(ordered[len(ordered) // 2])
    median["cpu_ms_per_request_rounds"] = [each["cpu_ms_per_request"] for each in rounds]
    return median


def one_backing(
    backing: str, work: Path, source: Path, args: argparse.Namespace
) -> dict[str, object]:
    out: dict[str, object] = {"hosts": {}, "conversations": {}}
    for hosts in args.hosts:
        with contextlib.ExitStack() as stack:
            env = {"CROSSBAR_LOG_LEVEL": "WARNING"}  # as this bench's figures were measured
            redis_url = None
            name = f"{backing}-{hosts}-{source.name}"
            if backing == "redis":
                redis_url = stack.enter_context(redis_server(work, name))
                env["CROSSBAR_REDIS_URL"] = redis_url
            fake, ports = stack.enter_context(upstream(work, hosts))
            toml = fleet_toml(ports, SLOTS_PER_HOST).replace("{", "{{").replace("}", "}}")
            gateway = stack.enter_context(
                crossbar(work, fake, source, "crossbar_serve", toml, name=name, env=env)
            )
            if redis_url:
                gateway = Server(gateway.url, gateway.pid, gateway.log, redis_url=redis_url)
            wait_up(gateway.url, hosts)
            pids = {"gateway": gateway.pid}
            if redis_url:
                pids["redis"] = redis_pid(redis_url)
            url = gateway.url + "/bench/v1/chat/completions"
            # Warm up past the first requests' one-time costs (lazy imports, the first
            # database connection, the history's rebuild from the rows), which a short
            # warm-up of 16 requests may leave in the first figure of a gateway.
            load(url, gateway, args.concurrency, 10, chunks=args.chunks, new_conversations=True)
            if args.idle_profile:
                idle_profile(gateway.pid, args.idle_seconds, work / f"idle-{name}")
            reads_before = reads(redis_url) if redis_url else 0
            quiet = idle(pids, args.idle_seconds)
            upkeep = (reads(redis_url) - reads_before) / args.idle_seconds if redis_url else 0.0
            row = {"idle_core": quiet, **measure(url, gateway, args, pids.get("redis"))}
            if redis_url:
                # The ticks' round trips (liveness, counts) go on during the requests too:
                # what is left without them is the requests' own.
                row["upkeep_round_trips_per_s"] = upkeep
                row["request_round_trips"] = row["round_trips_per_request"] - upkeep * row[
                    "wall_s"] / max(1, row["requests"])  # fmt: skip
            out["hosts"][hosts] = row  # type: ignore[index]
            print(f"  {backing:5} {hosts:4} hosts: {row}", flush=True)
            if hosts != max(args.hosts) or not args.conversations:
                continue
            names = [f"h{index:04d}" for index in range(hosts)]
            seeded = 0
            for count in sorted(args.conversations):
                before = memory_bytes(gateway.pid, redis_url)
                if redis_url:
                    seed_redis(redis_url, count - seeded, names)
                else:
                    seed_by_requests(url, gateway, count - seeded)
                per = (memory_bytes(gateway.pid, redis_url) - before) / max(1, count - seeded)
                seeded = count
                row = {
                    "bytes_per_conversation": per,
                    **measure(url, gateway, args, pids.get("redis")),
                }
                out["conversations"][count] = row  # type: ignore[index]
                print(f"  {backing:5} {count:7} conversations: {row}", flush=True)
    return out


def table(results: dict[str, dict]) -> str:
    lines = [
        "| backing | fleet | CPU ms / request | x smallest | idle core | RSS MB | round trips |"
    ]
    lines.append("|---|---|---|---|---|---|---|")
    for backing, out in results.items():
        rows = out["hosts"]
        base = rows[min(rows)]["cpu_ms_per_request"] if rows else float("nan")
        for hosts, row in rows.items():
            idle_core = " + ".join(
                f"{name} {share:.1%}" for name, share in row["idle_core"].items()
            )
            trips = row.get("round_trips_per_request")
            if "request_round_trips" in row:
                trips_text = f"{trips:.2f} ({row['request_round_trips']:.2f} less upkeep)"
            else:
                trips_text = "" if trips is None else f"{trips:.2f}"
            lines.append(
                f"| {backing} | {hosts} hosts | {row['cpu_ms_per_request']:.2f} | "
                f"{row['cpu_ms_per_request'] / base:.2f}x | {idle_core} | "
                f"{row['rss_peak_mb']:.0f} | {trips_text} |"
            )
        rows = out["conversations"]
        base = rows[min(rows)]["cpu_ms_per_request"] if rows else float("nan")
        for count, row in rows.items():
            trips = row.get("round_trips_per_request")
            lines.append(
                f"| {backing} | {count:,} conversations | {row['cpu_ms_per_request']:.2f} | "
                f"{row['cpu_ms_per_request'] / base:.2f}x | {row['bytes_per_conversation']:.0f} "
                f"B each | {row['rss_peak_mb']:.0f} | {'' if trips is None else f'{trips:.2f}'} |"
            )
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backings", nargs="+", default=["local", "redis"])
    parser.add_argument("--hosts", nargs="+", type=int, default=[2, 20, 200])
    parser.add_argument(
        "--conversations", nargs="*", type=int, default=[1_000, 10_000, 100_000],
        help="live conversation counts, at the largest fleet (none: skip)",
    )  # fmt: skip
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--chunks", type=int, default=16)
    parser.add_argument("--requests", type=int, default=40, help="measured requests per client")
    parser.add_argument(
        "--rounds", type=int, default=3, help="measured rounds per figure (the median is kept)"
    )
    parser.add_argument("--idle-seconds", type=float, default=20.0)
    parser.add_argument(
        "--idle-profile", action="store_true",
        help="also py-spy the idle gateway (before the idle measure) and print where it goes",
    )  # fmt: skip
    parser.add_argument(
        "--rev", action="append", default=[],
        help="measure this commit (git archive); repeat for several, side by side in one run, "
        "and name `tree` for the working tree among them (default: the tree alone)",
    )  # fmt: skip
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    work = RESULTS / f"scale-{stamp}"
    work.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict] = {}
    provenances = []
    for rev in args.rev or ["tree"]:
        source, provenance = source_tree(work, None if rev == "tree" else rev)
        provenances.append(provenance)
        print(f"bench-scale: {provenance}", flush=True)
        label = (
            ""
            if len(args.rev) < 2
            else f"{provenance['commit']}{'+tree' if rev == 'tree' else ''} "
        )
        for backing in args.backings:
            results[label + backing] = one_backing(backing, work, source, args)
    print(table(results))
    document = {"provenance": provenances, "machine": machine(), "args": vars(args), **results}
    path = RESULTS / f"scale-{stamp}.json"
    path.write_text(json.dumps(document, indent=2, default=str))
    print(f"written: {path}")


if __name__ == "__main__":
    main()
