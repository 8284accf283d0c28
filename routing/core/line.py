"""One (host, model) pair's line: who waits there, in `FairLine`'s order, and what runs there.

The limiter (routing/core/limiter.py) keeps one `Line` per pair. The line holds the pair's
waiters and asks its `FairLine` (routing/core/fairness.py) whom a freed slot goes to: priority
class first (aging past the starvation bound before that), then the key with the least virtual
work among its class, first come first served within a key. With one key and one class (every
request without a client key is the one anonymous key, class standard) that is arrival order.

The line also counts the pair's slots held per class (also those held for a watcher to
decide), which the class's headroom is measured against: a slot may go to a request of a lower
class only if enough slots stay free or run the higher class (`allows`).

One event loop, not thread-safe; nothing here awaits.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping
from typing import TYPE_CHECKING

from routing.core.fairness import DEFAULT_STARVATION_BOUND, Entry, FairLine, Priority, Share

if TYPE_CHECKING:
    from routing.core.limiter import Waiter

__all__ = ["Line", "headroom_in_use"]


def headroom_in_use(
    headroom: Mapping[Priority, int], classes: Collection[Priority]
) -> dict[Priority, int]:
    """The headroom of the classes a request may come in (`classes`: those of the enabled
    client keys; a request without a key is standard): a slot kept for a class no request
    can have would idle for nothing."""
    could_come = {*classes, Priority.STANDARD}
    return {priority: slots for priority, slots in headroom.items() if priority in could_come}


class Line:
    """The waiters of one pair in the order they will be granted, and its slots per class."""

    __slots__ = ("order", "running", "_waiters")

    def __init__(
        self,
        headroom: Mapping[Priority, int] | None = None,
        starvation_bound: float = DEFAULT_STARVATION_BOUND,
    ) -> None:
        self.order = FairLine(headroom, starvation_bound)
        self.running: dict[Priority, int] = {}  # slots held (or offered) now, per class
        self._waiters: dict[Entry, Waiter] = {}

    def __len__(self) -> int:
        return len(self._waiters)

    def __iter__(self) -> Iterator[Waiter]:
        """The waiters, highest class first, each key's in arrival order (the grant order
        when one key waits; with several, fair shares decide between them at each grant)."""
        for entry in self.order:
            yield self._waiters[entry]

    def join(self, waiter: Waiter, share: Share, now: float) -> Entry:
        """Put `waiter` at the end of its key's line; its entry, to `leave` with."""
        entry = Entry(share.key, share.priority, share.weight, now)
        self.order.join(entry)
        self._waiters[entry] = waiter
        return entry

    def leave(self, entry: Entry) -> None:
        """Take the entry out of the line; nothing when it was granted already."""
        if self.order.leave(entry):
            del self._waiters[entry]

    def next(self, now: float, free: int) -> tuple[Waiter, Entry] | None:
        """The waiter a free slot goes to, out of the line, with its entry (charged an
        advance: settle it with `FairLine.charge`); None when nobody may take one of `free`."""
        entry = self.order.next(now, free, self.running)
        if entry is None:
            return None
        return self._waiters.pop(entry), entry

    def to_shed(self, share: Share) -> Waiter | None:
        """The waiter to shed for a newcomer of `share` (`FairLine.to_shed`: of a lower class,
        or of a key further ahead of its share), still in the line; None when nobody is."""
        entry = self.order.to_shed(share.key, share.priority, share.weight)
        return self._waiters[entry] if entry is not None else None

    def allows(self, priority: Priority, free: int) -> bool:
        """Whether a request of `priority` may take one of `free` slots under the headroom
        of the classes above it."""
        return free > 0 and self.order.allows(priority, free, self.running)

    def took(self, priority: Priority) -> None:
        self.running[priority] = self.running.get(priority, 0) + 1

    def gave(self, priority: Priority) -> None:
        left = self.running.get(priority, 0) - 1
        if left > 0:
            self.running[priority] = left
        else:
            self.running.pop(priority, None)
