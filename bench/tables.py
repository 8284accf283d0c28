"""The tables bench_gateway.py prints: per target, side by side, and against the issue's targets."""

from __future__ import annotations

import math
from collections.abc import Callable

from targets import WORKERS, Target, reference_floor

LOADGEN_BUSY = 0.8  # of one core: above this, the load generator may be what limits
SATURATED = (128, 512)  # concurrencies at which one process is saturated (bench/README.md)
# The code before the request path's rewrite: the "today". Its saturated chunks/s swing
# by 2x with the load of this shared machine (4,000-11,000 on 1 Dec 2026, bench/README.md), so
# a fixed figure would judge the machine: the target is judged only against a `crossbar#REV`
# target measured in the same run.
TODAY_COMMIT = "59c3c43"


def phase(report: dict, concurrency: int) -> dict:
    """The report's phase at `concurrency`. Raises KeyError when the run left it out."""
    found = next((p for p in report["phases"] if p["concurrency"] == concurrency), None)
    if found is None:
        raise KeyError(concurrency)
    return found


def saturated(report: dict) -> tuple[float, int]:
    """The best chunks/s of the saturated phases, and its concurrency."""
    best = max((p for p in report["phases"] if p["concurrency"] in SATURATED),
               key=lambda p: p["chunks_per_s"])  # fmt: skip
    return best["chunks_per_s"], best["concurrency"]


def print_table(name: str, report: dict, token_delay: float) -> None:
    print(f"\n{name} (64-chunk streams, {token_delay * 1000:g} ms between upstream tokens)")
    print(
        f"{'conc':>5} {'reqs':>5} {'+TTFB p50':>10} {'+TTFB p99':>10} {'+total p50':>11}"
        f" {'chunks/s':>9} {'direct':>7} {'CPU/req':>9} {'CPU/chunk':>10} {'RSS':>7}"
        f" {'errors':>6} {'loadgen':>8}"
    )
    for p in report["phases"]:
        print(
            f"{p['concurrency']:>5} {p['requests']:>5} {p['added_ttfb_p50_ms']:>7.2f} ms"
            f" {p['added_ttfb_p99_ms']:>7.2f} ms {p['added_total_p50_ms']:>8.1f} ms"
            f" {p['chunks_per_s']:>9,.0f} {p['direct']['chunks_per_s']:>7,.0f}"
            f" {p['cpu_ms_per_request']:>6.2f} ms {p['cpu_us_per_chunk']:>7.1f} µs"
            f" {p['rss_peak_mb']:>4.0f} MB {p['errors']:>6} {p['loadgen_core']:>7.0%}"
        )
    print(
        f"{'':>5} {'':>5} {'TTFB p50':>10} {'TTFB p99':>10} {'total p50':>11}"
        f" {'busy':>5}   direct upstream, then through {name}, ms; busy: cores in use"
    )
    for p in report["phases"]:
        d = p["direct"]
        print(
            f"{p['concurrency']:>5} {d['requests']:>5} {d['ttfb_p50_ms']:>10.2f}"
            f" {d['ttfb_p99_ms']:>10.2f} {d['total_p50_ms']:>11.1f}"
            f" {d['machine_busy_cores']:>5.2f}   direct"
        )
        print(
            f"{'':>5} {p['requests']:>5} {p['ttfb_p50_ms']:>10.2f} {p['ttfb_p99_ms']:>10.2f}"
            f" {p['total_p50_ms']:>11.1f} {p['machine_busy_cores']:>5.2f}   {name}"
            f" (CPU: event loop {p['thread_cpu_s']['main']:.2f} s,"
            f" other threads {p['thread_cpu_s']['other']:.2f} s; {p['threads_peak']} threads)"
        )
    for p in report["phases"]:
        if "cpu_s_by_process" in p:
            shares = " + ".join(f"{cpu:.2f}" for cpu in p["cpu_s_by_process"].values())
            changed = ""
            if p["processes_gone"] or p["processes_new"]:
                changed = (f"; {p['processes_gone']} processes ended and {p['processes_new']}"
                           " started meanwhile: their CPU is not counted")  # fmt: skip
            print(f"{p['concurrency']:>5} CPU by process, the supervisor first: {shares} s"
                  f" ({p['processes']} processes{changed})")  # fmt: skip
    for p in report["phases"]:
        if p["error_kinds"] or p["warmup_errors"]:
            print(f"  errors at concurrency {p['concurrency']}: {p['error_kinds']}", end="")
            print(f" (+{p['warmup_errors']} in warm-up)")
        if p["loadgen_core"] > LOADGEN_BUSY:
            print(f"  at concurrency {p['concurrency']} the load generator was busy: its figures")
            print("  are a lower bound of what the target could do")
        if p["direct"]["loadgen_core"] > LOADGEN_BUSY:
            print(
                f"  at concurrency {p['concurrency']} the direct run kept the load generator busy"
                f" ({p['direct']['loadgen_core']:.0%} of a core): its latencies are high,"
                " and what the target adds is understated"
            )
    if "split" in report:
        split = report["split"]
        print(
            f"split at concurrency {split['concurrency']}: {split['cpu_ms_per_request']:.2f} ms"
            f" per request + {split['cpu_us_per_chunk']:.1f} µs per chunk (a 1-token request:"
            f" {split['one_token_cpu_ms_per_request']:.2f} ms)"
        )
    print(f"idle: {report['idle_cpu_ms_per_s']:.1f} ms of CPU per second")
    if "redis_end" in report:
        print_redis(report)


