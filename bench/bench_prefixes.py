"""Time the prefix index on the per-request path, and weigh its entries.

    .venv/bin/python bench/bench_prefixes.py

A conversation of a 400-word system prompt and 20 turns (a user message and an answer each,
then the 21st question): what one request costs before it goes to its host
(`prefix_blocks` once, then `match` on the host it was placed on) and after its answer
(`learn`), against an index already holding 100,000 entries; then the index's memory per
entry (tracemalloc, over 100,000 entries). Best of a few repeats, each over many iterations,
so a busy machine inflates the figures less. A figure, not a test: nothing here fails.
"""

from __future__ import annotations

import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REPEATS = 5
ENTRIES = 100_000


def main() -> None:
    sys.path.insert(0, str(ROOT))
    from routing.core.prefixes import PrefixIndex, prefix_blocks

    words = [f"word{number % 97}" for number in range(400)]
    messages: list[dict[str, object]] = [{"role": "system", "content": " ".join(words)}]
    for turn in range(20):
        messages.append({"role": "user", "content": f"question {turn} about the thing " * 8})
        messages.append({"role": "assistant", "content": f"answer {turn} in some words " * 25})
    messages.append({"role": "user", "content": "and the last question?"})
    body = {"model": "qwen", "stream": True, "messages": messages}

    prefix = prefix_blocks(body)
    chain = prefix.blocks
    print(f"prompt: {prefix.length:,} canonical characters, {len(chain)} whole blocks")

    index = PrefixIndex(ENTRIES)
    for other in range(ENTRIES // len(chain) + 1):  # a full index: other hosts' conversations
        index.learn(f"host-{other % 20:02d}", "qwen", tuple(hash((other, n)) for n in chain))
    index.learn("gpu1", "qwen", chain)

    def before_upstream(iterations: int) -> None:
        for _ in range(iterations):
            index.match("gpu1", "qwen", prefix_blocks(body).blocks)

    def blocks_only(iterations: int) -> None:
        for _ in range(iterations):
            prefix_blocks(body)

    def match_only(iterations: int) -> None:
        for _ in range(iterations):
            index.match("gpu1", "qwen", chain)

    def after_answer(iterations: int) -> None:
        for _ in range(iterations):
            index.learn("gpu1", "qwen", chain)

    report("prefix_blocks + match (before upstream)", before_upstream, 5_000)
    report("  of which prefix_blocks", blocks_only, 5_000)
    report("  of which match", match_only, 20_000)
    report("learn (after the answer)", after_answer, 20_000)

    tracemalloc.start()
    start = tracemalloc.take_snapshot()
    weighed = PrefixIndex(ENTRIES)
    for other in range(ENTRIES // len(chain) + 1):
        weighed.learn(f"host-{other % 20:02d}", "qwen", tuple(hash((other, n)) for n in chain))
    used = sum(stat.size_diff for stat in tracemalloc.take_snapshot().compare_to(start, "filename"))
    tracemalloc.stop()
    print(f"memory: {used / len(weighed):.0f} bytes an entry ({used / 2**20:.1f} MiB for "
          f"{len(weighed):,})")  # fmt: skip


def report(name: str, operations: Callable[[int], None], iterations: int) -> None:
    best_seconds = float("inf")
    for _ in range(REPEATS):
        started = time.perf_counter()
        operations(iterations)
        best_seconds = min(best_seconds, time.perf_counter() - started)
    per_op = best_seconds / iterations * 1e6
    print(f"{name:<42} {per_op:8.1f} µs/op  ({iterations:,} ops, best of {REPEATS})")


if __name__ == "__main__":
    main()
