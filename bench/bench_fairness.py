"""Fair sharing between client keys judged once on real llama-servers: `make bench-fairness`.

    nice -n 10 .venv/bin/python bench/bench_fairness.py                  # about 12 minutes
    nice -n 10 .venv/bin/python bench/bench_fairness.py --minutes 0.5 --cases alone fair

The twin's judgement (bench/twin/fairness.py, `python -m twin --fairness`) on the fleet of
`make bench-cache`: `--hosts` real llama-servers of `--parallel` slots (bench/llama_hosts.py:
the binary of `make llama-server`, the tiny random model, one thread, `-sps 0.95`), crossbar
in front as `make run` serves it (one route over them, `lease_patience = "auto"`, every
other setting at its default: CROSSBAR_HEADROOM interactive=1, CROSSBAR_STARVATION_BOUND 30 s),
its client keys made in its database before it starts, as the admin would hold them.

First a calibration: requests of each kind (bench/fairness_workload.py) sent straight to the
hosts with every slot busy, the median time each holds its slot; the clients' rates follow
from it (`rate`). Then, each from cold hosts and a new gateway, for `--minutes` of arrivals:

- `alone`: the interactive key (class interactive) alone, at 30% of the fleet's slots;
- `fifo`: the same chats beside document summaries at 4x the slots, no keys (one class,
  every line first come first served);
- `fair`: the same with keys: `interactive` of class interactive, `batch` of class batch;
- `weights`: two keys of class standard, `light` (weight 1) and `heavy` (weight 2), each
  sending summaries at 2x the slots.

A refused request is not tried again (a flood's client has more to send), and a chat whose
turn was refused ends there. The figures are the gateway's own rows (its SQLite database,
read when it has stopped), their TTFB the bench's time to the first body byte
(`to_first_byte`), counted by the twin's `Tally` (a row's client is its key's name; without
keys, its conversation's client, by the row's fingerprint) and printed with the twin's `table`
and `verdicts`, and where each client's requests waited (`split`); written to
bench/results/fairness-<time>.json, logs in bench/results/fairness-<time>/.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import sqlite3
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import httpx

sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # tests.e2e.llama's helpers

from bench_cache import fleet_toml  # noqa: E402
from bench_scale import wait_up  # noqa: E402  (bench/ is not a package)
from cache_phase import LIMITS, TIMEOUT, stream  # noqa: E402
from fairness_workload import (  # noqa: E402
    INTERACTIVE,
    SUMMARY,
    Calibration,
    Conversation,
    Kind,
    Turn,
    conversations,
    workload,
)
from llama_hosts import MODEL, Host, Launch  # noqa: E402
from processes import RESULTS, crossbar, machine, source_tree  # noqa: E402
from twin.fairness import CASES, table, verdicts  # noqa: E402
from twin.tally import Figures, Tally  # noqa: E402

from accounting.rows import RequestRecord  # noqa: E402
from routing.core.fingerprint import fingerprint  # noqa: E402
from tests.e2e.llama.locate import NOT_BUILT, find_binary, vocab_path  # noqa: E402
from tests.e2e.llama.tiny_model import MissingDependency, write_tiny_model  # noqa: E402

# Each case's clients: their kind and their share of the fleet's slots (the twin's `clients`
# workload without its standard chats, and its `backlogged`).
CLIENTS: dict[str, dict[str, tuple[Kind, float]]] = {
    "alone": {"interactive": (INTERACTIVE, 0.3)},
    "fifo": {"interactive": (INTERACTIVE, 0.3), "batch": (SUMMARY, 4.0)},
    "fair": {"interactive": (INTERACTIVE, 0.3), "batch": (SUMMARY, 4.0)},
    "weights": {"light": (SUMMARY, 2.0), "heavy": (SUMMARY, 2.0)},
}
KEYS = {case.name: case.keys for case in CASES}  # the twin's keys: class and weight by name
SIMILARITY = ("--slot-prompt-similarity", "0.95")  # bench-cache's, as docs/config.md advises


def key_of(client: str) -> str:
    """The bench's client key for a key name (the gateway stores only its hash)."""
    return f"cb-bench-{client}"


