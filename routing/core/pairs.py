"""A (host, model) pair as the limiter counts it: its state (slots in flight, its line, its
watchers), one slot held on it, and a snapshot of it for metrics and the dashboard.

The limiter (routing/core/limiter.py) owns every `PairState` and changes it; a `Slot` gives its
slot back through the limiter that handed it out. One event loop, not thread-safe.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final, NamedTuple

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
    queued: int = 0  # live waiters in `queue`
    # Waiters in arrival order. A waiter that left (granted elsewhere, cancelled) stays until it
    # reaches the head or the line is compacted; `queued` counts only the live ones.
    queue: deque[Waiter] = field(default_factory=deque)
    watchers: list[Waiter] = field(default_factory=list)  # in the order they began to watch
    listeners: int = 0  # queued waiters that want to hear when their place changes

    def has_free_slot(self) -> bool:
        return self.in_flight < self.parallel

    def has_queue_room(self) -> bool:
        return self.queued < self.queue_max

    def idle(self) -> bool:
        return self.in_flight == 0 and self.queued == 0 and not self.watchers


class Slot:
    """One held slot of a (host, model) pair.

    ``release`` gives it back (to the head waiter, if any); it is idempotent and safe after
    the pair was reconfigured or removed.
    """

    __slots__ = ("host", "model", "_limiter", "_pair", "_released")

    held: Final = True  # `routing.core.state.Held`: a slot, not a place in line

    def __init__(self, limiter: Limiter, pair: PairState) -> None:
        self.host = pair.host
        self.model = pair.model
        self._limiter = limiter
        self._pair = pair
        self._released = False

    @property
    def released(self) -> bool:
        return self._released

    def release(self) -> None:
        """Give the slot back. A second call is a no-op."""
        if self._released:
            return
        self._released = True
        self._limiter._release(self._pair)

    def __repr__(self) -> str:
        state = "released" if self._released else "held"
        return f"<Slot {self.host}/{self.model} {state}>"
