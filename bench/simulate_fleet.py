"""The pure routing core past this machine's fleet: placements per second of one core, and
memory per conversation, for up to 2,000 hosts and 1,000,000 live conversations.

    .venv/bin/python bench/simulate_fleet.py                  # about 2 minutes
    .venv/bin/python bench/simulate_fleet.py --hosts 2000 --conversations 1000000

No server and no network: the real `Placer` over the real `Limiter`, `LeaseTable` and kept
`Rankings` (routing/core), with a fleet of `--hosts` hosts of 4 slots each in one route, as
the runtime wires them (the limiter and the lease table touch the rankings). Each placement
is a request of a conversation: a returning one (70 %, drawn from the live ones) or a new one;
it is placed, its lease kept, and its slot held while 1,000 later requests are placed (or a
quarter of the fleet's slots, if fewer), then released; one whose home is full queues there
and leaves at once. Measured:
placements per second of one core (CPU time of this process), with the ranking kept and, side
by side, rebuilt from scratch for every request as before (`choose.ranked` of a candidate per
host: what `--rebuild` measures); and the lease table's memory per live conversation
(tracemalloc), with the cap (`--cap`, the default 100,000 is the gateway's) evicting the least
recently used once full. A figure, not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import random
import sys
import time
import tracemalloc
from collections import deque
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from routing.core.choose import Candidate  # noqa: E402
from routing.core.leases import LeaseKey, LeaseTable  # noqa: E402
from routing.core.limiter import Limiter  # noqa: E402
from routing.core.placement import Placement, Placer  # noqa: E402
from routing.core.prefixes import PrefixIndex  # noqa: E402
from routing.core.ranking import Ranking, Rankings  # noqa: E402
from routing.core.state import LocalState  # noqa: E402

MODEL = "m"
SLOTS = 4
RUNNING = 1_000  # requests holding a slot at once
RETURNING = 0.7


@dataclass(slots=True, frozen=True)
class Route:
    name: str
    hosts: tuple[str, ...]
    lease_ttl: float = 3600.0
    strict: bool = False
    queue_timeout: float = 300.0
    lease_patience: float = 2.0
    fallback: str = ""
    fallback_after: float = 10.0
    fallback_model: str = ""


class SimFleet:
    """`routing.core.placement.Fleet` for the simulation: every host up, one model."""

    def __init__(self, hosts: int, cap: int, rebuild: bool) -> None:
        self.names = [f"h{index:05d}" for index in range(hosts)]
        self.route = Route("chat", tuple(self.names))
        self._members = frozenset(self.names)
        self.rankings = Rankings(self.candidate)
        self.limiter = Limiter(on_change=self.rankings.touch)
        self.leases = LeaseTable(max_entries=cap, on_change=self.rankings.touch)
        self.state = LocalState(self.limiter, self.leases)
        self.prefixes = PrefixIndex(10_000)
        self.prefix_margin = 1
        self.rebuild = rebuild
        for name in self.names:
            self.limiter.configure(name, MODEL, SLOTS, SLOTS)

    def candidate(self, name: str, model: str | None) -> Candidate | None:
        return Candidate(
            host=name, healthy=True, draining=False, loaded=True, can_serve=True,
            free=self.limiter.free_for(name, MODEL), queued=self.limiter.queued(name, MODEL),
            weight=1.0, leases=self.leases.held(name),
        )  # fmt: skip

    def ranking(self, route: Route, model: str) -> Ranking:
        self.leases.expire()
        if self.rebuild:  # as before: every host's candidate and a sort, per request
            return Ranking(route.hosts, model, self.candidate)
        return self.rankings.of(route.name, route.hosts, model)

    def usable(self, route: Route, model: str, host: str) -> bool:
        return host in self._members

    def fallback_of(self, route: Route) -> Route | None:
        return None


async def placements_per_second(
    hosts: int, conversations: int, cap: int, requests: int, rebuild: bool
) -> dict[str, float]:
    fleet = SimFleet(hosts, cap, rebuild)
    rng = random.Random(7)
    loop = asyncio.get_running_loop()
    running: deque[Placement] = deque()
    live = 0  # conversations 0 .. live-1 have been seen

    most = min(RUNNING, hosts * SLOTS // 4)
    queued = 0

    async def one(fingerprint: str) -> None:
        nonlocal queued
        got = await Placer(fleet, fleet.route, MODEL, fingerprint, loop.time()).now()
        if not isinstance(got, Placement):  # its home was full: it queued there (and leaves)
            queued += 1
            granted = got.waiter.cancel()
            if granted is not None:
                granted.release()
            return
        running.append(got)
        if len(running) > most:
            running.popleft().slot.release()

    # The live conversations first (their leases), then the measured requests.
    while live < conversations:
        fleet.leases.keep(LeaseKey("chat", f"c{live}", MODEL), fleet.names[live % hosts], 3600.0)
        live += 1
    started = time.process_time()
    for _ in range(requests):
        if rng.random() < RETURNING:
            await one(f"c{rng.randrange(live)}")
        else:
            await one(f"c{live}")
            live += 1
    spent = time.process_time() - started
    return {
        "per_second": requests / spent,
        "us_per_placement": spent * 1e6 / requests,
        "queued": queued / requests,
    }


def lease_bytes(conversations: int, cap: int) -> dict[str, float]:
    """Memory the lease table holds per live conversation, and what the cap left."""
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    table = LeaseTable(max_entries=cap)
    for number in range(conversations):
        table.keep(LeaseKey("chat", f"{number:032x}", MODEL), f"h{number % 2000:05d}", 3600.0)
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return {"live": len(table), "bytes_per_conversation": held / max(1, len(table))}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", nargs="+", type=int, default=[20, 200, 2000])
    parser.add_argument(
        "--conversations", nargs="+", type=int, default=[10_000, 100_000, 1_000_000]
    )
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--cap", type=int, default=1_000_000, help="the lease table's size cap")
    args = parser.parse_args(argv)
    print("| hosts | live conversations | placements/s, kept ranking | rebuilt per request |")
    print("|---|---|---|---|")
    for hosts in args.hosts:
        for conversations in args.conversations:
            kept = asyncio.run(
                placements_per_second(hosts, conversations, args.cap, args.requests, False)
            )
            rebuilt = asyncio.run(
                placements_per_second(hosts, conversations, args.cap, args.requests // 4, True)
            )
            print(f"| {hosts:,} | {conversations:,} | {kept['per_second']:,.0f} "
                  f"({kept['us_per_placement']:.0f} µs) | {rebuilt['per_second']:,.0f} "
                  f"({rebuilt['us_per_placement']:.0f} µs) |", flush=True)  # fmt: skip
    print()
    print("| conversations kept | cap | live after | bytes per live conversation |")
    print("|---|---|---|---|")
    for conversations, cap in ((1_000_000, args.cap), (1_000_000, 100_000)):
        memory = lease_bytes(conversations, cap)
        print(f"| {conversations:,} | {cap:,} | {memory['live']:,} | "
              f"{memory['bytes_per_conversation']:.0f} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