def make_keys(case: str) -> list[list[str]]:
    """The manage.py command that makes the case's client keys (none for `fifo`, `alone`'s
    interactive key only as the twin has it), each with the twin's class and weight."""
    keys = KEYS[case]
    if keys is None:
        return []
    specs = [(spec.name, key_of(spec.name), spec.priority.value, spec.weight)
             for spec in keys.values()]  # fmt: skip
    script = (
        "from accounting.keys import hash_key, shown_prefix\n"
        "from accounting.models import ClientKey\n"
        f"for name, key, priority, weight in {specs!r}:\n"
        "    ClientKey.objects.create(name=name, prefix=shown_prefix(key), "
        "key_hash=hash_key(key), priority=priority, weight=weight)\n"
    )
    return [["shell", "-c", script]]


def body(turn: Turn) -> dict[str, object]:
    # ignore_eos: every answer generates exactly max_tokens, whatever the random weights say.
    return {"model": MODEL, "messages": list(turn.messages), "stream": True,
            "max_tokens": turn.max_tokens, "temperature": 0, "ignore_eos": True,
            "cache_prompt": True}  # fmt: skip


def calibrate(hosts: Sequence[Host], seed: int, each: int) -> Calibration:
    """Every slot of the fleet busy with first turns of one kind, then the other, straight to
    the hosts (a slot each): the median seconds a request took, start to end, by kind."""
    slots = sum(host.slots for host in hosts)
    urls = [f"{host.url}/v1/chat/completions" for host in hosts for _ in range(host.slots)]

    async def kind_s(kind: Kind) -> float:
        chats = itertools.islice(conversations(seed, "calibration", kind, 1.0), slots * each)
        took: list[float] = []

        async def lane(url: str, turns: Sequence[Turn]) -> None:
            for turn in turns:
                began = time.monotonic()
                outcome = await stream(client, url, body(turn))
                if outcome.status != 200:
                    sys.exit(f"bench-fairness: calibration failed: {outcome.error}")
                took.append(time.monotonic() - began)

        async with httpx.AsyncClient(timeout=TIMEOUT, limits=LIMITS, trust_env=False) as client:
            firsts = [chat.turns[0] for chat in chats]
            await asyncio.gather(*(lane(url, firsts[n::slots]) for n, url in enumerate(urls)))
        return statistics.median(took)

    for host in hosts:
        host.cold()
    return Calibration(
        slots, {kind.name: asyncio.run(kind_s(kind)) for kind in (INTERACTIVE, SUMMARY)}
    )


@dataclass
class Sent:
    """What the bench saw of a case: requests sent and answered, the run's seconds (from the
    first arrival's time 0 to the last request's end), each conversation's client by the
    fingerprint its requests carry (for rows without a key), and, by fingerprint in the order
    sent, each request's milliseconds from its sending to its answer's first body byte (None:
    not answered)."""

    requests: int = 0
    answered: int = 0
    elapsed_s: float = 0.0
    clients: dict[str, str] = field(default_factory=dict)
    first_byte_ms: dict[str, list[float | None]] = field(default_factory=dict)


async def send(url: str, arrivals: Sequence[Conversation], keyed: bool) -> Sent:
    """Every conversation a task: it waits for its start, then sends turn after turn, each
    after the last one's answer and its pause; a refused turn ends it."""
    sent = Sent()
    loop = asyncio.get_running_loop()
    began = loop.time()
    names = {conversation.client for conversation in arrivals}
    headers = {name: {"Authorization": f"Bearer {key_of(name)}"} if keyed else {} for name in names}
    clients = {name: httpx.AsyncClient(timeout=TIMEOUT, limits=LIMITS, trust_env=False,
                                       headers=headers[name]) for name in names}  # fmt: skip

    async def converse(conversation: Conversation) -> None:
        await asyncio.sleep(max(0.0, began + conversation.start - loop.time()))
        for turn in conversation.turns:
            request = body(turn)
            name = fingerprint("POST", request, None)
            sent.clients[name] = conversation.client
            sent.requests += 1
            asked = loop.time()
            outcome = await stream(clients[conversation.client], url, request)
            sent.elapsed_s = max(sent.elapsed_s, loop.time() - began)
            answered = outcome.status == 200 and outcome.first_byte is not None
            first = (outcome.first_byte - asked) * 1000 if answered and outcome.first_byte else None
            sent.first_byte_ms.setdefault(name, []).append(first)
            if not answered:
                return
            sent.answered += 1
            await asyncio.sleep(turn.pause_after)

    try:
        async with asyncio.TaskGroup() as group:
            for conversation in arrivals:
                group.create_task(converse(conversation))
    finally:
        for client in clients.values():
            await client.aclose()
    return sent


