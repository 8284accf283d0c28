"""The requests running right now: the dashboard's live table, and how long each request
placed on a host has held its slot there (`holding`, for priced patience's wait in line).
Pure: standard library only.

The proxy adds a request once its route is known, notes the line it waits in (if it must)
and where it was placed once it holds a slot, counts the SSE `data:` events it passes on (one
per generated token for llama-server) and finishes it when its record is written. Every call
runs on the runtime's event loop; adding, finishing and reading also take a short lock, so a
reader on another thread may take a snapshot (of requests that do not wait: a waiting one's
place is read from its line). Counting events does not: only the relay on the loop writes
`tokens`, and a reader that sees an event less is harmless.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from routing.core.pairs import Pair

_DATA_LINE = b"\ndata:"
_DONE = b"data: [DONE]"


class Line(Protocol):
    """A place in a host's queue (`routing.core.state.InLine` is one)."""

    @property
    def host(self) -> str: ...
    @property
    def position(self) -> int: ...


class RunningRequest:
    """One request in the table; the proxy holds it and hands it back to the table's methods."""

    __slots__ = (
        "number", "route", "model", "client", "host", "queued_ms", "tokens", "t0", "table",
        "line", "granted", "holds",
    )  # fmt: skip

    def __init__(
        self, number: int, route: str, model: str, client: str, t0: float, table: RunningTable
    ) -> None:
        self.table = table  # the table it runs in, for `finish`
        self.number = number
        self.route = route
        self.model = model
        self.client = client
        self.host = ""  # empty while the request waits for a slot
        self.queued_ms: int | None = None  # None while it waits
        self.tokens = 0
        self.t0 = t0
        self.line: Line | None = None  # the place it waits in, while it waits
        self.granted = 0.0  # the table's clock when it was placed
        self.holds: Pair | None = None  # the pair of its slot, once placed


@dataclass(slots=True, frozen=True)
class RunningRow:
    """A running request as a reader sees it at one instant."""

    number: int
    route: str
    model: str
    client: str
    host: str
    elapsed_ms: int
    queued_ms: int | None  # None: still waiting for a slot
    tokens: int
    line: str = ""  # while waiting: the host whose queue it is in ("" when it only watches)
    place: int = 0  # its 1-based place in that queue; 0 when unknown


class RunningTable:
    """The requests in flight in one runtime, oldest first in `snapshot()`."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._numbers = itertools.count(1)
        self._entries: dict[int, RunningRequest] = {}
        # (host, model) -> the requests placed there, by number: what `holding` reads.
        self._placed: dict[Pair, dict[int, RunningRequest]] = {}
        self._lock = threading.Lock()

    def add(self, route: str, model: str, client: str) -> RunningRequest:
        """A request starts (its route is known); the entry to pass to the other methods."""
        with self._lock:
            entry = RunningRequest(next(self._numbers), route, model, client, self._clock(), self)
            self._entries[entry.number] = entry
        return entry

    def waits(self, entry: RunningRequest, line: Line) -> None:
        """The request waits for a slot, in `line` (its host "" when it only watches)."""
        entry.line = line

    def placed(self, entry: RunningRequest, host: str, queued_ms: int, model: str) -> None:
        """The request holds a slot of `model` on `host`, after waiting `queued_ms` for it (a
        request asked again elsewhere, after a failure, is placed again)."""
        entry.host = host
        entry.queued_ms = queued_ms
        entry.line = None
        with self._lock:
            self._unplace(entry)
            entry.granted = self._clock()
            entry.holds = Pair(host, model)
            self._placed.setdefault(entry.holds, {})[entry.number] = entry

    def freed(self, entry: RunningRequest) -> None:
        """The request gave its slot back; its answer may still be on its way to the client,
        and it shows until it finishes. Calling it again does nothing."""
        with self._lock:
            self._unplace(entry)

    def finish(self, entry: RunningRequest) -> None:
        """The request ended, however; calling it again does nothing."""
        with self._lock:
            self._entries.pop(entry.number, None)
            self._unplace(entry)

    def holding(self, host: str, model: str) -> list[float]:
        """How long each request placed on `host` for `model` has held its slot there, in
        seconds, for those that hold it still (priced patience's `line_wait`)."""
        now = self._clock()
        with self._lock:
            there = list(self._placed.get(Pair(host, model), {}).values())
        return [now - entry.granted for entry in there]

    def _unplace(self, entry: RunningRequest) -> None:
        """Take the request out of where it was placed (under the lock)."""
        if entry.holds is None:
            return
        there = self._placed.get(entry.holds)
        if there is not None:
            there.pop(entry.number, None)
            if not there:
                del self._placed[entry.holds]
        entry.holds = None

    def __len__(self) -> int:
        return len(self._entries)

    def snapshot(self, limit: int | None = None) -> list[RunningRow]:
        """Every running request (the oldest `limit`), oldest first, with its elapsed time
        now and, for one that waits, whose line it is in and its place there. The place is
        read from the line itself: take a snapshot with waiting requests on the loop."""
        with self._lock:
            entries = list(self._entries.values())[:limit]
        now = self._clock()
        return [
            RunningRow(
                number=entry.number,
                route=entry.route,
                model=entry.model,
                client=entry.client,
                host=entry.host,
                elapsed_ms=max(0, int((now - entry.t0) * 1000)),
                queued_ms=entry.queued_ms,
                tokens=entry.tokens,
                line=line.host if (line := entry.line) is not None else "",
                place=line.position if line is not None else 0,
            )
            for entry in entries
        ]


def data_events(chunk: bytes) -> int:
    """The SSE `data:` events that start in `chunk`, leaving out the final `[DONE]`.

    A `data:` line starts a chunk or follows a newline; JSON cannot hold a raw newline, so a
    model writing the text "data:" is not counted. An event whose `data:` is split across two
    chunks is missed: the count is what the dashboard shows as tokens so far, not the bill.
    """
    return chunk.count(_DATA_LINE) + chunk.startswith(b"data:") - chunk.count(_DONE)
