"""What placement hands out: where a request runs (`Placement`), or where it waits (`Waiting`),
and why (`Reason`). Values only; `routing.core.placement` makes them.

A request's place has one shape per step, each told apart by its type or its tag, never by
probing for an attribute: the fleet state hands a slot (`Held`) or a place in a line
(`InLine`), told apart by their `held` tag (routing/core/state.py); a conversation's opening
(`Opened`, routing/core/opening.py) is what its first place took and the lease it found;
placement makes of either a `Placement` or a `Waiting`, and a `Waiting` becomes a `Placement`
once its slot comes; the host's head on a placement is the lifecycle's `Answered`
(routing/proxy/lifecycle.py)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from routing.core.leases import LeaseOutcome
from routing.core.patience import Priced
from routing.core.state import Held, InLine


class Reason(StrEnum):
    """Why a request went where it did: the `X-Crossbar-Placement` header and the row."""

    HOME = "home"  # the conversation's lease host
    NEW = "new"  # a new conversation: the best-ranked host with room
    PREFIX = "prefix"  # a host holding more of the prompt's opening (routing.core.affinity)
    SPILLED = "spilled"  # patience spent (or priced cheaper elsewhere), or home's queue full
    MOVED = "moved"  # home down or draining
    FALLBACK = "fallback"  # the route's fallback route
    NONE = "none"  # no conversation (no fingerprint)


@dataclass(slots=True, frozen=True)
class Placement:
    """Where a request runs: the held slot, and what led there."""

    slot: Held
    reason: Reason
    lease: LeaseOutcome
    route: str  # the route that serves: the fallback's name when one was taken
    model: str  # the model asked of that route
    waited: float  # seconds from arrival to the slot
    fallback: str = ""  # the fallback route's name, when one was taken
    patience: Priced | None = None  # priced patience's last choice, when it priced the wait

    @property
    def host(self) -> str:
        return self.slot.host


@dataclass(slots=True, frozen=True)
class Waiting:
    """A request that must wait: its waiter, and what it will be told meanwhile."""

    waiter: InLine
    host: str  # the host whose queue it waits in; "" when it only watches
    reason: Reason
    lease: LeaseOutcome
