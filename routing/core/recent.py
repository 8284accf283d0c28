"""The last few finished requests, numbered, for the live dashboard to show as they go by.

`add` runs once per request on the hot path (a number and an append under an uncontended lock,
well under a microsecond) and may be called from any thread. Readers take a copy and pick the
entries newer than the last number they showed.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from typing import Generic, TypeVar

T = TypeVar("T")


class RecentRequests(Generic[T]):
    """A bounded tail of items, each numbered from 1 in the order added."""

    def __init__(self, size: int = 50) -> None:
        self._items: deque[tuple[int, T]] = deque(maxlen=size)
        self._numbers = itertools.count(1)
        self._lock = threading.Lock()  # so items go in in the order of their numbers

    def add(self, item: T) -> None:
        with self._lock:
            self._items.append((next(self._numbers), item))

    def since(self, number: int) -> list[tuple[int, T]]:
        """The items numbered above `number`, oldest first (at most `size` of them)."""
        with self._lock:
            items = self._items.copy()
        return [entry for entry in items if entry[0] > number]
