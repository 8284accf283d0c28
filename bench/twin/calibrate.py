"""The twin beside real `make bench-cache` runs: the same workload on the tiny preset's fleet
(bench-cache's: 3 hosts of 2 slots, --cache-ram 7 MiB, --slot-prompt-similarity 0.95, its
one-host as well), policy by policy, prompt tokens evaluated.

    PYTHONPATH=bench .venv/bin/python -m twin.calibrate bench/results/cache-A.json ...

Each real run is one `bench_cache.py --policies one-host crossbar --patience 0 2 600 auto
--restart-at 0 --calm-conversations 0 --rounds 1` (the twin's calibration workload has
neither the restart nor the calm phase). The verdicts the twin issue asks: for each policy
whose real runs agree within 10% of each other, the twin within 10% of their median; for each
two policies all real runs order the same way, the twin orders them so too.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

# Before anything hashes a string: the prefix index hashes prompts with Python's `hash`.
if __name__ == "__main__" and os.environ.get("PYTHONHASHSEED") != "0":
    os.environ["PYTHONHASHSEED"] = "0"
    os.execv(sys.executable, [sys.executable, "-m", "twin.calibrate", *sys.argv[1:]])

from twin.gateway import Policy  # noqa: E402
from twin.presets import PRESETS  # noqa: E402
from twin.run import run  # noqa: E402
from twin.workloads import WORKLOADS, Scale  # noqa: E402

HOSTS = 3
AGREE = 0.10  # real runs agree when their largest is within 10% of their smallest
BENCH_SIMILARITY = 0.95  # bench-cache's --slot-prompt-similarity, its one-host's too


def policy_of(key: str) -> Policy:
    """bench-cache's policy key as the twin's policy."""
    if key == "one-host":
        # As bench-cache's: one llama-server, one thread: one host's compute.
        return Policy(key, one_host=True, similarity=BENCH_SIMILARITY, compute=1)
    patience = key.removeprefix("crossbar@")
    return Policy(key, None if patience == "auto" else float(patience))


def twin_evaluated(keys: Sequence[str], seed: int) -> dict[str, int]:
    preset = PRESETS["tiny"]
    workload = WORKLOADS["calibration"](seed, Scale(hosts=HOSTS, slots=preset.slots, minutes=1))
    return {key: run(workload, preset, HOSTS, policy_of(key)).evaluated for key in keys}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m twin.calibrate", description=__doc__)
    parser.add_argument("results", nargs="+", type=Path, help="bench-cache results (JSON)")
    args = parser.parse_args(argv)
    runs = [json.loads(path.read_text()) for path in args.results]
    seeds = {run_["args"]["seed"] for run_ in runs}
    if len(seeds) != 1:
        parser.error(f"the runs used different seeds: {sorted(seeds)}")
    keys = [key for key in runs[0]["main"] if all(key in run_["main"] for run_ in runs)]
    real = {key: [run_["main"][key]["prompt_tokens_evaluated"] for run_ in runs] for key in keys}
    twin = twin_evaluated(keys, seeds.pop())
    print(
        f"{'policy':<16}{'real runs':>28}{'spread':>8}{'median':>9}{'twin':>9}{'twin/median':>13}"
    )
    for key in keys:
        values = real[key]
        spread = max(values) / min(values) - 1
        median = statistics.median(values)
        ratio = twin[key] / median
        verdict = "" if spread > AGREE else ("  within 10%" if abs(ratio - 1) <= AGREE else "  OFF")
        shown = " ".join(f"{value:>8}" for value in values)
        print(f"{key:<16}{shown:>28}{spread:>8.1%}{median:>9.0f}{twin[key]:>9}{ratio:>12.3f}x"
              f"{verdict}")  # fmt: skip
    print()
    for first, second in itertools.combinations(keys, 2):
        signs = {(a > b) - (a < b) for a, b in zip(real[first], real[second], strict=True)}
        if len(signs) != 1 or 0 in signs:
            continue  # the real runs do not agree on their order
        order = signs.pop()
        twin_order = (twin[first] > twin[second]) - (twin[first] < twin[second])
        word = "<" if order < 0 else ">"
        print(f"every real run: {first} {word} {second}; twin "
              f"{'agrees' if twin_order == order else 'DISAGREES'}")  # fmt: skip
    return 0


if __name__ == "__main__":
    logging.disable(logging.WARNING)
    sys.exit(main())
