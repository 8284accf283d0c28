"""Time the pure routing core on the per-request hot path.

    .venv/bin/python bench/bench_core.py

Prints one line per operation with the time per operation in microseconds: the best of a few
repeats, each over many iterations, so a busy machine inflates the figures less. A figure, not
a test: nothing here fails when it is slow.
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REPEATS = 5


def main() -> None:
    sys.path.insert(0, str(ROOT))
    asyncio.run(run())


async def run() -> None:
    from routing.core.choose import Candidate, ranked
    from routing.core.fingerprint import fingerprint
    from routing.core.leases import LeaseKey, LeaseTable
    from routing.core.limiter import Limiter, Pair, Slot

    limiter = Limiter()
    limiter.configure("h1", "qwen", parallel=4, queue_max=4)
    pairs = [Pair("h1", "qwen")]

    def place_release(iterations: int) -> None:
        for _ in range(iterations):
            slot = limiter.place(pairs)
            assert isinstance(slot, Slot), "an idle pair has a free slot"
            slot.release()

    report("uncontended place+release", place_release, 200_000)

    rng = random.Random(7)
    candidates = [
        Candidate(
            host=f"host-{number:02d}",
            healthy=rng.random() > 0.1,
            draining=rng.random() < 0.05,
            loaded=rng.random() < 0.5,
            can_serve=True,
            free=rng.randrange(5),
            queued=rng.randrange(5),
            weight=rng.choice([0.5, 1.0, 2.0]),
        )
        for number in range(64)
    ]

    def choose(iterations: int) -> None:
        for _ in range(iterations):
            ranked(candidates)

    report("ranking of 64 hosts", choose, 50_000)

    table = LeaseTable(max_entries=100_000)
    keys = [LeaseKey("chat", f"{number:064x}", "qwen") for number in range(100_000)]
    hosts = [candidate.host for candidate in candidates]
    for number, key in enumerate(keys):
        table.keep(key, hosts[number % len(hosts)], ttl=1_200)
    probes = [rng.choice(keys) for _ in range(4_096)]

    def reused_lease(iterations: int) -> None:
        # As placement does for a returning conversation: find its host, then slide the lease.
        for number in range(iterations):
            key = probes[number & 4_095]
            host = table.find(key)
            assert host is not None, "every probed key holds a lease"
            table.keep(key, host, ttl=1_200)

    report("lease lookup (reused), 100,000 leases", reused_lease, 200_000)

    conversation = {
        "model": "qwen",
        "stream": True,
        "messages": [{"role": "system", "content": "You are a careful assistant. " * 70}]
        + [
            {"role": "user" if turn % 2 == 0 else "assistant", "content": f"turn {turn} " * 40}
            for turn in range(99)
        ],
    }

    def name_conversation(iterations: int) -> None:
        for _ in range(iterations):
            fingerprint("POST", conversation, None)

    report("fingerprint, 100-message conversation", name_conversation, 50_000)


def report(name: str, operations: Callable[[int], None], iterations: int) -> None:
    best_seconds = float("inf")
    for _ in range(REPEATS):
        started = time.perf_counter()
        operations(iterations)
        best_seconds = min(best_seconds, time.perf_counter() - started)
    print_line(name, best_seconds, iterations)


def print_line(name: str, seconds: float, iterations: int) -> None:
    per_op = seconds / iterations * 1e6
    print(f"{name:<42} {per_op:8.3f} µs/op  ({iterations:,} ops, best of {REPEATS})")


if __name__ == "__main__":
    main()
