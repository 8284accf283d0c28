"""How well priced patience prices a wait in line, replayed from a bench-cache run's rows.

    .venv/bin/python bench/replay_waits.py bench/results/cache-<time>/crossbar-*-24.sqlite3

For each request that waited in its host's line (any patience: the fixed ones wait too), the
wait is priced as the placer would have priced it as it joined the line, from the rows alone:
the holds that had ended on that host before (each row's grant to its end), the requests
running there then, and its place in the line. Priced twice, side by side: as
routing/core/patience.py prices it (a running request ends once it has held its slot the
mean service time, and at once past it), and by the mean residual of the recent holds (a
running request has left what the holds that lasted longer than it has so far had left at
that point; half a service when none did), tried on 5 Dec 2026 and not kept (bench/README.md,
"5 Dec 2026, 20:19-20:54 UTC"). Printed: the wait it had over the price (median and
quartiles) and the mean error. A figure, not a test: the rows' times are the gateway's, to the
millisecond, and the grant is taken as the arrival plus the time queued.
"""

from __future__ import annotations

import argparse
import sqlite3
import statistics
import sys
from collections.abc import Sequence
from contextlib import closing
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from routing.core.patience import DECAY, Figures, line_wait  # noqa: E402

MODEL = "replayed"
KEPT = 32  # the recent holds the mean residual weighs (DECAY makes older ones negligible)


@dataclass(frozen=True, slots=True)
class Row:
    host: str
    arrived: float  # seconds
    granted: float
    ended: float
    spilled: bool


def rows(path: Path) -> list[Row]:
    with closing(sqlite3.connect(path)) as db:
        found = db.execute(
            "select host, started, queued_ms, total_ms, placement from accounting_request"
            " where status < 400 and host != '' order by started"
        ).fetchall()
    out = []
    for host, started, queued, total, placement in found:
        arrived = datetime.fromisoformat(started).timestamp()
        granted, ended = arrived + queued / 1000, arrived + total / 1000
        out.append(Row(host, arrived, granted, ended, placement == "spilled"))
    return out


def residual(holds: Sequence[float], held: float) -> float:
    """What a request that has held its slot `held` seconds has left, by the mean residual of
    `holds` (oldest first, each weighing DECAY times the next); half their mean past them all."""
    recent = holds[-KEPT:]
    weights = [DECAY ** (len(recent) - 1 - n) for n in range(len(recent))]
    longer = [(hold, weight) for hold, weight in zip(recent, weights, strict=True) if hold > held]
    if not longer:
        return sum(h * w for h, w in zip(recent, weights, strict=True)) / sum(weights) / 2
    return sum((hold - held) * weight for hold, weight in longer) / sum(w for _, w in longer)


def replay(found: Sequence[Row], slots: int) -> list[tuple[float, float, float]]:
    """(the wait it had, priced as patience.py does, priced by the mean residual) for each
    wait in line."""
    waits = []
    for row in found:
        if row.granted - row.arrived < 0.005 or row.spilled:
            continue  # no wait, or one whose wait at home is not in its row
        now, there = row.arrived, [r for r in found if r.host == row.host]
        ended = sorted((r for r in there if r.ended <= now), key=lambda r: r.ended)
        holds = [r.ended - r.granted for r in ended]
        figures = Figures()
        for hold in holds:
            figures.held(row.host, MODEL, hold)
        service = figures.service(row.host, MODEL)
        if service is None:
            continue
        running = [now - r.granted for r in there if r.granted <= now < r.ended]
        position = 1 + sum(1 for r in there if r.arrived < now < r.granted)
        today = line_wait(position, service, slots, running)
        # line_wait takes how long each has held its slot and expects `service - held` left:
        # a request with `left` to go is passed as having held `service - left`.
        held_as = [service - residual(holds, held) for held in running]
        waits.append(
            (row.granted - row.arrived, today, line_wait(position, service, slots, held_as))
        )
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
    print(describe("patience.py (past the mean: now)", had, [today for _, today, _ in waits]))
    print(describe("mean residual", had, [by_residual for _, _, by_residual in waits]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
