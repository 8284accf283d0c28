"""Cache-aware placement on real llama-servers, policy against policy: `make bench-cache`.

    .venv/bin/python bench/bench_cache.py                        # everything, about 15 minutes
    .venv/bin/python bench/bench_cache.py --patience 0 2 600 auto --seed 1 --rounds 1
    .venv/bin/python bench/bench_cache.py --policies one-host crossbar --conversations 8
    .venv/bin/python bench/bench_cache.py --patience 600 auto --prefix-margins 0 1 2
    .venv/bin/python bench/bench_cache.py --hosts 2 --conversations 16 --bursts 4 \
        --task-words 60 --max-tokens 24                          # the workload before 5 Dec 2026
    .venv/bin/python bench/bench_cache.py --hosts 2 --pin --rev HEAD  # a core each; a commit
    sudo .venv/bin/python bench/bench_cache.py --cpu-cap 0.55  # each host held to 0.55 of a core

Runs three (`--hosts`) real llama-servers with `--parallel` slots each (the binary of `make
llama-server`, the tiny random model of tests/e2e/llama/tiny_model.py; `-sps 0.95`, as
docs/config.md advises for hosts behind crossbar) and sends each policy
the same agent-like workload (bench/cache_workload.py: more conversations than slots, a long
shared opening with tool definitions, growing histories, pauses between turns, bursts of new
conversations), streamed chat completions over httpx. The policies:

- `one-host`: one llama-server with all the slots (and a context and a prompt cache in
  memory as large as the fleet's; one thread, so its times are not the fleet's), asked
  directly: the cache ideal;
- `random`: the bench picks a host at random for every request, directly (what LiteLLM does);
- `least-loaded`: the bench picks the host with the fewest of its requests in flight, directly;
- `sticky` and `pinned` (only when asked for): the bench keeps each conversation on one host (a
  new one to the host with the fewest conversations), and `pinned` also names a slot for it
  there (llama-server's `id_slot`, the slot with the fewest conversations): what naming slots
  would give, measured before crossbar does it; `pinned-free` names it only while none of the
  bench's requests runs in it (crossbar's rule for a busy slot);
- `crossbar@P`: crossbar as `make run` serves it, one route over the hosts with
  `lease_patience = P` for each `--patience` (a value crossbar's config does not accept yet,
  such as `auto` before it exists, is skipped and the output says why); with
  `--prefix-margins`, `crossbar@P/mM` for each patience at each `CROSSBAR_PREFIX_MARGIN` M;
  with `--unnamed-slots`, `crossbar@P/u` too, with `CROSSBAR_NAME_SLOTS=false`; with
  `--told-similarities S`, `crossbar@P/sS`, told the hosts run at `-sps S`.

Each policy starts from cold hosts (every llama-server restarted), and halfway through its
requests (`--restart-at`) the first host is killed and started again on its port: the
direct policies avoid it while it is down (a perfect health check); every policy's agent
retries a failed request (after its Retry-After, else half a second) for up to a minute,
its TTFB counted from the first attempt. `one-host` has no restart:
it is the ideal. Then, with cold hosts again, a calm phase: `--calm-conversations` (fewer
than the slots) of the same conversations, no restart.

With `--rounds R` every policy's phases run R times, round after round (every policy, then
every policy again), and the figures and checks are of all rounds together: TTFB percentiles
and host shares over every request, prompt tokens as each round's mean (each round's in
`round_tokens`), the recovery's slowest of any round (bench/cache_report.py, `pooled`).

Recorded per request: TTFB (the first attempt sent to the first byte of the answer's body),
the host (`X-Crossbar-Host` through crossbar), `X-Crossbar-Placement`, and the final
`timings` (`prompt_n`: prompt tokens evaluated, `cache_n`: taken from cache, `prompt_ms`);
for crossbar, `crossbar_cache_lost_total` from /metrics when the restart begins and at the
end. Printed as tables with the issue's "done when" checks (bench/cache_report.py) and
written with every request (`answers`: per phase and policy, a list for each round) to
bench/results/cache-<time>.json; logs in bench/results/cache-<time>/.
Before the phases, a check that the real server reports those timings and reuses its cache
(in a slot, and from --cache-ram after its slots moved on); without a binary it exits
saying how to build one.

The parts: cache_workload.py makes the workload, cache_phase.py sends it, cache_report.py
computes the figures and checks, llama_hosts.py runs the servers; this file composes them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path

import httpx

sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # tests.e2e.llama's helpers

from bench_scale import wait_up  # noqa: E402  (bench/ is not a package)
from cache_phase import LIMITS, TIMEOUT, Phase, counters, request_body, stream  # noqa: E402
from cache_report import (  # noqa: E402
    IDEAL,
    Answer,
    done_when,
    pooled,
    recovery,
    summarize,
    tables,
)
from cache_workload import Shape, Workload, make_workload  # noqa: E402
from cpu_caps import CpuCap, CpuCapError, cpu_caps  # noqa: E402
from llama_hosts import MODEL, Host, Launch  # noqa: E402
from processes import RESULTS, crossbar, fleet_problems, machine, source_tree  # noqa: E402

from tests.e2e.llama.locate import NOT_BUILT, find_binary, vocab_path  # noqa: E402
from tests.e2e.llama.tiny_model import MissingDependency, write_tiny_model  # noqa: E402


def fleet_toml(hosts: Sequence[Host], patience: str) -> str:
    """One route `bench` over the hosts with `lease_patience = patience` (a number, or a
    string for crossbar to judge), each host's `parallel` its slots; every other setting at
    its default (`queue_max` 8: room for every conversation of the default workload)."""
    try:
        value = repr(float(patience))
    except ValueError:
        value = json.dumps(patience)
    parts = [
        f'[[hosts]]\nname = "{host.name}"\nurl = "{host.url}"\n\n  [[hosts.models]]\n'
        f'  name = "{MODEL}"\n  parallel = {host.slots}\n'
        for host in hosts
    ]
    names = ", ".join(f'"{host.name}"' for host in hosts)
    parts.append(f'[[routes]]\nname = "bench"\ndefault_model = "{MODEL}"\n'
                 f"lease_patience = {value}\nhosts = [{names}]\n")  # fmt: skip
    return "\n".join(parts)


def file_name(policy: str) -> str:
    """A policy's key as part of a file's name (`crossbar@auto/m1`: `crossbar-auto-m1`)."""
    return policy.replace("@", "-").replace("/", "-")


def crossbar_settings(policy: str) -> tuple[str, str, bool, str]:
    """`crossbar@P[/mM][/u][/sS]`: its patience P, its prefix margin M ("": the default),
    whether it names slots (`/u`: CROSSBAR_NAME_SLOTS=false) and the hosts' similarity it is
    told (`/sS`: CROSSBAR_SLOT_PROMPT_SIMILARITY=S; "": the hosts' own)."""
    patience, *options = policy.split("@", 1)[1].split("/")
    margin = next((option[1:] for option in options if option.startswith("m")), "")
    told = next((option[1:] for option in options if option.startswith("s")), "")
    return patience, margin, "u" not in options, told


def run_policy(
    policy: str,
    workload: Workload,
    hosts: Sequence[Host],
    args: argparse.Namespace,
    source: Path,
    restart: bool,
) -> tuple[dict[str, object], list[Answer]]:
    """One phase of one policy from cold hosts: its figures and its answers."""
    for host in hosts:
        host.cold()
    names = [host.name for host in hosts]
    restart_after = round(workload.requests * args.restart_at) if restart else 0
    restarted = hosts[0] if restart and restart_after else None
    if not policy.startswith("crossbar@"):
        phase = Phase(policy, workload, hosts, None, restarted, restart_after)
        answers = asyncio.run(phase.run())
        return phase_figures(phase, answers, names), answers
    patience, margin, named, told = crossbar_settings(policy)
    toml = fleet_toml(hosts, patience)
    name = f"{file_name(policy)}-{len(workload.conversations)}"
    env = {"CROSSBAR_PREFIX_MARGIN": margin} if margin else {}
    env["CROSSBAR_SLOT_PROMPT_SIMILARITY"] = told or str(args.slot_prompt_similarity)
    if not named:
        env["CROSSBAR_NAME_SLOTS"] = "false"
    with crossbar(args.work, None, source, "crossbar_serve", toml, name=name, env=env) as gateway:
        wait_up(gateway.url, len(hosts))
        chat = f"{gateway.url}/bench/v1/chat/completions"
        phase = Phase(policy, workload, hosts, chat, restarted, restart_after)
        answers = asyncio.run(phase.run())
        end = counters(chat)
    figures = phase_figures(phase, answers, names)
    lost = "crossbar_cache_lost_total"
    if phase.metrics_at_restart is not None:
        before = phase.metrics_at_restart[lost]
        figures["cache_lost"] = {
            "before_restart": before,
            "end": end[lost],
            "counted_after_restart": round(sum(end[lost].values()) - sum(before.values())),
        }
    predicted = sum(end["crossbar_prefix_predicted_blocks_total"].values())
    confirmed = sum(end["crossbar_prefix_confirmed_blocks_total"].values())
    figures["prefix_hit_rate"] = confirmed / predicted if predicted else None
    return figures, answers


def phase_figures(phase: Phase, answers: list[Answer], names: list[str]) -> dict[str, object]:
    """What every policy's phase reports: `summarize`'s figures, the restart's length, and,
    when a host was restarted, how its conversations got their cache back (`recovery`)."""
    figures = {**summarize(answers, names), "restart_s": phase.restart_seconds}
    if phase.restart is not None:
        figures["recovery"] = recovery(answers, phase.restart.name)
    return figures


def check_cache(host: Host, workload: Workload, max_tokens: int) -> dict[str, object]:
    """Does the real server report `timings.prompt_n`, `cache_n`, `prompt_ms` and reuse its
    cache? Conversation 0's first turn, its second (the first's prompt from the slot), then
    first turns of as many other conversations as the host has slots, then conversation 0's
    third (from --cache-ram, its slot having moved on). Says whether the second and the third
    found the whole prompt before them; exits when the timings lack a count or no request
    found anything cached. (With `-sps 0` a second turn goes to the least recently used slot,
    not the one holding its first: the slot cache then misses and --cache-ram catches it.)"""
    host.cold()
    conversations = workload.conversations
    if len(conversations) <= host.slots or len(conversations[0].turns) < 3:
        sys.exit("the cache check needs more conversations than a host's slots and 3 turns")

    async def ask_all() -> list[dict[str, float]]:
        sequence = [conversations[0].turns[0], conversations[0].turns[1]]
        sequence += [conversation.turns[0] for conversation in conversations[1 : host.slots + 1]]
        sequence.append(conversations[0].turns[2])
        found = []
        async with httpx.AsyncClient(timeout=TIMEOUT, limits=LIMITS, trust_env=False) as client:
            for turn in sequence:
                url = f"{host.url}/v1/chat/completions"
                outcome = await stream(client, url, request_body(turn, max_tokens))
                if outcome.timings is None:
                    sys.exit(f"llama-server did not answer the cache check: {outcome.error}")
                found.append(outcome.timings)
        return found

    timings = asyncio.run(ask_all())
    missing = [key for key in ("prompt_n", "cache_n", "prompt_ms") if key not in timings[0]]
    if missing:
        sys.exit(f"llama-server's timings lack {', '.join(missing)}: {timings[0]}")
    first, second, third = timings[0], timings[1], timings[-1]
    # Each turn's prompt begins with the whole prompt before it (the answer the bench writes
    # into the history is not what the model generated, so the match ends where it begins).
    report = {
        "first_turn": first,
        "second_turn": second,
        "third_turn_after_other_conversations": third,
        "slot_cache_works": second["cache_n"] >= first["prompt_n"] + first["cache_n"],
        "ram_cache_works": third["cache_n"] >= second["prompt_n"] + second["cache_n"],
    }
    if not any(turn["cache_n"] for turn in timings):
        sys.exit(f"llama-server took nothing from its cache in the cache check: {report}")
    return report


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def wrapper(args: argparse.Namespace, n: int, caps: Sequence[CpuCap]) -> tuple[str, ...]:
    """What host `n` (from 0) runs under: its core (`--pin`), then its CPU cap (`--cpu-cap`)."""
    pinned = ("taskset", "-c", str(sorted(os.sched_getaffinity(0))[n])) if args.pin else ()
    return (*pinned, *caps[n].wrapper) if caps else pinned


def shape_of(args: argparse.Namespace) -> Shape:
    return Shape(
        conversations=args.conversations,
        turns=args.turns,
        bursts=args.bursts,
        burst_gap=args.burst_gap,
        pause=(args.pause[0], args.pause[1]),
        instruction_words=args.instruction_words,
        tools=args.tools,
        tool_words=args.tool_words,
        task_words=args.task_words,
        result_words=(args.result_words[0], args.result_words[1]),
        max_tokens=args.max_tokens,
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--seed", type=int, default=0, help="the workload's (and the random picks') seed")
    add(
        "--rounds",
        type=int,
        default=2,
        help="every policy's phases this many times, round after round; the figures and checks "
        "are of all rounds together (TTFB percentiles over every request, tokens each round's "
        "mean): which request gets which slot depends on timing, and one round's verdict can "
        "go either way",
    )
    add("--hosts", type=int, default=3, choices=(2, 3))
    add("--parallel", type=int, default=2, help="slots per host")
    add(
        "--pin",
        action="store_true",
        help="each host on a core of its own (taskset; host n on the n-th core this process "
        "may use), as separate machines would be: a request on one host then takes no CPU "
        "from another. Needs at least as many cores as hosts",
    )
    add(
        "--cpu-cap",
        type=float,
        metavar="CORES",
        help="each host held to this share of the CPU (a cgroup's quota: bench/cpu_caps.py), "
        "as a machine of its own: with three hosts on two cores, 0.55 leaves the gateway and "
        "the bench a third of a core. Needs root",
    )
    add("--rev", help="benchmark this commit (default: the working tree, as it is when it starts)")
    add(
        "--cache-ram",
        type=int,
        default=7,
        metavar="MIB",
        help="each host's --cache-ram (one-host: the sum). llama-server's default, 8 GiB, holds "
        "some 26k tokens of a 70B model (320 KiB a token) but 32M of the tiny model (268 B): "
        "7 MiB holds what 8 GiB holds of the 70B",
    )
    add(
        "--slot-prompt-similarity",
        type=float,
        default=0.95,
        metavar="S",
        help="each host's --slot-prompt-similarity (-sps), as docs/config.md advises for hosts "
        "behind crossbar: a request goes through the host's --cache-ram unless its slot holds "
        "more than S of its prompt, so a conversation another overwrote is loaded back "
        "(llama-server's default: 0.1)",
    )
    add(
        "--llama-args",
        type=shlex.split,
        default=[],
        help="more llama-server arguments for every host, as one string (e.g. '-kvu')",
    )
    add("--conversations", type=int, default=24)
    add("--turns", type=int, default=6)
    add("--bursts", type=int, default=6, help="new conversations arrive in this many bursts")
    add("--burst-gap", type=float, default=5.0, help="seconds between bursts")
    add(
        "--pause",
        type=float,
        nargs=2,
        default=[0.5, 3.0],
        metavar=("MIN", "MAX"),
        help="seconds of an agent's tool run between turns (uniform)",
    )
    add("--instruction-words", type=int, default=400)
    add("--tools", type=int, default=8)
    add("--tool-words", type=int, default=30)
    add("--task-words", type=int, default=600)
    add("--result-words", type=int, nargs=2, default=[100, 250], metavar=("MIN", "MAX"))
    add("--max-tokens", type=int, default=96)
    add(
        "--calm-conversations",
        type=int,
        default=None,
        help="conversations of the calm phase (default: the fleet's slots - 1; 0: none)",
    )
    add(
        "--restart-at",
        type=float,
        default=0.5,
        help="restart the first host once this share of a phase's requests is done (0: never)",
    )
    add(
        "--patience",
        nargs="+",
        default=["0", "2", "600", "auto"],
        help="crossbar's lease_patience values, one policy each (a number, or `auto`)",
    )
    add(
        "--prefix-margins",
        nargs="+",
        type=int,
        metavar="M",
        help="crossbar's CROSSBAR_PREFIX_MARGIN: every patience at each (policies crossbar@P/mM); "
        "without it, the environment's or the default",
    )
    add(
        "--told-similarities",
        nargs="+",
        type=float,
        default=[],
        metavar="S",
        help="each crossbar policy also told the hosts run at S (crossbar@P/sS: "
        "CROSSBAR_SLOT_PROMPT_SIMILARITY=S; without /s, the hosts' own "
        "--slot-prompt-similarity), e.g. 0.1 to see what telling it saves",
    )
    add("--unnamed-slots", action="store_true",
        help="each crossbar policy also with CROSSBAR_NAME_SLOTS=false (crossbar@P/u): "
        "llama-server chooses every slot")  # fmt: skip
    add("--policies", nargs="+", default=["one-host", "random", "least-loaded", "crossbar"],
        choices=("one-host", "random", "least-loaded", "sticky", "pinned", "pinned-free",
                 "crossbar"))  # fmt: skip
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, not {args.rounds}")
    cores = len(os.sched_getaffinity(0))
    if args.pin and args.hosts > cores:
        parser.error(f"--pin needs a core for each of the {args.hosts} hosts; this has {cores}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    binary, vocab = find_binary(), vocab_path()
    if binary is None or vocab is None:
        sys.exit(f"bench-cache: {NOT_BUILT}")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    args.work = RESULTS / f"cache-{stamp}"
    args.work.mkdir(parents=True, exist_ok=True)
    try:
        model = write_tiny_model(args.work / "tiny.gguf", vocab)
    except MissingDependency as exc:
        sys.exit(f"bench-cache: {exc}")
    source, provenance = source_tree(args.work, args.rev)
    shape = shape_of(args)
    workload = make_workload(shape, args.seed)
    slots = args.hosts * args.parallel
    calm_count = slots - 1 if args.calm_conversations is None else args.calm_conversations
    calm = None
    if calm_count:
        calm = make_workload(replace(shape, conversations=calm_count, bursts=1), args.seed)
    started = uptime()
    print(f"bench-cache: {provenance}; {binary}; {started}", flush=True)
    print(
        f"  {workload.requests} requests of {len(workload.conversations)} conversations on "
        f"{args.hosts} hosts x {args.parallel} slots; calm: {calm_count}",
        flush=True,
    )

    similarity = ("--slot-prompt-similarity", f"{args.slot_prompt_similarity:g}")
    launch = Launch(binary, model, args.work, (*similarity, *args.llama_args))
    try:
        capped = [f"h{n + 1}" for n in range(args.hosts)] if args.cpu_cap else []
        caps = cpu_caps(capped, args.cpu_cap or 0.0)
    except CpuCapError as exc:
        sys.exit(f"bench-cache: {exc}")
    fleet = [Host(f"h{n + 1}", args.parallel, 1, args.cache_ram, launch, wrapper(args, n, caps))
             for n in range(args.hosts)]  # fmt: skip
    # One thread, as each host has: with two, on this busy 2-core machine, its prompts took 4x
    # as long a token as the fleet's (a trial run, 2 Dec 2026). Its times are then one core's
    # against the fleet's: compare its tokens.
    # Neither pinned nor capped with the fleet: only its tokens are compared.
    ideal = Host("one", slots, 1, args.cache_ram * args.hosts, launch)
    policies = [p for p in args.policies if p != "crossbar"]
    if "crossbar" in args.policies:
        margins = [f"/m{margin}" for margin in args.prefix_margins or ()]
        namings = ["", "/u"] if args.unnamed_slots else [""]
        namings += [f"/s{told:g}" for told in args.told_similarities]
        policies += [f"crossbar@{patience}{margin}{naming}"
                     for margin in margins or [""] for naming in namings
                     for patience in args.patience]  # fmt: skip
    skipped: dict[str, str] = {}
    # Each policy's figures and answers, round after round: [phase][policy] -> one per round.
    per_round: dict[str, dict[str, list[dict[str, object]]]] = {"main": {}, "calm": {}}
    answered: dict[str, dict[str, list[list[Answer]]]] = {"main": {}, "calm": {}}
    try:
        preflight = check_cache(fleet[0], workload, args.max_tokens)
        print(f"  cache check: {json.dumps(preflight)}", flush=True)
        for policy in [p for p in policies if p.startswith("crossbar@")]:
            toml = fleet_toml(fleet, crossbar_settings(policy)[0])
            problem = fleet_problems(args.work, source, toml, file_name(policy))
            if problem:
                skipped[policy] = problem.splitlines()[-1].strip()
                print(f"  {policy}: skipped, crossbar refuses its config: {problem}")
        # Round after round of every policy, rather than each policy's rounds together, so
        # that what changes on the machine over the run falls on every policy alike.
        for round_ in range(args.rounds):
            for policy in [p for p in policies if p not in skipped]:
                hosts = [ideal] if policy == IDEAL else fleet
                for phase, load in (("main", workload), ("calm", calm)):
                    if load is None:
                        continue
                    began = time.monotonic()
                    restart = phase == "main" and policy != IDEAL
                    figures, got = run_policy(policy, load, hosts, args, source, restart)
                    figures["wall_s"] = time.monotonic() - began
                    per_round[phase].setdefault(policy, []).append(figures)
                    answered[phase].setdefault(policy, []).append(got)
                    print(f"  round {round_ + 1} {phase} {policy}: {json.dumps(figures)}",
                          flush=True)  # fmt: skip
                if policy == IDEAL:
                    ideal.stop()
    finally:
        for host in [*fleet, ideal]:
            host.stop()
        for cap in caps:
            cap.remove()
    names = {policy: [host.name for host in ([ideal] if policy == IDEAL else fleet)]
             for policy in policies}  # fmt: skip
    results = {
        phase: {
            policy: rounds[0] if len(rounds) == 1
            else pooled(rounds, answered[phase][policy], names[policy])
            for policy, rounds in by_policy.items()
        }
        for phase, by_policy in per_round.items()
    }  # fmt: skip
    answers = {
        phase: {policy: [[asdict(answer) for answer in some] for some in rounds]
                for policy, rounds in by_policy.items()}
        for phase, by_policy in answered.items()
    }  # fmt: skip
    checks = done_when(results["main"], results["calm"], args.hosts)
    ended = uptime()
    print()
    print(tables(results["main"], results["calm"], checks))
    for policy, reason in skipped.items():
        print(f"\nskipped {policy}: {reason}")
    print(f"\nuptime at the start: {started}\nuptime at the end:   {ended}")
    document = {
        "provenance": provenance, "machine": machine(), "uptime": [started, ended],
        "args": {k: v for k, v in vars(args).items() if k != "work"}, "binary": str(binary),
        "preflight": preflight, "skipped": skipped, **results,
        "checks": [asdict(check) for check in checks], "answers": answers,
    }  # fmt: skip
    path = RESULTS / f"cache-{stamp}.json"
    path.write_text(json.dumps(document, indent=2, default=str))
    print(f"written: {path}")


if __name__ == "__main__":
    main()
