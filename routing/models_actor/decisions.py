"""What the model actor did, for the operator: the last decisions (each Load, Unload and
Unplaced with its reason, when, where), the loads counted by reason, and the loads' seconds
as a histogram, which `routing.ops` shows (the dashboard's log, `/metrics`). Every decision is
also logged at INFO on `crossbar.models`.

Not thread-safe: the actor writes it on its loop; readers on the same loop.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from dataclasses import dataclass

from routing.core.model_placement import Action, Load, Unload

log = logging.getLogger("crossbar.models")

# The histogram's upper bounds (seconds): a small GGUF from a warm page cache loads in under a
# second, a large one from a cold disk in minutes.
LOAD_BUCKETS = (0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)
KEPT = 200  # decisions kept in memory


@dataclass(frozen=True, slots=True)
class Decided:
    """One decision: `at` in wall-clock seconds (for people); `kind` load, unload or unplaced;
    `host` empty for unplaced."""

    at: float
    kind: str
    host: str
    model: str
    reason: str

    def line(self) -> str:
        where = f" host={self.host}" if self.host else ""
        return f"model {self.kind}:{where} model={self.model} reason={self.reason}"


def reason_kind(reason: str) -> str:
    """A load's reason as a bounded label: demand, pinned, min_loaded (decide's words)."""
    return reason.split(":")[0].split()[0] if reason else "other"


class Decisions:
    """The last `KEPT` decisions, the loads by (host, model, reason kind), the loads' seconds,
    and the last decision of each kind per (host, model) (`last`, by (kind, host, model);
    host "" for unplaced): the fleet map reads why a model is where it is from it, however
    long ago the load was. Bounded by the configuration's pairs."""

    def __init__(self) -> None:
        self.recent: deque[Decided] = deque(maxlen=KEPT)
        self.last: dict[tuple[str, str, str], Decided] = {}
        self.loads: Counter[tuple[str, str, str]] = Counter()
        self.load_buckets = [0] * len(LOAD_BUCKETS)  # cumulative counts, as Prometheus has them
        self.load_count = 0
        self.load_sum = 0.0

    def decided(self, action: Action) -> Decided:
        if isinstance(action, Load | Unload):
            kind = "load" if isinstance(action, Load) else "unload"
            decided = Decided(time.time(), kind, action.host, action.model, action.reason)
        else:
            decided = Decided(time.time(), "unplaced", "", action.model, action.reason)
        if isinstance(action, Load):
            self.loads[action.host, action.model, reason_kind(action.reason)] += 1
        self._keep(decided)
        log.info(decided.line())
        return decided

    def said(self, kind: str, host: str, model: str, reason: str) -> None:
        """An outcome worth the log beside the decisions: a load ended or failed."""
        decided = Decided(time.time(), kind, host, model, reason)
        self._keep(decided)
        log.log(logging.WARNING if kind == "failed" else logging.INFO, decided.line())

    def _keep(self, decided: Decided) -> None:
        self.recent.append(decided)
        self.last[decided.kind, decided.host, decided.model] = decided

    def load_took(self, seconds: float) -> None:
        self.load_count += 1
        self.load_sum += seconds
        for i, bound in enumerate(LOAD_BUCKETS):
            if seconds <= bound:
                self.load_buckets[i] += 1
