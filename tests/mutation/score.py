"""The mutation score of each module, from `mutmut results --all true` on standard input.

`make mutants` pipes mutmut's list of every mutant and its status (one `name: status` a line)
through this and names the modules it ran: for each, killed / total, and the mutants that
were not killed, so a survivor can be looked at with `mutmut show <name>`. A mutant is killed
when a test failed on it; a timeout counts as killed too (the tests did not pass), and is
shown apart.
"""

from __future__ import annotations

import sys
from collections import Counter, defaultdict
from collections.abc import Iterable

KILLED = ("killed", "timeout")


def parse(lines: Iterable[str]) -> dict[str, dict[str, str]]:
    """{module: {mutant: status}} from mutmut's `name: status` lines."""
    by_module: dict[str, dict[str, str]] = defaultdict(dict)
    for line in lines:
        name, sep, status = line.strip().rpartition(": ")
        if not sep or "__mutmut_" not in name:
            continue
        module = name.rpartition(".")[0]  # the function part (xǁClassǁmethod__mutmut_3) has no dot
        by_module[module][name] = status
    return by_module


def report(by_module: dict[str, dict[str, str]], modules: list[str]) -> str:
    """A table of the named modules (every module when none is named), then the survivors."""
    modules = modules or sorted(by_module)
    rows = [f"{'module':<28} {'killed':>7} {'timeout':>7} {'total':>6} {'score':>6}  not killed"]
    survivors: list[str] = []
    for module in modules:
        statuses = by_module.get(module, {})
        counts = Counter(statuses.values())
        killed = sum(counts[status] for status in KILLED)
        total = len(statuses)
        score = f"{100 * killed / total:.0f}%" if total else "-"
        missed = ", ".join(
            f"{n} {status}" for status, n in sorted(counts.items()) if status not in KILLED
        )
        rows.append(
            f"{module:<28} {killed:>7} {counts['timeout']:>7} {total:>6} {score:>6}  {missed}"
        )
        survivors += [f"  {name}: {status}" for name, status in statuses.items()
                      if status not in KILLED]  # fmt: skip
    if survivors:
        rows += ["", "not killed (`.venv/bin/mutmut show <name>` shows the mutation):", *survivors]
    return "\n".join(rows)


if __name__ == "__main__":
    print(report(parse(sys.stdin), sys.argv[1:]))