def rows(database: Path) -> list[RequestRecord]:
    """The gateway's Request rows, as the recorder wrote them."""
    names = [field.name for field in fields(RequestRecord)]
    with sqlite3.connect(database) as connection:
        connection.row_factory = sqlite3.Row
        found = connection.execute("SELECT * FROM accounting_request ORDER BY id").fetchall()
    return [RequestRecord(**{name: row[name] for name in names if name in row.keys()})
            for row in found]  # fmt: skip


def to_first_byte(
    records: Sequence[RequestRecord], first_byte_ms: Mapping[str, Sequence[float | None]]
) -> list[RequestRecord]:
    """The rows with each served one's `ttfb_ms` the bench's time to its first body byte.

    A row's TTFB is the time until the host's response head, and llama-server sends the head
    of a stream before it evaluates the prompt (2,600 tokens of the tiny model: the head after
    30 ms, the first token after 100 ms): the first body byte is what the client waits for, as
    the twin's TTFB is. A conversation's turns go one after another, so its rows (by
    fingerprint, in the order written) are its requests in the order sent."""
    taken: dict[str, int] = {}
    out = []
    for row in records:
        index = taken[row.fingerprint] = taken.get(row.fingerprint, -1) + 1
        sent = first_byte_ms.get(row.fingerprint, ())
        first = sent[index] if index < len(sent) else None
        served = row.status < 400 and first is not None
        out.append(replace(row, ttfb_ms=round(first)) if served and first is not None else row)
    return out


