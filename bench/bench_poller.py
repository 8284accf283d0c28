"""The health poller's CPU for a fleet, before and after, in one run.

    .venv/bin/python bench/bench_poller.py                 # 200 hosts, 5 s interval, 60 s each
    .venv/bin/python bench/bench_poller.py --hosts 50 --seconds 20 --old-rev HEAD~3

Starts `--hosts` llama-server stand-ins in a process of their own (`bench/poller_fleet.py`:
llama-server's keep-alive, a `/props` of a real one's size), then runs in this process, one
after the other, the poll loop of `--old-rev` (its `hosts/health.py`, from `git show`, on the
proxy's upstream client as that revision's runtime built it: the default aiohttp transport)
and the working tree's `hosts.poller.Poller`, each over the whole fleet at `--interval`
(5 s, the default of CROSSBAR_HEALTH_INTERVAL) and a 2 s poll timeout. After one interval of
warm-up, this process's CPU time (`resource.getrusage`: user + system, all threads) is read
over `--seconds`; nothing else runs here, so it is the poller's. Printed per variant: CPU in ms
per second (and its system part: on loopback the kernel's TCP work for both ends lands on
the sender) and in % of one core, and what the fleet answered per second (connections,
/health, /props, /v1/models). Each variant must end with every host up in its table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import subprocess
import sys
import types
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hosts.health import HealthTable, HostState  # noqa: E402  # after the path is set
from hosts.poller import Poller, Probe  # noqa: E402
from routing.upstream_client import upstream_client  # noqa: E402

TIMEOUT = 2.0  # CROSSBAR_HEALTH_TIMEOUT's default
CONNECT_TIMEOUT = 3.0  # CROSSBAR_CONNECT_TIMEOUT's default, the upstream client's


def old_module(rev: str) -> types.ModuleType:
    """`hosts/health.py` of `rev`, loaded under another name."""
    source = subprocess.run(
        ["git", "show", f"{rev}:hosts/health.py"], cwd=ROOT, check=True, capture_output=True
    ).stdout
    module = types.ModuleType("old_health")
    sys.modules[module.__name__] = module  # dataclasses look their module up
    exec(compile(source, f"{rev}:hosts/health.py", "exec"), module.__dict__)
    return module


Loop = Callable[[list[str], HealthTable, float], Coroutine[Any, Any, None]]


def old_loop(rev: str) -> Loop:
    old = old_module(rev)

    async def run(urls: list[str], table: HealthTable, interval: float) -> None:
        probes = [old.Probe(f"h{i}", url) for i, url in enumerate(urls)]
        async with upstream_client(CONNECT_TIMEOUT) as client:
            await old.poll_forever(client, lambda: probes, table, interval, TIMEOUT)

    return run


async def new_loop(urls: list[str], table: HealthTable, interval: float) -> None:
    poller = Poller(table, interval, TIMEOUT)
    probes = [Probe(f"h{i}", url) for i, url in enumerate(urls)]
    try:
        await poller.run(lambda: probes)
    finally:
        await poller.aclose()


async def measure(
    loop: Loop, urls: list[str], interval: float, seconds: float
) -> tuple[float, float, int]:
    """CPU seconds (all, system) over `seconds` after one interval of warm-up, and the hosts up
    at the end."""
    # The old loop writes its own HostState into this table: compared by value below.
    table = HealthTable()
    table.track({f"h{i}": url for i, url in enumerate(urls)})
    task = asyncio.create_task(loop(urls, table, interval))
    await asyncio.sleep(interval + 0.5)
    before = resource.getrusage(resource.RUSAGE_SELF)
    await asyncio.sleep(seconds)
    after = resource.getrusage(resource.RUSAGE_SELF)
    system = after.ru_stime - before.ru_stime
    used = after.ru_utime - before.ru_utime + system
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    up = sum(1 for health in table.snapshot().values() if health.state == HostState.UP)
    return used, system, up


def counts(fleet: subprocess.Popen[str]) -> dict[str, int]:
    assert fleet.stdin is not None and fleet.stdout is not None
    fleet.stdin.write("\n")
    fleet.stdin.flush()
    result: dict[str, int] = json.loads(fleet.stdout.readline())
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=200)
    parser.add_argument("--interval", type=float, default=5.0)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--old-rev", default="main", help="the revision whose poller is 'before'")
    args = parser.parse_args()
    fleet = subprocess.Popen(
        [sys.executable, str(ROOT / "bench" / "poller_fleet.py"), "--hosts", str(args.hosts)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert fleet.stdout is not None and fleet.stdin is not None
    urls = [f"http://127.0.0.1:{port}" for port in json.loads(fleet.stdout.readline())]
    variants: list[tuple[str, Loop]] = [
        (f"before ({args.old_rev})", old_loop(args.old_rev)),
        ("after (working tree)", new_loop),
    ]
    print(f"{args.hosts} hosts, interval {args.interval:g} s, CPU over {args.seconds:g} s each")
    header = (
        f"{'poller':<22} {'CPU ms/s':>9} {'(system)':>9} {'% core':>7} {'up':>7}   "
        "fleet answered per second"
    )
    print(header)
    try:
        for name, loop in variants:
            counts(fleet)  # what the fleet answered before this variant
            used, system, up = asyncio.run(measure(loop, urls, args.interval, args.seconds))
            # The fleet's counts include the warm-up and the cancel: per second of the whole.
            answered = counts(fleet)
            span = args.seconds + args.interval + 0.5
            rates = ", ".join(f"{path} {n / span:.1f}" for path, n in answered.items())
            per_second = used / args.seconds * 1000
            print(
                f"{name:<22} {per_second:>9.1f} {system / args.seconds * 1000:>9.1f} "
                f"{per_second / 10:>6.2f}% "
                f"{up:>3}/{args.hosts}   {rates}",
                flush=True,
            )
    finally:
        fleet.stdin.close()
        fleet.wait(10)


if __name__ == "__main__":
    main()
