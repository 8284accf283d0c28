"""`make twin`: every workload on every preset's fleet, placed by each policy, in virtual
time; one table a workload and preset, each figure the median of the seeds.

    PYTHONPATH=bench .venv/bin/python -m twin                           # the default table
    PYTHONPATH=bench .venv/bin/python -m twin --seeds 20                # the issue's judgement
    PYTHONPATH=bench .venv/bin/python -m twin --workloads agent --presets gpu-8b --hosts 2000 ...
    PYTHONPATH=bench .venv/bin/python -m twin --layouts static autoload fleet --seeds 5
                                        # router-mode hosts: models_shift on 3 x gpu-mixed
    PYTHONPATH=bench .venv/bin/python -m twin --fairness --seeds 20
                                        # fair sharing between client keys (twin/fairness.py)

The same arguments print the same bytes: the workloads are seeded, the clock is virtual, and
the interpreter's string hashing is fixed (the process starts itself again with
PYTHONHASHSEED=0 when it is not), since the prefix index hashes prompts with Python's `hash`.
How long it took goes to stderr, so that stdout is the table alone.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor

# Before anything hashes a string: the prefix index hashes prompts with Python's `hash`.
if __name__ == "__main__" and os.environ.get("PYTHONHASHSEED") != "0":
    os.environ["PYTHONHASHSEED"] = "0"
    os.execv(sys.executable, [sys.executable, "-m", "twin", *sys.argv[1:]])

from twin.fairness import judge  # noqa: E402
from twin.gateway import Policy  # noqa: E402
from twin.layouts import LAYOUTS  # noqa: E402
from twin.presets import PRESETS  # noqa: E402
from twin.report import AUTO, ONE_HOST, models_table, table, verdicts  # noqa: E402
from twin.run import run, run_models  # noqa: E402
from twin.tally import Figures  # noqa: E402
from twin.workloads import MORE_MODELS, WORKLOADS, sized  # noqa: E402

FIXED = (0.0, 2.0, 8.0, 30.0)  # the fixed patiences auto is judged against (2 s: the default)
DEFAULT_PRESETS = ("gpu-8b", "gpu-70b")
CALIBRATION = "calibration"  # the bench-cache workload: the tiny preset's, on its own fleet
# With --layouts: router-mode hosts serving several models (issue 43's judgement).
MODELS_WORKLOADS, MODELS_PRESETS, MODELS_HOSTS = ("models_shift",), ("gpu-mixed",), 3


def policies() -> list[Policy]:
    return [
        Policy(ONE_HOST, one_host=True),
        Policy(AUTO),
        *(Policy(f"{patience:g} s", patience) for patience in FIXED),
    ]


def _one(task: tuple[str, str, int, int, float, Policy | str]) -> Figures:
    """One run: `policy` a Policy (one model a host), or a layout's name (router mode: every
    model of the preset, the workload's named after them in order)."""
    workload_name, preset_name, seed, hosts, minutes, policy = task
    preset = PRESETS[preset_name]
    models = ("chat", *MORE_MODELS)[: len(preset.models)] if isinstance(policy, str) else ("chat",)
    scale = sized(preset, hosts, minutes, models)
    workload = WORKLOADS[workload_name](seed, scale)
    if isinstance(policy, Policy):
        return run(workload, preset, hosts, policy)
    names = [f"h{number:04d}" for number in range(hosts)]
    layout = LAYOUTS[policy](names, workload.models, preset.models_max)
    return run_models(workload, preset, layout)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m twin", description=__doc__)
    parser.add_argument("--workloads", nargs="+")
    parser.add_argument("--presets", nargs="+")
    parser.add_argument("--hosts", type=int)
    parser.add_argument(
        "--layouts", nargs="+", choices=list(LAYOUTS),
        help="router-mode hosts serving every model, laid out so, instead of the policies "
        f"(by default then {' '.join(MODELS_WORKLOADS)} on {MODELS_HOSTS} x "
        f"{' '.join(MODELS_PRESETS)})",
    )  # fmt: skip
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument(
        "--fairness", action="store_true",
        help="fair sharing between client keys judged instead (twin/fairness.py: the cases "
        "on each preset, by default 8 hosts of each GPU preset)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.fairness:
        return _fairness(args.presets or list(DEFAULT_PRESETS), args)
    if args.layouts:
        args.workloads = args.workloads or list(MODELS_WORKLOADS)
        args.presets = args.presets or list(MODELS_PRESETS)
        args.hosts = args.hosts or MODELS_HOSTS
    args.workloads = args.workloads or [n for n in WORKLOADS if n != CALIBRATION]
    args.presets = args.presets or list(DEFAULT_PRESETS)
    args.hosts = args.hosts or 8
    unknown = [n for n in args.workloads if n not in WORKLOADS]
    unknown += [n for n in args.presets if n not in PRESETS]
    if unknown:
        parser.error(f"unknown: {', '.join(unknown)} (workloads: {', '.join(WORKLOADS)}; "
                     f"presets: {', '.join(PRESETS)})")  # fmt: skip
    started = time.perf_counter()
    rows: list[Policy] | list[str] = args.layouts or policies()
    names = [row if isinstance(row, str) else row.name for row in rows]
    tasks = [
        (workload, preset, seed, args.hosts, args.minutes, policy)
        for workload in args.workloads
        for preset in args.presets
        for seed in range(1, args.seeds + 1)
        for policy in rows
    ]
    with ProcessPoolExecutor(max_workers=max(args.jobs, 1)) as pool:
        results = list(pool.map(_one, tasks, chunksize=1))
    at = 0
    for workload in args.workloads:
        for preset in args.presets:
            runs: dict[str, list[Figures]] = {name: [] for name in names}
            for _seed in range(args.seeds):
                for name in names:
                    runs[name].append(results[at])
                    at += 1
            title = (f"{workload} on {args.hosts} x {preset}, {args.minutes:g} minutes, "
                     f"{args.seeds} seed(s), medians")  # fmt: skip
            if args.layouts:
                print(models_table(title, runs))
            else:
                print(table(title, runs))
                for line in verdicts(runs):
                    print(f"  {line}")
            print()
    print(f"twin: {len(tasks)} runs in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    return 0


def _fairness(presets: list[str], args: argparse.Namespace) -> int:
    started = time.perf_counter()
    lines = judge(presets, args.seeds, args.hosts or 8, args.minutes, args.jobs)
    print("\n".join(lines))
    print(f"twin: fairness in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    logging.disable(logging.WARNING)  # the gateway's own advice to operators, once a request
    sys.exit(main())