def _megabytes(state: dict) -> str:
    return f"{state['used_memory'] / 1024**2:.2f} MB"


def print_redis(report: dict) -> None:
    """What the target's own Redis did per request in each phase, and what it holds."""
    print(
        "Redis, per measured request: round trips (requests Redis read, INFO stats), scripts"
        " (EVALSHA), commands (INFO commandstats: the scripts' own included)"
    )
    print(f"{'conc':>5} {'trips':>7} {'scripts':>8} {'commands':>9}   most run, per request")
    rows = [(p["concurrency"], p["redis"], p["requests"]) for p in report["phases"]]
    if "one_token_redis" in report.get("split", {}):
        rows.append(("1-tok", report["split"]["one_token_redis"], 0))
    for concurrency, redis, requests in rows:
        n = requests or redis["commands"] / redis["commands_per_request"]
        top = list(redis["by_command"].items())[:5]
        most = ", ".join(f"{name} {count / n:.2f}" for name, count in top)
        print(
            f"{concurrency:>5} {redis['round_trips_per_request']:>7.2f}"
            f" {redis['scripts_per_request']:>8.2f} {redis['commands_per_request']:>9.2f}   {most}"
        )
    after, end = report["redis_after_warmup"], report["redis_end"]
    kinds = ", ".join(f"{kind} {count}" for kind, count in end["key_kinds"].items())
    print(
        f"Redis used_memory {_megabytes(after)} after the warm-up, {_megabytes(end)} at the end"
        f" (peak {end['used_memory_peak'] / 1024**2:.2f} MB); keys {after['keys']} then"
        f" {end['keys']}: {kinds or 'none'}"
    )


# A row of the side-by-side table: label, unit, the value in a report, the value direct (None
# when direct has none: CPU, which only a process in the middle spends), and whether its ratio
# to the floor means something (the floor's own idle CPU or RSS do not bound crossbar's).
Row = tuple[str, str, Callable[[dict], float], Callable[[dict], float] | None, bool]


def chunks_per_cpu_second(report: dict) -> float:
    """At 512, where every process of the target is saturated: 1 / CPU per chunk."""
    return 1e6 / phase(report, 512)["cpu_us_per_chunk"]


def _phase_value(concurrency: int, key: str) -> Callable[[dict], float]:
    return lambda report: phase(report, concurrency)[key]


def _direct_value(concurrency: int, key: str) -> Callable[[dict], float]:
    return lambda report: phase(report, concurrency)["direct"][key]