def split(
    records: Sequence[RequestRecord],
    heads: Sequence[RequestRecord],
    clients: Mapping[str, str],
) -> dict[str, object]:
    """Where each client's served requests waited, p50 and p95 in seconds: in a line
    (`queued`), until the host's head (`head`), until the first body byte (`first_byte`), and
    from the slot's grant to the first body byte (`granted`: the host's part, each request's
    own). A row's client is its key's, else its conversation's (`clients`, by fingerprint)."""

    def p(values: list[int]) -> list[float]:
        ordered = sorted(values) or [0]
        return [ordered[min(len(ordered) - 1, (len(ordered) * q + 99) // 100 - 1)] / 1000
                for q in (50, 95)]  # fmt: skip

    by: dict[str, list[tuple[RequestRecord, RequestRecord]]] = {}
    for row, head in zip(records, heads, strict=True):
        if row.status < 400:
            client = row.client or clients.get(row.fingerprint, "")
            by.setdefault(client, []).append((row, head))
    return {
        client: {
            "queued": p([row.queued_ms for row, _ in pairs]),
            "head": p([head.ttfb_ms or 0 for _, head in pairs]),
            "first_byte": p([row.ttfb_ms or 0 for row, _ in pairs]),
            "granted": p([(row.ttfb_ms or 0) - row.queued_ms for row, _ in pairs]),
        }
        for client, pairs in sorted(by.items())
    }


def run_case(
    case: str,
    hosts: Sequence[Host],
    arrivals: Sequence[Conversation],
    work: Path,
    source: Path,
) -> tuple[Figures, Sent, dict[str, object]]:
    """One case from cold hosts and a new gateway: the twin's figures of its rows (TTFB to
    the first body byte), and where its clients' requests waited (`split`)."""
    for host in hosts:
        host.cold()
    toml = fleet_toml(hosts, "auto")
    with crossbar(work, None, source, "crossbar_serve", toml, name=case,
                  commands=make_keys(case)) as gateway:  # fmt: skip
        wait_up(gateway.url, len(hosts))
        url = f"{gateway.url}/bench/v1/chat/completions"
        sent = asyncio.run(send(url, arrivals, keyed=KEYS[case] is not None))
    heads = rows(work / f"{case}.sqlite3")
    records = to_first_byte(heads, sent.first_byte_ms)
    tally = Tally(clients=sent.clients)
    for row in records:
        tally.record(row)
    tally.elapsed_s = sent.elapsed_s
    return tally.figures([host.name for host in hosts]), sent, split(records, heads, sent.clients)


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--seed", type=int, default=1, help="the workload's seed")
    add("--minutes", type=float, default=2.0, help="each case's arrivals, in minutes")
    add("--hosts", type=int, default=2)
    add("--parallel", type=int, default=2, help="slots per host")
    add("--cache-ram", type=int, default=7, metavar="MIB", help="each host's --cache-ram "
        "(bench-cache's: holds of the tiny model what 8 GiB holds of a 70B)")  # fmt: skip
    add("--calibration", type=int, default=3, metavar="N",
        help="requests of each kind per slot in the calibration")  # fmt: skip
    add("--cases", nargs="+", default=list(CLIENTS), choices=list(CLIENTS))
    add("--rev", help="benchmark this commit (default: the working tree, as it is when it starts)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    binary, vocab = find_binary(), vocab_path()
    if binary is None or vocab is None:
        sys.exit(f"bench-fairness: {NOT_BUILT}")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    work = RESULTS / f"fairness-{stamp}"
    work.mkdir(parents=True, exist_ok=True)
    try:
        model = write_tiny_model(work / "tiny.gguf", vocab)
    except MissingDependency as exc:
        sys.exit(f"bench-fairness: {exc}")
    source, provenance = source_tree(work, args.rev)
    launch = Launch(binary, model, work, SIMILARITY)
    hosts = [Host(f"h{n + 1}", args.parallel, 1, args.cache_ram, launch) for n in range(args.hosts)]
    started = uptime()
    print(f"bench-fairness: {provenance}; {binary}; {started}", flush=True)
    runs: dict[str, list[Figures]] = {}
    seen: dict[str, dict[str, object]] = {}
    try:
        calibration = calibrate(hosts, args.seed, args.calibration)
        print(f"  calibration: {json.dumps(asdict(calibration))}", flush=True)
        for case in args.cases:
            arrivals = workload(args.seed, args.minutes * 60, CLIENTS[case], calibration)
            began = time.monotonic()
            figures, sent, waited = run_case(case, hosts, arrivals, work, source)
            runs[case] = [figures]
            seen[case] = {"conversations": len(arrivals), "requests": sent.requests,
                          "answered": sent.answered, "rows": figures.requests,
                          "wall_s": round(time.monotonic() - began, 1),
                          "waited": waited}  # fmt: skip
            print(f"  {case}: {json.dumps(seen[case])}", flush=True)
    finally:
        for host in hosts:
            host.stop()
    ended = uptime()
    title = (f"fair sharing on {args.hosts} real llama-servers x {args.parallel} slots (tiny "
             f"model), {args.minutes:g} minutes a case, seed {args.seed}")  # fmt: skip
    lines = [table(title, runs)]
    if set(runs) == set(CLIENTS):
        lines += [f"  {line}" for line in verdicts(runs)]
    print("\n" + "\n".join(lines))
    print(f"\nuptime at the start: {started}\nuptime at the end:   {ended}")
    document = {
        "provenance": provenance, "machine": machine(), "uptime": [started, ended],
        "args": vars(args), "binary": str(binary), "calibration": asdict(calibration),
        "clients": {case: {name: [kind.name, share] for name, (kind, share) in by.items()}
                    for case, by in CLIENTS.items()},
        "sent": seen, "figures": {case: asdict(got[0]) for case, got in runs.items()},
        "report": lines,
    }  # fmt: skip
    path = RESULTS / f"fairness-{stamp}.json"
    path.write_text(json.dumps(document, indent=2, default=str))
    print(f"written: {path}")


if __name__ == "__main__":
    main()
