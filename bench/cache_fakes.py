"""bench-cache's agent-like workload through crossbar against two fake llama-servers.

    .venv/bin/python bench/cache_fakes.py --seed 1 --restart-at 0.5 --patience 2

Where each conversation ends up leased, without building llama-server: two fakes
(tests/fakes/llama_server.py, 2 slots each, `queue_max` 8), one route `bench` over them with
`lease_patience` as given, and the workload of bench/cache_workload.py (12 conversations
starting together by default) sent by bench/cache_phase.py, as `make bench-cache` sends it.
With `--restart-at`, the first fake stops once that share of the requests is done and starts
again on its port `--down-for` seconds later, as bench-cache restarts its first host. Prints
the hosts the conversations are leased to at the end, the placements, and each conversation's
turns (host:placement/lease). The fakes model a slot's prompt cache, not its prefill time:
the tokens they report say little; where leases go is what this measures.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # tests.fakes

from bench_scale import wait_up  # noqa: E402  (bench/ is not a package)
from cache_phase import Phase  # noqa: E402
from cache_report import Answer, placement_reason  # noqa: E402
from cache_workload import Shape, make_workload  # noqa: E402
from llama_hosts import MODEL  # noqa: E402
from processes import RESULTS, ROOT, crossbar  # noqa: E402

from tests.fakes.llama_server import FakeLlamaServer  # noqa: E402


class FakeHost:
    """A fake llama-server that `crash()` stops and starts again on the same port."""

    def __init__(self, name: str, token_delay: float) -> None:
        self.name = name
        self.token_delay = token_delay
        self.down_for = 0.0
        self.fake = FakeLlamaServer(slots=2, token_delay=token_delay, models=(MODEL,)).start()

    def crash(self) -> None:
        self.fake.stop()
        time.sleep(self.down_for)
        self.fake = FakeLlamaServer(
            slots=2, token_delay=self.token_delay, models=(MODEL,), port=self.fake.port
        ).start()


def fleet_toml(hosts: list[FakeHost], patience: str, queue_max: int) -> str:
    parts = [
        f'[[hosts]]\nname = "{host.name}"\nurl = "{host.fake.url}"\n\n  [[hosts.models]]\n'
        f'  name = "{MODEL}"\n  parallel = 2\n  queue_max = {queue_max}\n'
        for host in hosts
    ]
    names = ", ".join(f'"{host.name}"' for host in hosts)
    parts.append(f'[[routes]]\nname = "bench"\ndefault_model = "{MODEL}"\n'
                 f"lease_patience = {patience}\nhosts = [{names}]\n")  # fmt: skip
    return "\n".join(parts)


def leased_to(answers: list[Answer]) -> dict[int, str]:
    """Each conversation's lease host after its last turn: where a `new` or `moved` lease
    took it (a `spilled` turn leaves the lease where it was)."""
    homes: dict[int, str] = {}
    for answer in sorted(answers, key=lambda a: (a.conversation, a.turn)):
        if answer.lease in ("new", "moved"):
            homes[answer.conversation] = answer.host
    return homes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--seed", type=int, default=0)
    add("--conversations", type=int, default=12)
    add("--turns", type=int, default=6)
    add("--bursts", type=int, default=1, help="1: every conversation starts together")
    add("--patience", default="2", help="the route's lease_patience: seconds, or auto")
    add("--queue-max", type=int, default=8)
    add("--token-delay", type=float, default=0.02, help="the fakes' seconds per token")
    add("--max-tokens", type=int, default=96)
    add("--restart-at", type=float, default=0.0, help="restart the first fake at this share")
    add("--down-for", type=float, default=1.0, help="seconds the restarted fake is away")
    args = parser.parse_args()
    shape = Shape(args.conversations, args.turns, args.bursts, 5.0, (0.5, 3.0), 400, 8, 30, 600,
                  (100, 250), args.max_tokens)  # fmt: skip
    workload = make_workload(shape, args.seed)
    hosts = [FakeHost(f"h{n}", args.token_delay) for n in (1, 2)]
    hosts[0].down_for = args.down_for
    patience = args.patience if args.patience != "auto" else '"auto"'
    work = RESULTS / f"cache-fakes-{time.strftime('%Y%m%d-%H%M%S')}"
    work.mkdir(parents=True)
    after = round(workload.requests * args.restart_at)
    try:
        toml = fleet_toml(hosts, patience, args.queue_max)
        with crossbar(work, None, ROOT, "crossbar_serve", toml, name="crossbar") as gateway:
            wait_up(gateway.url, len(hosts))
            chat = f"{gateway.url}/bench/v1/chat/completions"
            restarted = hosts[0] if after else None
            # Phase asks of the host it restarts only its name and crash().
            phase = Phase("crossbar", workload, [], chat, restarted, after)  # type: ignore[arg-type]
            answers = asyncio.run(phase.run())
    finally:
        for host in hosts:
            host.fake.stop()
    print("leased at the end:", dict(Counter(leased_to(answers).values())))
    print("placements:", dict(Counter((placement_reason(a.placement), a.lease) for a in answers)))
    print("failed:", sum(1 for answer in answers if answer.status != 200), "log:", work)
    for number in range(args.conversations):
        turns = sorted((a for a in answers if a.conversation == number), key=lambda a: a.turn)
        print(
            number, " ".join(f"{a.host}:{placement_reason(a.placement)}/{a.lease}" for a in turns)
        )


if __name__ == "__main__":
    main()