ROWS: tuple[Row, ...] = (
    ("CPU per streamed request at 8", "ms", _phase_value(8, "cpu_ms_per_request"), None, True),
    ("CPU per streamed request at 32", "ms", _phase_value(32, "cpu_ms_per_request"), None, True),
    ("CPU per request, fixed (split at 8)", "ms",
     lambda r: r["split"]["cpu_ms_per_request"], None, True),
    ("CPU per chunk, marginal (split at 8)", "µs",
     lambda r: r["split"]["cpu_us_per_chunk"], None, True),
    ("CPU per chunk, all in, at 32", "µs", _phase_value(32, "cpu_us_per_chunk"), None, True),
    ("+TTFB p50 at 8", "ms", _phase_value(8, "added_ttfb_p50_ms"), None, True),
    ("+TTFB p99 at 32", "ms", _phase_value(32, "added_ttfb_p99_ms"), None, True),
    ("TTFB p50 at 8", "ms", _phase_value(8, "ttfb_p50_ms"), _direct_value(8, "ttfb_p50_ms"),
     True),
    ("TTFB p99 at 32", "ms", _phase_value(32, "ttfb_p99_ms"), _direct_value(32, "ttfb_p99_ms"),
     True),
    ("saturated chunks/s (best of 128, 512)", "", lambda r: saturated(r)[0],
     lambda r: max(phase(r, c)["direct"]["chunks_per_s"] for c in SATURATED), True),
    ("chunks per CPU-second at 512", "", lambda r: chunks_per_cpu_second(r), None, True),
    ("RSS at 512", "MB", _phase_value(512, "rss_peak_mb"), None, False),
    ("idle CPU", "ms/s", lambda r: r["idle_cpu_ms_per_s"], None, False),
    ("errors, all phases", "", lambda r: sum(p["errors"] for p in r["phases"]), None, False),
    ("processes", "", lambda r: r["target"]["processes"], None, False),
    ("Redis round trips per request at 8", "",
     lambda r: phase(r, 8)["redis"]["round_trips_per_request"], None, False),
    ("Redis round trips per request at 512", "",
     lambda r: phase(r, 512)["redis"]["round_trips_per_request"], None, False),
    ("Redis commands per request at 8", "",
     lambda r: phase(r, 8)["redis"]["commands_per_request"], None, False),
    ("Redis used_memory at the end", "MB",
     lambda r: r["redis_end"]["used_memory"] / 1024**2, None, False),
    ("Redis keys after the warm-up", "", lambda r: r["redis_after_warmup"]["keys"], None, False),
    ("Redis keys at the end", "", lambda r: r["redis_end"]["keys"], None, False),
)  # fmt: skip


def number(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "-"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:.1f}" if abs(value) >= 10 else f"{value:.2f}"


def ratio(value: float, base: float) -> str:
    if math.isnan(value) or math.isnan(base) or base <= 0 or value < 0:
        return "-"
    return f"{value / base:.2f}x"


def _value(value: Callable[[dict], float], report: dict) -> float:
    try:
        return value(report)
    except (KeyError, StopIteration, ValueError):
        return float("nan")  # e.g. LiteLLM has no split


def print_side_by_side(targets: list[Target], reports: dict[str, dict]) -> None:
    width = max(12, *(len(t.label) + 2 for t in targets))
    labels = [t.label for t in targets]
    print("\nside by side, same run (ms, µs, MB; CPU and RSS: all of a target's processes)")
    print(f"{'':<40}{'direct':>{width}}" + "".join(f"{name:>{width}}" for name in labels))
    first = reports[labels[0]]
    for label, unit, value, direct, _ in ROWS:
        cells = [number(_value(direct, first)) if direct else ""]
        cells += [number(_value(value, reports[name])) for name in labels]
        name = f"{label}, {unit}" if unit else label
        print(f"{name:<40}" + "".join(f"{cell:>{width}}" for cell in cells))
    for target in targets:
        floor = reference_floor(target, targets)
        if floor is target or (target.kind == "floor" and floor is None):
            continue  # a floor is its own reference; ratios to direct alone say little of it
        report = reports[target.label]
        print(
            f"\n{target.label}: ratios to " + (f"{floor.label} and to " if floor else "") + "direct"
        )
        for label, _, value, direct, to_floor in ROWS:
            parts = []
            if floor is not None and to_floor:
                parts.append(f"{ratio(_value(value, report), _value(value, reports[floor.label]))}"
                             f" the floor's")  # fmt: skip
            if direct is not None:
                parts.append(f"{ratio(_value(value, report), _value(direct, report))} direct's")
            if parts:
                print(f"  {label:<38}{'; '.join(parts)}")
    print_workers(targets, reports)


