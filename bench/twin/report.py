"""The twin's table: per workload and preset, one row per policy, each figure the median of
its seeds; and the verdicts the placement issue asks of `auto` under it."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence

from twin.tally import Figures

ONE_HOST = "one-host"
AUTO = "auto"
BEATEN_BY = 1.10  # a fixed patience "beats" auto in a seed by more than this on both counts


def _median(runs: Sequence[Figures], figure: Callable[[Figures], float]) -> float:
    return statistics.median(figure(run) for run in runs)


def _evaluated(run: Figures) -> float:
    return run.evaluated


def _p95(run: Figures) -> float:
    return run.ttfb[1]


COLUMNS: tuple[tuple[str, str, Callable[[Figures], float]], ...] = (
    ("requests", "{:>9.0f}", lambda f: f.requests),
    ("refused", "{:>8.0f}", lambda f: f.refused + f.failed),
    ("evaluated", "{:>11.0f}", _evaluated),
    ("cache", "{:>6.1%}", lambda f: f.cache_fraction),
    ("ttfb p50", "{:>9.2f}", lambda f: f.ttfb[0]),
    ("p95", "{:>7.2f}", _p95),
    ("p99", "{:>7.2f}", lambda f: f.ttfb[2]),
    ("queue p95", "{:>10.2f}", lambda f: f.queued[1]),
    ("spills", "{:>7.0f}", lambda f: f.spills),
    ("top share", "{:>10.1%}", lambda f: max(f.shares, default=0.0)),
    ("low share", "{:>10.1%}", lambda f: min(f.shares, default=0.0)),
)


def table(title: str, runs: Mapping[str, Sequence[Figures]]) -> str:
    """`runs`: each policy's figures, one a seed, in the order the rows go."""
    head = f"{'policy':<10}" + "".join(f"{name:>{_width(fmt)}}" for name, fmt, _ in COLUMNS)
    head += f"{'x one-host':>11}"
    reference = runs.get(ONE_HOST)
    lines = [title, head]
    for policy, figures in runs.items():
        cells = "".join(fmt.format(_median(figures, figure)) for _, fmt, figure in COLUMNS)
        ratio = ""
        if reference:
            ratio = (
                f"{_median(figures, _evaluated) / max(_median(reference, _evaluated), 1):>10.3f}x"
            )
        lines.append(f"{policy:<10}{cells}{ratio}")
    return "\n".join(lines)


def _width(fmt: str) -> int:
    return int(fmt.split(">")[1].split(".")[0])


def verdicts(runs: Mapping[str, Sequence[Figures]]) -> list[str]:
    """What the issue asks of `auto`: on the frontier of the fixed patiences in the medians
    (none better on both prompt tokens evaluated and TTFB p95), and in how many seeds no
    fixed patience beats it by more than 10% on both at once; and how the waits it had in
    line compared with what they were priced at as they began (1x: priced right)."""
    auto = runs.get(AUTO)
    fixed = {name: figures for name, figures in runs.items() if name not in (AUTO, ONE_HOST)}
    if not auto or not fixed:
        return []
    mine = (_median(auto, _evaluated), _median(auto, _p95))
    dominating = [
        name
        for name, figures in fixed.items()
        if _median(figures, _evaluated) < mine[0] and _median(figures, _p95) < mine[1]
    ]
    seeds = len(auto)
    held = sum(
        1
        for seed in range(seeds)
        if not any(
            _evaluated(auto[seed]) > BEATEN_BY * _evaluated(figures[seed])
            and _p95(auto[seed]) > BEATEN_BY * _p95(figures[seed])
            for figures in fixed.values()
        )
    )
    frontier = "yes" if not dominating else "no: " + ", ".join(dominating) + " better on both"
    return [
        f"auto on the frontier (medians): {frontier}",
        f"seeds where no fixed patience beats auto by more than 10% on both: {held}/{seeds}",
        f"auto's waits in line: {_median(auto, lambda f: f.waits):.0f}, each a median "
        f"{_median(auto, lambda f: f.wait_over_price):.2f}x what it was priced at as it began; "
        f"{_median(auto, lambda f: f.priced_nothing):.0f} priced at nothing",
    ]


def models_table(title: str, runs: Mapping[str, Sequence[Figures]]) -> str:
    """`runs`: each layout's figures of a multi-model run, one a seed, in the order the rows
    go: requests, refused (or failed), TTFB p50 and p95 over all and per model (p50/p95), and
    the loads the hosts made and the seconds they spent loading."""
    first = next(iter(runs.values()))[0]
    models = [model.model for model in first.by_model]
    width = max((len(m) + 9 for m in models), default=0)
    width = max(width, 12)
    head = f"{'layout':<10}{'requests':>9}{'refused':>8}{'ttfb p50':>9}{'p95':>7}"
    head += "".join(f"{m + ' p50/p95':>{width}}" for m in models) + f"{'loads':>7}{'load s':>8}"
    lines = [title, head]
    for layout, figures in runs.items():
        cells = (
            f"{layout:<10}{_median(figures, lambda f: f.requests):>9.0f}"
            f"{_median(figures, lambda f: f.refused + f.failed):>8.0f}"
            f"{_median(figures, lambda f: f.ttfb[0]):>9.2f}{_median(figures, _p95):>7.2f}"
        )
        for at in range(len(models)):
            p50, p95 = (_median(figures, _model_ttfb(at, point)) for point in (0, 1))
            cells += f"{f'{p50:.2f}/{p95:.2f}':>{width}}"
        cells += f"{_median(figures, lambda f: f.loads):>7.0f}"
        cells += f"{_median(figures, lambda f: f.loading_s):>8.1f}"
        lines.append(cells)
    return "\n".join(lines)


def _model_ttfb(at: int, point: int) -> Callable[[Figures], float]:
    """A run's TTFB percentile `point` (0: p50, 1: p95) of its `at`th model."""
    return lambda run: run.by_model[at].ttfb[point]
