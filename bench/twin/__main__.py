"""`make twin`: every workload on every preset's fleet, placed by each policy, in virtual
time; one table a workload and preset, each figure the median of the seeds.

    PYTHONPATH=bench .venv/bin/python -m twin                           # the default table
    PYTHONPATH=bench .venv/bin/python -m twin --seeds 20                # the issue's judgement
    PYTHONPATH=bench .venv/bin/python -m twin --workloads agent --presets gpu-8b --hosts 2000 ...

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

from twin.gateway import Policy
from twin.presets import PRESETS
from twin.report import AUTO, ONE_HOST, table, verdicts
from twin.run import run
from twin.tally import Figures
from twin.workloads import WORKLOADS, Scale

FIXED = (0.0, 2.0, 8.0, 30.0)  # the fixed patiences auto is judged against (2 s: the default)
DEFAULT_PRESETS = ("gpu-8b", "gpu-70b")
CALIBRATION = "calibration"  # the bench-cache workload: the tiny preset's, on its own fleet


def policies() -> list[Policy]:
    return [
        Policy(ONE_HOST, one_host=True),
        Policy(AUTO),
        *(Policy(f"{patience:g} s", patience) for patience in FIXED),
    ]


def _one(task: tuple[str, str, int, int, float, Policy]) -> Figures:
    workload_name, preset_name, seed, hosts, minutes, policy = task
    preset = PRESETS[preset_name]
    speeds = next(iter(preset.models.values()))
    scale = Scale(
        hosts=hosts, slots=preset.slots, minutes=minutes, prefill_tps=speeds.prefill_tps,
        decode_tps=speeds.decode_tps[min(preset.slots, len(speeds.decode_tps)) - 1],
    )  # fmt: skip
    return run(WORKLOADS[workload_name](seed, scale), preset, hosts, policy)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m twin", description=__doc__)
    parser.add_argument(
        "--workloads", nargs="+", default=[n for n in WORKLOADS if n != CALIBRATION]
    )
    parser.add_argument("--presets", nargs="+", default=list(DEFAULT_PRESETS))
    parser.add_argument("--hosts", type=int, default=8)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args(argv)
    unknown = [n for n in args.workloads if n not in WORKLOADS]
    unknown += [n for n in args.presets if n not in PRESETS]
    if unknown:
        parser.error(f"unknown: {', '.join(unknown)} (workloads: {', '.join(WORKLOADS)}; "
                     f"presets: {', '.join(PRESETS)})")  # fmt: skip
    started = time.perf_counter()
    rows = policies()
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
            runs: dict[str, list[Figures]] = {policy.name: [] for policy in rows}
            for _seed in range(args.seeds):
                for policy in rows:
                    runs[policy.name].append(results[at])
                    at += 1
            title = (f"{workload} on {args.hosts} x {preset}, {args.minutes:g} minutes, "
                     f"{args.seeds} seed(s), medians")  # fmt: skip
            print(table(title, runs))
            for line in verdicts(runs):
                print(f"  {line}")
            print()
    print(f"twin: {len(tasks)} runs in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    if os.environ.get("PYTHONHASHSEED") != "0":
        os.environ["PYTHONHASHSEED"] = "0"
        os.execv(sys.executable, [sys.executable, "-m", "twin", *sys.argv[1:]])
    logging.disable(logging.WARNING)  # the gateway's own advice to operators, once a request
    sys.exit(main())
