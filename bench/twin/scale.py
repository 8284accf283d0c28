"""One large twin run, for the figures past this machine: a workload on thousands of hosts,
priced patience (`auto`), its figures, and the CPU and memory the run took.

    PYTHONPATH=bench .venv/bin/python -m twin.scale --hosts 2000 --minutes 0.05
    PYTHONPATH=bench .venv/bin/python -m twin.scale --hosts 2000 --minutes 42.6  # 1M conversations
"""

from __future__ import annotations

import argparse
import logging
import os
import resource
import sys
import time
from collections.abc import Sequence

if __name__ == "__main__" and os.environ.get("PYTHONHASHSEED") != "0":
    os.environ["PYTHONHASHSEED"] = "0"
    os.execv(sys.executable, [sys.executable, "-m", "twin.scale", *sys.argv[1:]])

from twin.gateway import Policy  # noqa: E402
from twin.presets import PRESETS  # noqa: E402
from twin.run import run  # noqa: E402
from twin.workloads import WORKLOADS, Scale  # noqa: E402


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m twin.scale", description=__doc__)
    parser.add_argument("--hosts", type=int, default=2000)
    parser.add_argument("--minutes", type=float, default=0.05)
    parser.add_argument("--workload", default="shared_opening", choices=sorted(WORKLOADS))
    parser.add_argument("--preset", default="gpu-8b", choices=sorted(PRESETS))
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    preset = PRESETS[args.preset]
    speeds = next(iter(preset.models.values()))
    scale = Scale(
        hosts=args.hosts, slots=preset.slots, minutes=args.minutes,
        prefill_tps=speeds.prefill_tps,
        decode_tps=speeds.decode_tps[min(preset.slots, len(speeds.decode_tps)) - 1],
    )  # fmt: skip
    workload = WORKLOADS[args.workload](args.seed, scale)
    conversations = sum(1 for _ in workload.conversations())
    began = time.process_time()
    figures = run(workload, preset, args.hosts, Policy("auto"))
    cpu = time.process_time() - began
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(
        f"{args.workload} on {args.hosts} x {args.preset}, {args.minutes:g} minutes: "
        f"{conversations} conversations, {figures.requests} requests, {figures.served} served, "
        f"cache {figures.cache_fraction:.1%}, TTFB p95 {figures.ttfb[1]:.2f} s; "
        f"CPU {cpu:.1f} s ({cpu / max(figures.requests, 1) * 1000:.2f} ms a request), "
        f"max RSS {rss:.0f} MiB"
    )
    return 0


if __name__ == "__main__":
    logging.disable(logging.WARNING)
    sys.exit(main())
