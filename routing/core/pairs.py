"""A (host, model) pair as the limiter counts it: its state (slots in flight, its line, its
watchers), one slot held on it (and the work its request is charged), and a snapshot of it for
metrics and the dashboard.

The limiter (routing/core/limiter.py) owns every `PairState` and changes it; a `Slot` gives its
slot back through the limiter that handed it out. One event loop, not thread-safe.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final, NamedTuple

from routing.core.fairness import Entry, Work
from routing.core.line import Line

if TYPE_CHECKING:
    from routing.core.limiter import Limiter, Waiter

__all__ = ["Pair", "PairSnapshot", "PairState", "Slot"]


class Pair(NamedTuple):
    """One model on one host: what the limiter counts slots and lines for, and what every
    table keyed by a host's model (leases, figures, named slots, the running table) is keyed
    by. A tuple, so it hashes and compares as `(host, model)` at a tuple's cost."""

    host: str
    model: str


@dataclass(slots=True, frozen=True)
class PairSnapshot:
    """The state of one (host, model) pair at one instant, for metrics and the dashboard."""

    host: str
    model: str
    parallel: int
    queue_max: int
    in_flight: int
    queued: int


@dataclass(slots=True, eq=False)
class PairState:
    """One pair's limits, count and line, changed only by the limiter."""

    host: str
    model: str
    parallel: int = 1
    queue_max: int = 0
    configured: bool = False
    in_flight: int = 0  # slots held, and those held for a watcher to decide (offered)
    line: Line = field(default_factory=Line)  # the waiters, in the order they will be granted
    watchers: list[Waiter] = field(default_factory=list)  # in the order they began to watch
    listeners: int = 0  # queued waiters that want to hear when their place changes

    @property
    def queued(self) -> int:
        """Requests waiting in the pair's line."""
        return len(self.line)

    def has_free_slot(self) -> bool:
        return self.in_flight < self.parallel

    def has_queue_room(self) -> bool:
        return self.queued < self.queue_max

    def idle(self) -> bool:
        return self.in_flight == 0 and self.queued == 0 and not self.watchers


class Slot:
    """One held slot of a (host, model) pair.

    ``release`` gives it back (to the next in line, if any); it is idempotent and safe after
    the pair was reconfigured or removed. The request's client key is charged the work done
    once: by ``charge``, or with nothing done (``Work()``) at ``release`` unless
    ``charge_later`` said the request's end will charge it.
    """

    __slots__ = ("host", "model", "_limiter", "_pair", "_entry", "_released", "_charge")

    held: Final = True  # `routing.core.state.Held`: a slot, not a place in line

    def __init__(self, limiter: Limiter, pair: PairState, entry: Entry) -> None:
        self.host = pair.host
        self.model = pair.model
        self._limiter = limiter
        self._pair = pair
        self._entry = entry  # its line's record of the request, charged once
        self._released = False
        self._charge = "at release"  # or "later", or "done"

    @property
    def released(self) -> bool:
        return self._released

    def release(self) -> None:
        """Give the slot back. A second call is a no-op."""
        if self._released:
            return
        self._released = True
        if self._charge == "at release":
            self.charge(Work())  # before the slot is handed on, so the line counts it
        self._limiter._release(self._pair, self._entry.priority)

    def charge_later(self) -> None:
        """`release` charges nothing: the request's end calls `charge` with what it did."""
        if self._charge == "at release":
            self._charge = "later"

    def charge(self, work: Work) -> None:
        """Charge the request's client key the work the host did for it (once; later calls
        do nothing). Also after `release`: work is known only when the answer has ended."""
        if self._charge == "done":
            return
        self._charge = "done"
        self._pair.line.order.charge(self._entry, work)

    def __repr__(self) -> str:
        state = "released" if self._released else "held"
        return f"<Slot {self.host}/{self.model} {state}>"