def single_process_peers(target: Target, targets: list[Target]) -> list[Target]:
    """The run's targets that are `target` in one process: the same code, server and levers
    but the workers lever (with `+redis` first: the same shared state, one process)."""
    rest = {lever for lever in target.levers if lever not in WORKERS and lever != "redis"}
    peers = [
        other for other in targets
        if other.kind == target.kind and other.rev == target.rev
        and other.server == target.server and other.workers == 1
        and {lever for lever in other.levers if lever != "redis"} == rest
    ]  # fmt: skip
    return sorted(peers, key=lambda other: not other.has_redis)


def print_workers(targets: list[Target], reports: dict[str, dict]) -> None:
    """For each target of several workers: its chunks/s at the run's highest concurrency (the
    saturated ones when the run has them) and its CPU per streamed request, against the same
    in one process, same run."""
    for target in targets:
        if target.workers == 1:
            continue
        report = reports[target.label]
        print(f"\n{target.label}: {target.workers} workers against one process, same run")
        for peer in single_process_peers(target, targets):
            theirs = reports[peer.label]
            if _has(report, 512) and _has(theirs, 512):
                chunks, at = saturated(report)
                their_chunks, their_at = saturated(theirs)
                per_cpu = ratio(_value(chunks_per_cpu_second, report),
                                _value(chunks_per_cpu_second, theirs))  # fmt: skip
                print(f"  saturated chunks/s {chunks:,.0f} (at {at}) against {peer.label}'s"
                      f" {their_chunks:,.0f} (at {their_at}): {ratio(chunks, their_chunks)};"
                      f" chunks per CPU-second at 512 {per_cpu}")  # fmt: skip
            for concurrency in (8, 32):
                if _has(report, concurrency) and _has(theirs, concurrency):
                    mine = phase(report, concurrency)
                    other = phase(theirs, concurrency)
                    print(f"  at {concurrency}: CPU per streamed request"
                          f" {mine['cpu_ms_per_request']:.2f} ms against {peer.label}'s"
                          f" {other['cpu_ms_per_request']:.2f}"
                          f" ({ratio(mine['cpu_ms_per_request'], other['cpu_ms_per_request'])});"
                          f" chunks/s {mine['chunks_per_s']:,.0f} against"
                          f" {other['chunks_per_s']:,.0f}")  # fmt: skip


def _has(report: dict, concurrency: int) -> bool:
    return any(p["concurrency"] == concurrency for p in report["phases"])


def print_targets(targets: list[Target], reports: dict[str, dict]) -> None:
    """Issue 22's targets (and the earlier issue's saturated ones, when the run has 512), for
    every crossbar target of the run, each against its floor (same server, same client)."""
    litellm = next((reports[t.label] for t in targets if t.kind == "litellm"), None)
    for target in targets:
        if not target.is_gateway:
            continue
        report = reports[target.label]
        floor_target = reference_floor(target, targets)
        floor = reports[floor_target.label] if floor_target else None
        print(
            f"\ntargets for {target.label}"
            + (f" (floor: {floor_target.label})" if floor_target and floor else "")
        )
        for concurrency in (8, 32):
            if not _has(report, concurrency):
                continue
            mine = phase(report, concurrency)["cpu_ms_per_request"]
            label = f"CPU per streamed request at {concurrency}"
            if floor:
                base = phase(floor, concurrency)["cpu_ms_per_request"]
                _verdict(f"{label} ≤ 1.3x the floor's", mine / base, "≤", 1.3,
                         f"{mine:.2f} ms against {base:.2f}: {mine / base:.2f}x")  # fmt: skip
            if litellm and _has(litellm, concurrency):
                other = phase(litellm, concurrency)["cpu_ms_per_request"]
                _verdict(f"{label} ≤ 1/20 of LiteLLM's", other / mine, "≥", 20.0,
                         f"LiteLLM's is {other / mine:.1f}x ({other:.1f} ms)")  # fmt: skip
        if floor and _has(report, 8):
            mine = phase(report, 8)["added_ttfb_p50_ms"]
            base = phase(floor, 8)["added_ttfb_p50_ms"]
            _verdict("added TTFB p50 at 8 ≤ the floor's + 2 ms", mine - base, "≤", 2.0,
                     f"{mine:.2f} ms against {base:.2f}: +{mine - base:.2f}")  # fmt: skip
        if floor and _has(report, 32):
            mine = phase(report, 32)["added_ttfb_p50_ms"]
            base = phase(floor, 32)["added_ttfb_p50_ms"]
            _verdict("added TTFB p50 at 32 ≤ 2x the floor's", mine / base if base > 0 else math.inf,
                     "≤", 2.0, f"{mine:.1f} ms against {base:.1f}: {mine / base:.2f}x")  # fmt: skip
            mine = phase(report, 32)["added_ttfb_p99_ms"]
            base = phase(floor, 32)["added_ttfb_p99_ms"]
            _verdict("added TTFB p99 at 32 ≤ 2x the floor's", mine / base if base > 0 else math.inf,
                     "≤", 2.0, f"{mine:.1f} ms against {base:.1f}")  # fmt: skip
        if _has(report, 512):
            _print_saturated(target, targets, reports, floor)


