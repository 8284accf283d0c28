"""Runs of `bench_gateway.py` side by side: the median and range of every target over the runs.

    .venv/bin/python bench/runs_report.py bench/results/bench-20261201*.json
    .venv/bin/python bench/runs_report.py --base floor bench/results/bench-*.json

The machine is shared, so one run proves little: run the same targets several times and
compare the medians, keeping an eye on the ranges. A target is its label and the server it ran
on (`crossbar (crossbar_serve 4.2.3)`), so runs with different `--server`s group apart too;
results written before targets existed count as `crossbar`. Ratios are against the medians of
`--base` (a label; default: the first target of the first file).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections.abc import Callable
from pathlib import Path

# (label, unit, value of one target's report); lower is better for all of them but chunks/s.
Metric = tuple[str, str, Callable[[dict], float]]


def phase(concurrency: int, key: str) -> Callable[[dict], float]:
    return lambda report: next(p[key] for p in report["phases"] if p["concurrency"] == concurrency)


def saturated(report: dict) -> float:
    return max(p["chunks_per_s"] for p in report["phases"] if p["concurrency"] >= 128)


METRICS: tuple[Metric, ...] = (
    ("CPU per request (split at 8)", "ms", lambda r: r["split"]["cpu_ms_per_request"]),
    ("CPU per chunk (split at 8)", "µs", lambda r: r["split"]["cpu_us_per_chunk"]),
    ("CPU per streamed request at 1", "ms", phase(1, "cpu_ms_per_request")),
    ("CPU per streamed request at 8", "ms", phase(8, "cpu_ms_per_request")),
    ("CPU per streamed request at 32", "ms", phase(32, "cpu_ms_per_request")),
    ("+TTFB p50 at 1", "ms", phase(1, "added_ttfb_p50_ms")),
    ("+TTFB p50 at 8", "ms", phase(8, "added_ttfb_p50_ms")),
    ("+TTFB p99 at 8", "ms", phase(8, "added_ttfb_p99_ms")),
    ("+TTFB p50 at 32", "ms", phase(32, "added_ttfb_p50_ms")),
    ("+TTFB p99 at 32", "ms", phase(32, "added_ttfb_p99_ms")),
    ("+TTFB p50 at 128", "ms", phase(128, "added_ttfb_p50_ms")),
    ("chunks/s at 128", "", phase(128, "chunks_per_s")),
    ("chunks/s at 512", "", phase(512, "chunks_per_s")),
    ("saturated chunks/s (best of 128, 512)", "", saturated),
    ("RSS at 512", "MB", phase(512, "rss_peak_mb")),
    ("threads at 512", "", phase(512, "threads_peak")),
    ("errors, all phases", "", lambda r: sum(p["errors"] for p in r["phases"])),
)


def targets_of(result: dict) -> list[tuple[str, dict]]:
    """(name, report) for every target of one run's results."""
    default = result.get("server", {"name": "daphne", "version": "?"})
    versions = result.get("servers", {default["name"]: default["version"]})
    reports = result.get("targets") or (
        {"crossbar": result["crossbar"]} if "crossbar" in result else {}
    )
    named = []
    for label, report in reports.items():
        server = report.get("target", {}).get("server", default["name"])
        if report.get("target", {}).get("kind") == "litellm":
            named.append((f"{label} ({report.get('version', '?')})", report))
        else:
            named.append((f"{label} ({server} {versions.get(server, '?')})", report))
    return named


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", type=Path, help="bench-*.json files")
    parser.add_argument("--base", help="the target label the ratios are against")
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {}
    for path in args.results:
        for name, report in targets_of(json.loads(path.read_text())):
            runs.setdefault(name, []).append(report)
    if not runs:
        raise SystemExit("no target in these files (--profile runs have none)")
    names = list(runs)
    base = names[0]
    if args.base:
        base = next((n for n in names if n.split(" (")[0] == args.base), "")
        if not base:
            raise SystemExit(f"no target {args.base!r} in these runs: {', '.join(names)}")
    names.remove(base)
    names.insert(0, base)
    width = max(30, *(len(n) + 12 for n in names))
    print(f"{'':<38}" + "".join(f"{n + f' ({len(runs[n])} runs)':>{width}}" for n in names))
    for label, unit, value in METRICS:
        cells = []
        middle_of_base = median([v for r in runs[base] if not math.isnan(v := _get(value, r))])
        for name in names:
            values = [v for r in runs[name] if not math.isnan(v := _get(value, r))]
            if not values:
                cells.append("-")
                continue
            middle = median(values)
            ratio = ""
            if name != base and middle_of_base and not math.isnan(middle_of_base):
                ratio = f" {middle / middle_of_base:.2f}x"
            spread = f" ({number(min(values))}-{number(max(values))})" if len(values) > 1 else ""
            cells.append(f"{number(middle)}{spread}{ratio}")
        name = f"{label}, {unit}" if unit else label
        print(f"{name:<38}" + "".join(f"{c:>{width}}" for c in cells))


def _get(value: Callable[[dict], float], report: dict) -> float:
    try:
        return value(report)
    except (KeyError, StopIteration, ValueError):
        return float("nan")  # LiteLLM has no split; older results lack some phases


def median(values: list[float]) -> float:
    """The median; of counts, the lower middle one, so that it stays a count."""
    if not values:
        return float("nan")
    if all(isinstance(v, int) for v in values):
        return statistics.median_low(values)
    return statistics.median(values)


def number(value: float) -> str:
    if isinstance(value, int):
        return str(value)  # counts: errors, threads
    if math.isnan(value):
        return "-"
    return (
        f"{value:,.0f}"
        if abs(value) >= 100
        else f"{value:.1f}"
        if abs(value) >= 10
        else f"{value:.2f}"
    )


if __name__ == "__main__":
    main()
