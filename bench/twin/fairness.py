"""`python -m twin --fairness`: fair sharing between client keys judged on the twin (the fair
sharing issue's "Done when"), per GPU preset, each figure the median of the seeds.

Four cases, each the workload's clients presenting client keys as a real client does (the
view's own access check finds each request's key, class and weight: `TwinGateway`), placed by
`auto`, every other setting at its default (CROSSBAR_HEADROOM interactive=1,
CROSSBAR_STARVATION_BOUND 30 s):

- `alone`: the `clients` workload's interactive conversations only (its key, class
  interactive): the TTFB it has with the fleet to itself.
- `fifo`: the whole `clients` workload (interactive at 30% of the capacity, batch at 4x,
  standard) without client keys: one anonymous key, one class, every line first come first
  served. Each row's client is its conversation's (`Tally.clients`).
- `fair`: the same with the interactive key's class interactive and the batch key's batch.
- `weights`: `backlogged`, two keys of class standard each sending batch summaries at 2x the
  capacity, `light` of weight 1 and `heavy` of weight 2.

A client's slot time is its served requests' time from the grant to the end (a row's
`total_ms - queued_ms`); a wait, the time a request spent in a line (`queued_ms`, or a
`queue_timeout`'s whole time); tokens a second, the tokens generated over the run's time (from
0 until its last request ended).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

from routing.core.clients import ClientSpec
from routing.core.fairness import DEFAULT_STARVATION_BOUND, Priority
from twin.gateway import Policy
from twin.presets import PRESETS
from twin.report import AUTO
from twin.run import run
from twin.shapes import Workload
from twin.tally import ClientFigures, Figures
from twin.workloads import Scale, backlogged, clients, interactive_alone, sized

__all__ = ["CASES", "Case", "judge", "table", "verdicts"]

INTERACTIVE, BATCH, STANDARD = Priority.INTERACTIVE, Priority.BATCH, Priority.STANDARD
WORKLOADS: dict[str, Callable[[int, Scale], Workload]] = {
    "clients": clients, "interactive_alone": interactive_alone, "backlogged": backlogged,
}  # fmt: skip

# The bounds.
TTFB_OVER_ALONE = 1.5
TOKENS_OF_FIFO = 0.9
SPLIT_WITHIN = 0.10
EVALUATED_OF_FIFO = 1.05


@dataclass(frozen=True, slots=True)
class Case:
    """A workload (`WORKLOADS`' name) and the keys its clients present (None: no keys)."""

    name: str
    workload: str
    keys: Mapping[str, ClientSpec] | None


def _keys(**classes: tuple[Priority, float]) -> dict[str, ClientSpec]:
    return {name: ClientSpec(name, priority=p, weight=w) for name, (p, w) in classes.items()}


CASES = (
    Case("alone", "interactive_alone", _keys(interactive=(INTERACTIVE, 1.0))),
    Case("fifo", "clients", None),
    Case("fair", "clients", _keys(
        interactive=(INTERACTIVE, 1.0), batch=(BATCH, 1.0), standard=(STANDARD, 1.0))),
    Case("weights", "backlogged", _keys(light=(STANDARD, 1.0), heavy=(STANDARD, 2.0))),
)  # fmt: skip


def one(case: Case, preset: str, seed: int, hosts: int, minutes: float) -> Figures:
    """One case's run on `hosts` hosts of `preset`, each client's figures apart."""
    profile = PRESETS[preset]
    workload = WORKLOADS[case.workload](seed, sized(profile, hosts, minutes))
    return run(workload, profile, hosts, Policy(AUTO), case.keys, by_client=True)


def _one(task: tuple[Case, str, int, int, float]) -> Figures:
    return one(*task)


def judge(presets: Sequence[str], seeds: int, hosts: int, minutes: float, jobs: int) -> list[str]:
    """Every case on every preset for each seed; the tables and verdicts, as lines."""
    tasks = [
        (case, preset, seed, hosts, minutes)
        for preset in presets
        for seed in range(1, seeds + 1)
        for case in CASES
    ]
    with ProcessPoolExecutor(max_workers=max(jobs, 1)) as pool:
        results = iter(list(pool.map(_one, tasks, chunksize=1)))
    lines: list[str] = []
    for preset in presets:
        runs: dict[str, list[Figures]] = {case.name: [] for case in CASES}
        for _seed in range(seeds):
            for case in CASES:
                runs[case.name].append(next(results))
        title = f"fair sharing on {hosts} x {preset}, {minutes:g} minutes, {seeds} seed(s), medians"
        lines += [table(title, runs), *(f"  {line}" for line in verdicts(runs)), ""]
    return lines


def _median(runs: Sequence[Figures], figure: Callable[[Figures], float]) -> float:
    return statistics.median(figure(run) for run in runs)


def _tokens_per_s(run: Figures) -> float:
    return run.generated / run.elapsed_s if run.elapsed_s else 0.0


def _longest_wait(run: Figures) -> float:
    return max((client.longest_wait_s for client in run.by_client), default=0.0)


def _split(run: Figures) -> float:
    """The heavy key's slot time over the light key's."""
    light = run.client("light").slot_s
    return run.client("heavy").slot_s / light if light else 0.0


def table(title: str, runs: Mapping[str, Sequence[Figures]]) -> str:
    """Each case's fleet figures, then each of its clients' (medians of the seeds)."""
    lines = [
        title,
        f"{'case':<10}{'client':<13}{'requests':>9}{'served':>8}{'refused':>8}{'queue_full':>11}"
        f"{'ttfb p50':>9}{'p95':>7}{'slot s':>9}{'wait max':>9}{'tokens/s':>9}{'evaluated':>11}",
    ]
    for case, figures in runs.items():
        lines.append(
            f"{case:<10}{'(fleet)':<13}{_median(figures, lambda f: f.requests):>9.0f}"
            f"{_median(figures, lambda f: f.served):>8.0f}"
            f"{_median(figures, lambda f: f.refused + f.failed):>8.0f}{'':>11}"
            f"{_median(figures, lambda f: f.ttfb[0]):>9.2f}"
            f"{_median(figures, lambda f: f.ttfb[1]):>7.2f}{'':>9}"
            f"{_median(figures, _longest_wait):>9.1f}{_median(figures, _tokens_per_s):>9.0f}"
            f"{_median(figures, lambda f: f.evaluated):>11.0f}"
        )
        for name in [client.client for client in figures[0].by_client]:
            lines.append(f"{'':<10}{name:<13}" + _client_cells([f.client(name) for f in figures]))
    return "\n".join(lines)


CLIENT_COLUMNS: tuple[tuple[str, Callable[[ClientFigures], float]], ...] = (
    ("{:>9.0f}", lambda c: c.requests),
    ("{:>8.0f}", lambda c: c.served),
    ("{:>8.0f}", lambda c: c.refused),
    ("{:>11.0f}", lambda c: c.queue_full),
    ("{:>9.2f}", lambda c: c.ttfb[0]),
    ("{:>7.2f}", lambda c: c.ttfb[1]),
    ("{:>9.0f}", lambda c: c.slot_s),
    ("{:>9.1f}", lambda c: c.longest_wait_s),
)


def _client_cells(runs: Sequence[ClientFigures]) -> str:
    return "".join(
        fmt.format(statistics.median(figure(run) for run in runs)) for fmt, figure in CLIENT_COLUMNS
    )


def verdicts(runs: Mapping[str, Sequence[Figures]]) -> list[str]:
    """The issue's "Done when", each with its figures: `fair` against `alone` and `fifo`, the
    `weights` split, and the longest wait of `fair` and `weights` (the worst seed's: "no
    request" is every seed's)."""

    def interactive_p95(run: Figures) -> float:
        return run.client("interactive").ttfb[1]

    def ratio(case: str, against: str, figure: Callable[[Figures], float]) -> float:
        below = _median(runs[against], figure)
        return _median(runs[case], figure) / below if below else float("inf")

    def said(ok: bool) -> str:
        return "pass" if ok else "FAIL"

    p95 = ratio("fair", "alone", interactive_p95)
    refused = {case: _median(runs[case], lambda f: f.client("interactive").refused)
               for case in ("alone", "fair")}  # fmt: skip
    tokens = ratio("fair", "fifo", _tokens_per_s)
    evaluated = ratio("fair", "fifo", lambda f: f.evaluated)
    split = _median(runs["weights"], _split)
    held = sum(abs(_split(run) / 2 - 1) <= SPLIT_WITHIN for run in runs["weights"])
    waits = {case: max(map(_longest_wait, runs[case])) for case in ("fifo", "fair", "weights")}
    bound = DEFAULT_STARVATION_BOUND
    return [
        f"{said(p95 <= TTFB_OVER_ALONE)}: interactive TTFB p95, fair / alone = {p95:.2f}x "
        f"(at most {TTFB_OVER_ALONE}x, over its served requests; its refused: fair "
        f"{refused['fair']:.0f}, alone {refused['alone']:.0f})",
        f"{said(tokens >= TOKENS_OF_FIFO)}: tokens/s, fair / fifo = {tokens:.3f}x "
        f"(at least {TOKENS_OF_FIFO}x)",
        f"{said(abs(split / 2 - 1) <= SPLIT_WITHIN)}: slot time heavy / light (weights 2:1) = "
        f"{split:.2f} (2 within {SPLIT_WITHIN:.0%}; {held}/{len(runs['weights'])} seeds within)",
        f"{said(evaluated <= EVALUATED_OF_FIFO)}: prompt tokens evaluated, fair / fifo = "
        f"{evaluated:.3f}x (at most {EVALUATED_OF_FIFO}x)",
        f"{said(max(waits['fair'], waits['weights']) <= bound)}: longest wait in a line, worst "
        f"seed: fair {waits['fair']:.1f} s, weights {waits['weights']:.1f} s (bound {bound:g} s;"
        f" fifo {waits['fifo']:.1f} s)",
    ]