def _print_saturated(
    target: Target, targets: list[Target], reports: dict[str, dict], floor: dict | None
) -> None:
    """The earlier issue's targets at 128 and 512: chunks/s against `crossbar#REV`, errors,
    RSS."""
    report = reports[target.label]
    chunks, at = saturated(report)
    baseline = _baseline(target, targets)
    if target.rev:
        pass  # the baseline itself
    elif baseline is None:
        label = "saturated chunks/s ≥ 2.5x today's"
        print(f"  {label:<50} {chunks:,.0f} at {at};"
              f" add crossbar#{TODAY_COMMIT} to --targets to judge it")  # fmt: skip
    else:
        before = saturated(reports[baseline.label])[0]
        shown = f"{chunks:,.0f} at {at} against {before:,.0f}: {chunks / before:.2f}x"
        _verdict(f"saturated chunks/s ≥ 2.5x {baseline.label}'s", chunks / before, "≥", 2.5,
                 shown)  # fmt: skip
        # The same, as the machine's load does not move it: chunks per second of CPU.
        mine = 1e6 / phase(report, 512)["cpu_us_per_chunk"]
        theirs = 1e6 / phase(reports[baseline.label], 512)["cpu_us_per_chunk"]
        _verdict("  ... per CPU-second at 512", mine / theirs, "≥", 2.5,
                 f"{mine:,.0f} against {theirs:,.0f}: {mine / theirs:.2f}x")  # fmt: skip
        if floor:
            ceiling, _ = saturated(floor)
            print(f"  {'':<50} (the floor's: {ceiling:,.0f}, {ceiling / before:.2f}x)")
    errors = phase(report, 512)["errors"]
    _verdict("errors at 512 = 0", errors, "≤", 0, str(errors))
    rss = phase(report, 512)["rss_peak_mb"]
    _verdict("RSS at 512 < 300 MB", rss, "≤", 300, f"{rss:.0f} MB")


def _baseline(target: Target, targets: list[Target]) -> Target | None:
    """The run's `crossbar#REV` without levers, on the same server if there is one: "today"
    as it runs today, so that a lever of another server is judged against it too."""
    candidates = [t for t in targets if t.kind == "crossbar" and t.rev and not t.levers]
    same = [t for t in candidates if t.server == target.server]
    pool = same or candidates
    return pool[0] if pool else None


def _verdict(label: str, value: float, sense: str, limit: float, shown: str) -> None:
    """One target: `value` (a ratio or a figure) against `limit`, `sense` being ≤ or ≥."""
    if sense == "≤":
        met = value <= limit
        how = "met" if met else f"{value / limit:.1f}x the limit" if limit else "missed"
    else:
        met = value >= limit
        how = "met" if met else f"{limit / value:.1f}x short" if value > 0 else "missed"
    print(f"  {label:<50} {shown:<40} {how}")
