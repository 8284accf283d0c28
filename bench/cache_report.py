"""The figures of `make bench-cache` (bench/bench_cache.py): per policy, side by side, and the
issue's "done when" checks computed from them. Pure: plain records in, dicts and text out.

A policy's key is `one-host`, `random`, `least-loaded`, or `crossbar@P` for a route with
`lease_patience = P` (`crossbar@auto` for the priced patience), `crossbar@P/mM` when a run
sweeps `CROSSBAR_PREFIX_MARGIN` (M), `crossbar@P/u` with `CROSSBAR_NAME_SLOTS=false`.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from bench_gateway import percentile

__all__ = ["Answer", "Check", "done_when", "pooled", "recovery", "summarize", "tables"]

IDEAL = "one-host"
RANDOM = "random"
AUTO = "auto"
MISSING = "missing"  # a crossbar answer without X-Crossbar-Placement (no reason is named so)
SPREAD_MARGIN = 0.10  # the issue: no host above 1/N + 10% of the requests
HALF_OF_RANDOM = 0.5
CALM_OF_IDEAL = 1.05
# "The index recovers within a few requests": a conversation whose host restarted reads its
# history whole once after the restart (the cache is gone), and finds it again the turn after.
RECOVERY_TURNS = 2


@dataclass(frozen=True, slots=True)
class Answer:
    """One request of the workload, as the agent saw it (after its retries)."""

    conversation: int
    turn: int
    host: str  # who served it: X-Crossbar-Host through crossbar, else the host the bench chose
    status: int  # the last attempt's HTTP status; 0 for a transport error
    attempts: int
    ttfb_ms: float | None  # first attempt sent -> first body byte of the answer; None: failed
    prompt_n: int | None  # the final `timings`: prompt tokens the host evaluated
    cache_n: int | None  # ... and prompt tokens it took from its cache
    prompt_ms: float | None  # ... and the time it spent evaluating them
    placement: str = ""  # X-Crossbar-Placement; MISSING when crossbar sent none; direct: empty
    lease: str = ""  # X-Crossbar-Lease
    error: str = ""  # the last failed attempt's reason, if any
    after_restart: bool = False  # sent after the restarted host was back


def placement_reason(header: str) -> str:
    """`prefix 12 blocks` -> `prefix`: the reason, without what it carries, so reasons count."""
    return re.split(r"[\s;:(=,]", header.strip(), maxsplit=1)[0] if header.strip() else ""


def summarize(answers: Sequence[Answer], hosts: Sequence[str]) -> dict[str, object]:
    """A phase's figures: prompt tokens evaluated (the sum of the hosts' `prompt_n`, lower is
    better) and cached, the cache fraction cached / (cached + evaluated), the hosts' prefill
    seconds, TTFB p50/p95 (nearest rank, answered requests), each of `hosts`' share of the
    answered requests, the placement reasons counted (answers that carry one)."""
    served = [answer for answer in answers if answer.prompt_n is not None]
    evaluated = sum(answer.prompt_n or 0 for answer in served)
    cached = sum(answer.cache_n or 0 for answer in served)
    ttfbs = [answer.ttfb_ms for answer in served if answer.ttfb_ms is not None]
    counts = Counter(answer.host for answer in served)
    return {
        "requests": len(answers),
        "answered": len(served),
        "failed": len(answers) - len(served),
        "retries": sum(answer.attempts - 1 for answer in answers),
        "prompt_tokens_evaluated": evaluated,
        "prompt_tokens_cached": cached,
        "cache_fraction": cached / (cached + evaluated) if cached + evaluated else math.nan,
        "prefill_s": sum(answer.prompt_ms or 0.0 for answer in served) / 1000,
        "ttfb_p50_ms": percentile(ttfbs, 0.50),
        "ttfb_p95_ms": percentile(ttfbs, 0.95),
        "host_share": {host: counts[host] / len(served) if served else 0.0 for host in hosts},
        "placements": dict(
            Counter(placement_reason(a.placement) for a in served if a.placement).most_common()
        ),
    }


def recovery(answers: Sequence[Answer], restarted: str) -> dict[str, object]:
    """How the conversations served on `restarted` after its restart got their cache back:
    for each, the turns it took there, from its first turn after the restart, to one that
    found its previous turn's whole prompt (`cache_n` at least that turn's `prompt_n` +
    `cache_n`). `worst_turns`: the most any took; None when one never did in the phase.
    A conversation's first turn has no history to lose, and one whose last turn was its
    first there after the restart cannot show what followed: neither counts."""
    by_conversation: dict[int, dict[int, Answer]] = {}
    for answer in answers:
        if answer.prompt_n is not None:
            by_conversation.setdefault(answer.conversation, {})[answer.turn] = answer
    turns_taken: list[int | None] = []
    for turns in by_conversation.values():
        taken = 0
        for turn in sorted(turns):
            answer, before = turns[turn], turns.get(turn - 1)
            if not (answer.after_restart and answer.host == restarted) or before is None:
                continue
            taken += 1
            if (answer.cache_n or 0) >= (before.prompt_n or 0) + (before.cache_n or 0):
                break
        else:
            # A turn after its first one there and still not found whole; one that ended
            # with that first turn had no chance to show either.
            if taken > 1:
                turns_taken.append(None)
            continue
        turns_taken.append(taken)
    found = [taken for taken in turns_taken if taken is not None]
    worst = max(found, default=0) if len(found) == len(turns_taken) else None
    return {"conversations": len(turns_taken), "worst_turns": worst}


# What `pooled` gives as each round's mean rather than the rounds' sum: so that a run of several
# rounds reads as one of a single round, and compares with one.
PER_ROUND = ("prompt_tokens_evaluated", "prompt_tokens_cached", "prefill_s")


def pooled(
    rounds: Sequence[Mapping[str, object]],
    answers: Sequence[Sequence[Answer]],
    hosts: Sequence[str],
) -> dict[str, object]:
    """One policy's figures over several rounds of the same phase (`rounds`: each round's
    figures, `answers`: each round's answers, in the same order): `summarize` over every
    round's answers together (TTFB percentiles, host shares and placements of them all, the
    requests counted in all), with the prompt tokens and prefill seconds as each round's mean
    and each round's tokens in `round_tokens`. The recovery's slowest conversation is the
    slowest of every round (None if one never found its history in some round); the lost
    cache counted after the restart, the fewest any round counted of those where a
    conversation came back to the restarted host (a round where none did had no loss to
    count), its counters summed; the prefix index's hit rate, the
    rounds' mean; the restart's length, the longest."""
    count = len(rounds)
    figures = summarize([answer for some in answers for answer in some], hosts)
    for key in PER_ROUND:
        figures[key] = _number(figures, key) / max(1, count)
    figures["rounds"] = count
    figures["round_tokens"] = [round_["prompt_tokens_evaluated"] for round_ in rounds]
    restarts = [_number(r, "restart_s") for r in rounds if r.get("restart_s") is not None]
    figures["restart_s"] = max(restarts, default=None)
    figures["wall_s"] = sum(_number(r, "wall_s") for r in rounds if "wall_s" in r)
    recoveries = [_record(r, "recovery") for r in rounds if "recovery" in r]
    if recoveries and len(recoveries) == count:
        worsts = [recovered["worst_turns"] for recovered in recoveries]
        figures["recovery"] = {
            "conversations": sum(_count(recovered, "conversations") for recovered in recoveries),
            "worst_turns": None
            if None in worsts
            else max(_count(r, "worst_turns") for r in recoveries),
        }
    losses = [_record(r, "cache_lost") for r in rounds if "cache_lost" in r]
    if losses and len(losses) == count:
        figures["cache_lost"] = {
            "before_restart": _summed(_record(lost, "before_restart") for lost in losses),
            "end": _summed(_record(lost, "end") for lost in losses),
            "counted_after_restart": _fewest_counted(rounds),
        }
    if any("prefix_hit_rate" in r for r in rounds):
        rates = [
            _number(r, "prefix_hit_rate") for r in rounds if r.get("prefix_hit_rate") is not None
        ]
        figures["prefix_hit_rate"] = sum(rates) / len(rates) if rates else None
    return figures


@dataclass(frozen=True, slots=True)
class Check:
    what: str
    subject: str  # the policy judged
    figure: str  # what was measured against what
    passed: bool | None  # None: not measured (a policy it needs did not run)


def _patience(key: str) -> str:
    """`P` of `crossbar@P` or `crossbar@P/mM`."""
    return key.split("@", 1)[1].split("/", 1)[0]


def _variant(key: str) -> str:
    """What follows `P` in `crossbar@P/mM/u` (a margin swept, slots unnamed); "" for none."""
    return key.split("@", 1)[1].partition("/")[2]


# What the frontier weighs, lower better on both.
FRONTIER_COUNTS = ("ttfb_p95_ms", "prompt_tokens_evaluated")


def _no_worse(one: Mapping[str, object], other: Mapping[str, object]) -> bool:
    """`one` has no worse a TTFB p95 and no more prompt tokens than `other`."""
    return all(_number(one, count) <= _number(other, count) for count in FRONTIER_COUNTS)


def _dominates(one: Mapping[str, object], other: Mapping[str, object]) -> bool:
    """`one` is no worse than `other` on both counts, and better on at least one of them."""
    return _no_worse(one, other) and not _no_worse(other, one)


def done_when(
    main: Mapping[str, Mapping[str, object]],
    calm: Mapping[str, Mapping[str, object]],
    hosts: int,
) -> list[Check]:
    """The issue's checks, for every crossbar policy measured in `main` (the contended phase
    with the restart) and `calm` (fewer conversations than slots); `hosts`: the fleet's size.
    The frontier check is for `crossbar@auto` alone (at each margin of a sweep, named slots
    or not): its TTFB p95 at or below the fixed patience with the best p95 (the same margin
    and naming), with no more prompt tokens evaluated than that patience."""
    checks = []
    crossbars = [key for key in main if key.startswith("crossbar@")]
    for auto_key in [key for key in crossbars if _patience(key) == AUTO] or [f"crossbar@{AUTO}"]:
        fixed = [key for key in crossbars
                 if _patience(key) != AUTO and _variant(key) == _variant(auto_key)]  # fmt: skip
        if auto_key not in main or not fixed:
            checks.append(Check("on the fixed patiences' frontier", auto_key, "not measured", None))
            continue
        best = min(fixed, key=lambda key: _number(main[key], "ttfb_p95_ms"))
        auto, other = main[auto_key], main[best]
        spills = _spills(auto), _spills(other)
        # Patience acts only on a request that would wait: where neither spilled, the two
        # placed every request alike, and what parts them is the machine, not the policy.
        twins = " (neither spilled: patience decided nothing)" if spills == (0, 0) else ""
        # Beside the check, the frontier itself: a fixed patience at least as good on both
        # counts, and better on one, leaves auto behind it; none, and auto is on the frontier.
        ahead = [key for key in fixed if _dominates(main[key], auto)]
        frontier = f"; behind {', '.join(ahead)} on both" if ahead else "; on the frontier"
        checks.append(Check(
            "on the fixed patiences' frontier (TTFB p95 <= the best fixed's, tokens <= its)",
            auto_key,
            f"p95 {_ms(auto)} vs {best}'s {_ms(other)}; tokens {_tokens(auto)} vs "
            f"{_tokens(other)}; spills {spills[0]} vs {spills[1]}{twins}{frontier}",
            _no_worse(auto, other),
        ))  # fmt: skip
    limit = 1 / hosts + SPREAD_MARGIN
    for key in crossbars:
        figures = main[key]
        checks.append(_ratio(f"at most {HALF_OF_RANDOM:g}x random's prompt tokens", key,
                             figures, main.get(RANDOM), HALF_OF_RANDOM))  # fmt: skip
        checks.append(_ratio(f"calm: at most {CALM_OF_IDEAL:g}x one host's prompt tokens", key,
                             calm.get(key), calm.get(IDEAL), CALM_OF_IDEAL))  # fmt: skip
        shares = figures["host_share"]
        assert isinstance(shares, dict)
        top = max(shares.values(), default=0.0)
        spread = f"no host above 1/{hosts} + {SPREAD_MARGIN:.0%} of the requests"
        checks.append(Check(spread, key, f"busiest {top:.0%}, limit {limit:.0%}", top <= limit))
        lost = figures.get("cache_lost")
        if isinstance(lost, dict):
            counted = lost["counted_after_restart"]
            checks.append(Check("the lost cache counted after the restart", key,
                                f"crossbar_cache_lost_total +{counted}", counted > 0))  # fmt: skip
        recovered = figures.get("recovery")
        if isinstance(recovered, dict) and recovered["conversations"]:
            worst = recovered["worst_turns"]
            checks.append(Check(
                f"after the restart, every conversation there finds its history again within "
                f"{RECOVERY_TURNS} turns",
                key,
                f"{recovered['conversations']} conversations, "
                + ("one never did" if worst is None else f"the slowest in {worst}"),
                worst is not None and worst <= RECOVERY_TURNS,
            ))  # fmt: skip
        placements = figures["placements"]
        assert isinstance(placements, dict)
        unexplained = sum(n for reason, n in placements.items() if reason in (MISSING, "none"))
        checks.append(Check("every request says why (X-Crossbar-Placement)", key,
                            f"{unexplained} without a reason", unexplained == 0))  # fmt: skip
    return checks


def _ratio(
    what: str,
    key: str,
    figures: Mapping[str, object] | None,
    base: Mapping[str, object] | None,
    limit: float,
) -> Check:
    if figures is None or base is None:
        return Check(what, key, "not measured", None)
    ratio = _number(figures, "prompt_tokens_evaluated") / max(
        1.0, _number(base, "prompt_tokens_evaluated")
    )
    return Check(what, key, f"{ratio:.2f}x ({_tokens(figures)} vs {_tokens(base)})", ratio <= limit)


def _fewest_counted(rounds: Sequence[Mapping[str, object]]) -> int:
    """The fewest lost caches a round counted after its restart, of the rounds where some
    conversation came back to the restarted host with a history to find; 0 when none did."""
    counted = [
        _count(_record(r, "cache_lost"), "counted_after_restart")
        for r in rounds
        if "recovery" not in r or _count(_record(r, "recovery"), "conversations") > 0
    ]
    return min(counted, default=0)


def _spills(figures: Mapping[str, object]) -> int:
    """Requests a phase placed `spilled` (X-Crossbar-Placement)."""
    placements = _record(figures, "placements")
    return _count(placements, "spilled") if "spilled" in placements else 0


def _record(figures: Mapping[str, object], key: str) -> Mapping[str, object]:
    value = figures[key]
    assert isinstance(value, Mapping)
    return value


def _count(figures: Mapping[str, object], key: str) -> int:
    value = figures[key]
    assert isinstance(value, int)
    return value


def _summed(counters: Iterable[Mapping[str, object]]) -> dict[str, float]:
    """Per-host counters added up, host by host."""
    total: dict[str, float] = {}
    for counter in counters:
        for host in counter:
            total[host] = total.get(host, 0.0) + _number(counter, host)
    return total


def _number(figures: Mapping[str, object], key: str) -> float:
    value = figures[key]
    assert isinstance(value, (int, float))
    return float(value)


def _ms(figures: Mapping[str, object]) -> str:
    return f"{_number(figures, 'ttfb_p95_ms'):.0f} ms"


def _tokens(figures: Mapping[str, object]) -> str:
    return f"{_number(figures, 'prompt_tokens_evaluated'):,.0f}"


def tables(
    main: Mapping[str, Mapping[str, object]],
    calm: Mapping[str, Mapping[str, object]],
    checks: Sequence[Check],
) -> str:
    """The phases side by side and the checks, as Markdown tables."""
    parts = ["Contended, a host restarted halfway:", _phase_table(main)]
    if calm:
        parts += ["Calm (fewer conversations than slots, no restart):", _phase_table(calm)]
    rows = ["| check | policy | measured | |", "|---|---|---|---|"]
    verdicts = {True: "yes", False: "**no**", None: "-"}
    rows += [f"| {c.what} | {c.subject} | {c.figure} | {verdicts[c.passed]} |" for c in checks]
    return "\n\n".join([*parts, "Done when:", "\n".join(rows)])


def _phase_table(phase: Mapping[str, Mapping[str, object]]) -> str:
    base = phase.get(IDEAL)
    rows = [
        "| policy | answered (failed, retries) | prompt tokens evaluated | x one host | cache "
        "fraction | prefill s | TTFB p50 | TTFB p95 | host shares | placements | cache lost "
        "(before restart -> end) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key, figures in phase.items():
        shares = figures["host_share"]
        placements = figures["placements"]
        assert isinstance(shares, dict) and isinstance(placements, dict)
        evaluated = _number(figures, "prompt_tokens_evaluated")
        times = f"{evaluated / _number(base, 'prompt_tokens_evaluated'):.2f}x" if base else "-"
        lost = figures.get("cache_lost")
        lost_text = (
            f"{sum(lost['before_restart'].values())} -> {sum(lost['end'].values())}"
            if isinstance(lost, dict)
            else "-"
        )
        each = figures.get("round_tokens")
        rounds = f" ({' / '.join(f'{n:,}' for n in each)})" if isinstance(each, list) else ""
        rows.append(
            f"| {key} | {figures['answered']} ({figures['failed']}, {figures['retries']}) "
            f"| {evaluated:,.0f}{rounds} | {times} | {_number(figures, 'cache_fraction'):.1%} "
            f"| {_number(figures, 'prefill_s'):.1f} | {_number(figures, 'ttfb_p50_ms'):.0f} ms "
            f"| {_ms(figures)} | {' '.join(f'{h} {s:.0%}' for h, s in shares.items())} "
            f"| {' '.join(f'{reason} {n}' for reason, n in placements.items()) or '-'} "
            f"| {lost_text} |"
        )
    return "\n".join(rows)
