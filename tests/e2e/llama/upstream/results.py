"""Each upstream test's outcome, from the JSON lines `plugin.py` writes (one per test phase)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(slots=True, frozen=True)
class Outcome:
    """`passed`, `failed` (any phase failed) or `skipped`, and the first failure's message."""

    outcome: str
    message: str = ""

    @property
    def passed(self) -> bool:
        return self.outcome == "passed"


def read_outcomes(path: Path) -> dict[str, Outcome]:
    """Test id -> outcome. A test passed when its call passed and no phase failed; a failed
    phase's message (its first line) is kept."""
    outcomes: dict[str, Outcome] = {}
    if not path.is_file():
        return outcomes
    for line in path.read_text().splitlines():
        phase = json.loads(line)
        test, result = phase["id"], phase["outcome"]
        known = outcomes.get(test)
        if known is not None and known.outcome == "failed":
            continue  # the first failure says why
        if result == "failed":
            first = (phase["message"].strip().splitlines() or [""])[0]
            outcomes[test] = Outcome("failed", f"{phase['when']}: {first[:200]}")
        elif result == "skipped":
            outcomes[test] = Outcome("skipped", phase["message"][:200])
        elif phase["when"] == "call":
            outcomes[test] = Outcome("passed")
    return outcomes
