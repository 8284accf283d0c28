"""Runs of `bench_gateway.py --server ...` side by side: the median and range per server.

    .venv/bin/python bench/servers_report.py bench/results/bench-2026113009*.json

The machine is shared, so one run proves little: run each server several times, interleaved,
and compare the medians, keeping an eye on the ranges. Ratios are against daphne's medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from pathlib import Path

# (label, unit, value of one run's report); lower is better for all of them but chunks/s.
Metric = tuple[str, str, Callable[[dict], float]]


def phase(concurrency: int, key: str) -> Callable[[dict], float]:
    return lambda report: next(p[key] for p in report["phases"] if p["concurrency"] == concurrency)


METRICS: tuple[Metric, ...] = (
    ("CPU per request (split at 8)", "ms", lambda r: r["split"]["cpu_ms_per_request"]),
    ("CPU per chunk (split at 8)", "µs", lambda r: r["split"]["cpu_us_per_chunk"]),
    ("CPU per 64-chunk request at 1", "ms", phase(1, "cpu_ms_per_request")),
    ("CPU per 64-chunk request at 32", "ms", phase(32, "cpu_ms_per_request")),
    ("+TTFB p50 at 1", "ms", phase(1, "added_ttfb_p50_ms")),
    ("+TTFB p50 at 8", "ms", phase(8, "added_ttfb_p50_ms")),
    ("+TTFB p99 at 8", "ms", phase(8, "added_ttfb_p99_ms")),
    ("+TTFB p50 at 32", "ms", phase(32, "added_ttfb_p50_ms")),
    ("+TTFB p99 at 32", "ms", phase(32, "added_ttfb_p99_ms")),
    ("+TTFB p50 at 128", "ms", phase(128, "added_ttfb_p50_ms")),
    ("chunks/s at 128", "", phase(128, "chunks_per_s")),
    ("chunks/s at 512", "", phase(512, "chunks_per_s")),
    ("RSS at 512", "MB", phase(512, "rss_peak_mb")),
    ("threads at 512", "", phase(512, "threads_peak")),
    ("errors, all phases", "", lambda r: sum(p["errors"] for p in r["phases"])),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", type=Path, help="bench-*.json files")
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {}
    for path in args.results:
        result = json.loads(path.read_text())
        if "crossbar" not in result:
            continue  # a --profile run
        server = result.get("server", {"name": "daphne", "version": "?"})
        name = f"{server['name']} {server['version']}"
        runs.setdefault(name, []).append(result["crossbar"])
    names = sorted(runs, key=lambda n: (not n.startswith("daphne "), n))
    print(f"{'':<36}" + "".join(f"{n + f' ({len(runs[n])} runs)':>34}" for n in names))
    for label, unit, value in METRICS:
        cells = []
        base = median([value(r) for r in runs[names[0]]])
        for name in names:
            values = [value(r) for r in runs[name]]
            middle = median(values)
            ratio = f" {middle / base:.2f}x" if base and name != names[0] else ""
            cells.append(f"{number(middle)} ({number(min(values))}-{number(max(values))}){ratio}")
        print(f"{label + (f', {unit}' if unit else ''):<36}" + "".join(f"{c:>34}" for c in cells))


def median(values: list[float]) -> float:
    """The median; of counts, the lower middle one, so that it stays a count."""
    if all(isinstance(v, int) for v in values):
        return statistics.median_low(values)
    return statistics.median(values)


def number(value: float) -> str:
    if isinstance(value, int):
        return str(value)  # counts: errors, threads
    return (
        f"{value:,.0f}"
        if abs(value) >= 100
        else f"{value:.1f}"
        if abs(value) >= 10
        else f"{value:.2f}"
    )


if __name__ == "__main__":
    main()
