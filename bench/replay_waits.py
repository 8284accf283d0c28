"""How well priced patience prices a wait in line, replayed from a bench-cache run's rows.

    .venv/bin/python bench/replay_waits.py bench/results/cache-<time>/crossbar-*-24.sqlite3

For each request that waited in its host's line (any patience: the fixed ones wait too), the
wait is priced as the placer would have priced it as it joined the line, from the rows alone:
the holds that had ended on that host before (each row's grant to its end), the requests
running there then, and its place in the line. Priced twice, side by side: by what each
running request has left as `Figures.left` says today (the mean residual of the recent holds),
and by the rule before it (a running request ends once it has held its slot the mean service
time, and at once past it). Printed: the wait it had over the price (median and quartiles)
and the mean error. A figure, not a test: the rows' times are the gateway's, to the
millisecond, and the grant is taken as the arrival plus the time queued.
"""

from __future__ import annotations

import argparse
import sqlite3
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from routing.core.patience import Figures, line_wait  # noqa: E402

MODEL = "replayed"


@dataclass(frozen=True, slots=True)
class Row:
    host: str
    arrived: float  # seconds
    granted: float
    ended: float
    spilled: bool


def rows(path: Path) -> list[Row]:
    found = sqlite3.connect(path).execute(
        "select host, started, queued_ms, total_ms, placement from accounting_request"
        " where status < 400 and host != '' order by started"
    )
    out = []
    for host, started, queued, total, placement in found:
        arrived = datetime.fromisoformat(started).timestamp()
        granted, ended = arrived + queued / 1000, arrived + total / 1000
        out.append(Row(host, arrived, granted, ended, placement == "spilled"))
    return out


def before(service: float, held: float) -> float:
    """What a running request had left by the rule before `Figures.left`."""
    return max(0.0, service - held)


def replay(found: Sequence[Row], slots: int) -> list[tuple[float, float, float]]:
    """(the wait it had, priced today, priced by the rule before) for each wait in line."""
    waits = []
    for row in found:
        if row.granted - row.arrived < 0.005 or row.spilled:
            continue  # no wait, or one whose wait at home is not in its row
        now, there = row.arrived, [r for r in found if r.host == row.host]
        figures = Figures()
        for ended in sorted((r for r in there if r.ended <= now), key=lambda r: r.ended):
            figures.held(row.host, MODEL, ended.ended - ended.granted)
        service = figures.service(row.host, MODEL)
        if service is None:
            continue
        running = [now - r.granted for r in there if r.granted <= now < r.ended]
        position = 1 + sum(1 for r in there if r.arrived < now < r.granted)

        def priced(left: Callable[[float], float]) -> float:
            return line_wait(position, service, slots, [left(held) for held in running])

        today = priced(lambda held: figures.left(row.host, MODEL, held) or 0.0)
        waits.append((row.granted - row.arrived, today, priced(lambda h: before(service, h))))
    return waits


def describe(name: str, had: Sequence[float], priced: Sequence[float]) -> str:
    ratios = [wait / max(price, 0.001) for wait, price in zip(had, priced, strict=True)]
    low, middle, high = statistics.quantiles(ratios, n=4)
    error = statistics.mean(abs(wait - price) for wait, price in zip(had, priced, strict=True))
    return (
        f"{name}: waited / priced median {middle:.2f} (quartiles {low:.2f}-{high:.2f}), "
        f"priced median {1000 * statistics.median(priced):.0f} ms, "
        f"mean error {1000 * error:.0f} ms"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rows", nargs="+", type=Path, help="crossbar-*.sqlite3 of a bench run")
    parser.add_argument("--slots", type=int, default=2, help="each host's slots (--parallel)")
    args = parser.parse_args(argv)
    waits = [wait for path in args.rows for wait in replay(rows(path), args.slots)]
    if len(waits) < 4:
        print("fewer than 4 waits in line in these rows")
        return 1
    had = [wait for wait, _, _ in waits]
    print(f"{len(waits)} waits in line, median {1000 * statistics.median(had):.0f} ms")
    print(describe("today (mean residual)", had, [today for _, today, _ in waits]))
    print(describe("before (past the mean: now)", had, [old for _, _, old in waits]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
