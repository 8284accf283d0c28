"""Hands request rows from the event loop to one writer thread that saves them in batches.

The proxy calls `Recorder.record()` on its event loop once per request. That call appends to a
deque under a lock and, at most, wakes the writer: no ORM, no thread hop, a microsecond or two.
The writer thread owns its own database connection and saves rows a batch at a time, one
`INSERT` run for every row of it in one transaction (when `batch_size` rows are waiting, or
`flush_interval` seconds after the first one arrived).

When the database is locked or down, the writer keeps the batch, closes its connection (so a
restarted PostgreSQL is reconnected) and retries with a doubling pause (0.1 s up to 5 s). Rows
keep arriving meanwhile and are held in memory up to `max_backlog`; past that, new rows are
dropped and counted. Dropping the newest rather than the oldest means a row, once accepted,
is never touched again: the batch under retry and the queue behind it stay intact and in
order, the hole in the history is one interval that the log brackets (from the "new rows are
dropped" error to the "accepted again" warning, which gives the count), and it is the gateway's
own rule for a full queue: refuse at once.

A row the database refuses (a constraint or a value it cannot store) would otherwise fail its
whole batch forever, so a refused batch is split in halves until the offending rows are
alone; those are dropped, counted and logged one by one (which request, and why), without
their text. A write waits at most `rows.ATTEMPT_SECONDS` for a lock, so a stop keeps its
deadline: rows the database still cannot take after `STOP_TIMEOUT` are kept in the spool
(accounting/spool.py) and written by the next process that starts (`start()`).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import threading
import time
from collections import deque
from datetime import datetime

from django.conf import settings
from django.db import DatabaseError, DataError, IntegrityError, connection

from accounting.rows import ATTEMPT_SECONDS, from_spool, spooled, within_columns
from accounting.rows import RequestRecord as RequestRecord  # the recorder's rows, re-exported
from accounting.rows import first_line as _first_line
from accounting.rows import save as _save
from accounting.spool import Spool

log = logging.getLogger(__name__)

RETRY_FIRST = 0.1
RETRY_MAX = 5.0
STOP_TIMEOUT = 10.0  # seconds a stop waits for the database before it spools what is held


REFUSALS_LOGGED = 5  # rows logged one by one per batch; the rest are counted


def _log_refused(refused: list[tuple[RequestRecord, str]], of: int) -> None:
    """One line per refused row (a batch's first few): which request, and why. The row's
    text fields are not shown: an error message may quote what a host sent."""
    for row, why in refused[:REFUSALS_LOGGED]:
        log.error(
            "accounting: the database refused a row (route=%s host=%s status=%d started=%s), "
            "dropped: %s",
            row.route or "-",
            row.host or "-",
            row.status,
            row.started.isoformat() if isinstance(row.started, datetime) else row.started,
            why,
        )
    if len(refused) > REFUSALS_LOGGED:
        log.error(
            "accounting: the database refused %d of %d rows in all, dropped",
            len(refused),
            of,
        )


class Recorder:
    """A queue of `RequestRecord`s and the one thread that writes them.

    `record()` is safe to call from any thread, including an event loop's; everything else is
    for tests, benchmarks and shutdown. The writer thread starts on the first `record()` and
    again after `stop()` if rows keep coming.
    """

    def __init__(
        self,
        *,
        batch_size: int = 500,
        flush_interval: float = 0.5,
        max_backlog: int = 100_000,
        spool: Spool | None = None,
    ) -> None:
        self.batch_size = batch_size
        self.spool = spool
        self.flush_interval = flush_interval
        self.max_backlog = max_backlog
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)  # the writer waits here for rows
        self._settled = threading.Condition(self._lock)  # flush() waits here for the writer
        self._queue: deque[RequestRecord] = deque()
        self._in_flight = 0  # taken by the writer, neither written nor given up yet
        self._accepted = 0
        self._finished = 0  # written, refused or given up at shutdown
        self._written = 0
        self._dropped = 0
        self._left_at_stop = 0
        self._failing = False
        self._failing_since = 0.0
        self._streak_drops = 0  # dropped for a full backlog since it was last logged
        self._flushers = 0
        self._stopping = False
        self._give_up_at: float | None = None
        self._thread: threading.Thread | None = None

    @property
    def backlog(self) -> int:
        """Rows accepted and not yet written."""
        with self._lock:
            return self._held()

    def _held(self) -> int:
        """Rows accepted and not yet written or dropped; the caller holds the lock."""
        return len(self._queue) + self._in_flight

    @property
    def written(self) -> int:
        return self._written

    @property
    def dropped(self) -> int:
        """Rows lost: refused past `max_backlog`, refused by the database, or unwritten at stop."""
        return self._dropped

    @property
    def spooled(self) -> int:
        """Rows in the spool this process kept there or is writing from it."""
        return self.spool.waiting if self.spool is not None else 0

    @property
    def left_at_stop(self) -> int:
        """Rows the last stop did not write: kept in the spool, or lost."""
        return self._left_at_stop

    @property
    def failing(self) -> bool:
        """True while the database is refusing writes and the writer is retrying."""
        return self._failing

    def record(self, row: RequestRecord) -> None:
        """Queue a row for writing. Never blocks on the database and never raises.

        A figure beyond its column's range is stored empty (`accounting.columns`)."""
        row = within_columns(row)
        with self._lock:
            held = self._held()
            if held >= self.max_backlog:
                self._dropped += 1
                self._streak_drops += 1
                first_drop = self._streak_drops == 1
            else:
                first_drop = False
                self._queue.append(row)
                self._accepted += 1
                if len(self._queue) in (1, self.batch_size):
                    self._work.notify()
                if self._thread is None:
                    self._start_writer()
        if first_drop:
            log.error(
                "accounting: %d rows are waiting for the database; new rows are dropped "
                "until it catches up",
                self.max_backlog,
            )

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every row recorded before the call is written (or dropped).

        Returns False when `timeout` seconds pass first, e.g. while the database is down.
        """
        deadline = time.monotonic() + timeout
        with self._lock:
            target = self._accepted
            self._flushers += 1
            self._work.notify()
            try:
                while self._finished < target:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0 or self._thread is None:
                        return False
                    self._settled.wait(remaining)
                return True
            finally:
                self._flushers -= 1

    def start(self) -> None:
        """Start the writer now, not at the first row: it first writes the rows the spool
        holds (a process before this one could not write them)."""
        with self._lock:
            if self._thread is None:
                self._start_writer()

    def stop(self, timeout: float = STOP_TIMEOUT) -> None:
        """Write what is held and end the writer thread.

        Rows the database still cannot take after `timeout` seconds are kept in the spool
        (`left_at_stop` counts them), or lost and counted as dropped without one.
        """
        with self._lock:
            thread = self._thread
            if thread is None:
                return
            self._stopping = True
            self._give_up_at = time.monotonic() + timeout
            self._work.notify()
        # A write begun just before the deadline may wait for its lock a while longer.
        thread.join(timeout + ATTEMPT_SECONDS + 1.0)
        with self._lock:
            if thread.is_alive():
                # Stuck in the database driver; it gives up by itself once it returns.
                log.error(
                    "accounting: the writer did not stop within %.0f s; %d rows are unwritten",
                    timeout,
                    self._held(),
                )
                return
            self._thread = None
            self._stopping = False
            self._give_up_at = None

    def _start_writer(self) -> None:
        thread = threading.Thread(target=self._run, name="accounting-recorder", daemon=True)
        try:
            thread.start()
        except RuntimeError:
            log.exception("accounting: cannot start the writer thread")
            return
        self._thread = thread

    def _run(self) -> None:
        try:
            if not self._replay():
                return
            while (batch := self._next_batch()) is not None:
                if left := self._write(batch):
                    self._abandon(left)
                    return
        except Exception:
            # A bug, not the database (its errors are handled in _write); say so loudly, since
            # from here on rows only pile up until they are dropped.
            log.exception("accounting: the writer thread failed; requests are not recorded")
        finally:
            with contextlib.suppress(DatabaseError):
                connection.close()

    def _next_batch(self) -> list[RequestRecord] | None:
        """Wait for a full batch, the flush interval, a flush() or stop(); None to end."""
        with self._lock:
            while not self._queue:
                if self._stopping:
                    return None
                self._work.wait()
            deadline = time.monotonic() + self.flush_interval
            while len(self._queue) < self.batch_size and not (self._flushers or self._stopping):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._work.wait(remaining)
            size = min(self.batch_size, len(self._queue))
            batch = [self._queue.popleft() for _ in range(size)]
            self._in_flight = size
            return batch

    def _replay(self) -> bool:
        """Write the rows of the spool's files this process claims; False when stop()'s
        deadline passed first (what is left is kept in the spool anew)."""
        if self.spool is None:
            return True
        for path in self.spool.claim():
            try:
                lines = self.spool.read(path)
            except OSError as exc:
                log.error("accounting: cannot read %s from the spool: %s", path, exc)
                continue
            rows = [row for line in lines if (row := from_spool(line)) is not None]
            if len(rows) < len(lines):
                log.warning(
                    "accounting: %d lines of %s are not rows; skipped", len(lines) - len(rows), path
                )
            with self._lock:
                self._accepted += len(rows)
                self._in_flight += len(rows)
            if left := self._write(rows):
                if self._abandon(left):
                    self.spool.done(path, len(lines))
                return False
            self.spool.done(path, len(lines))
            log.warning("accounting: %d rows written from the spool (%s)", len(rows), path.name)
        return True

    def _write(self, batch: list[RequestRecord]) -> list[RequestRecord]:
        """Save a batch, retrying while the database is unavailable.

        Returns the rows not written when stop()'s deadline passed before the database came
        back (none otherwise: a row the database refuses is logged and dropped).
        """
        parts = [batch]
        refused: list[tuple[RequestRecord, str]] = []
        delay = RETRY_FIRST
        while parts:
            part = parts.pop()
            try:
                _save(part)
            except DatabaseError as exc:
                if not isinstance(exc, IntegrityError | DataError):
                    self._note_failure(exc)
                    with contextlib.suppress(DatabaseError):
                        connection.close()
                    parts.append(part)
                    if not self._pause(delay):
                        self._refused(refused, len(batch))
                        return [row for part in parts for row in part]
                    delay = min(delay * 2, RETRY_MAX)
                    continue
                refusal: Exception = exc
            except Exception as exc:  # a value of the wrong type from the caller
                refusal = exc
            else:
                self._note_recovery()
                self._settle(len(part), written=True)
                continue
            if len(part) > 1:
                middle = len(part) // 2
                parts += [part[middle:], part[:middle]]
            else:
                refused.append((part[0], _first_line(refusal)))
        self._refused(refused, len(batch))
        return []

    def _refused(self, refused: list[tuple[RequestRecord, str]], of: int) -> None:
        if refused:
            _log_refused(refused, of)
            self._settle(len(refused), written=False)

    def _note_failure(self, exc: DatabaseError) -> None:
        if not self._failing:
            self._failing = True
            self._failing_since = time.monotonic()
            log.warning(
                "accounting: cannot write to the database (%s); holding %d rows in memory "
                "(at most %d, newer ones are dropped) and retrying",
                _first_line(exc),
                self.backlog,
                self.max_backlog,
            )

    def _note_recovery(self) -> None:
        if self._failing:
            self._failing = False
            log.warning(
                "accounting: database writes recovered after %.1f s",
                time.monotonic() - self._failing_since,
            )

    def _pause(self, seconds: float) -> bool:
        """Sleep before a retry; False when stop()'s deadline has passed."""
        with self._lock:
            until = time.monotonic() + seconds
            if self._give_up_at is not None:
                if time.monotonic() >= self._give_up_at:
                    return False
                until = min(until, self._give_up_at)
            while (remaining := until - time.monotonic()) > 0:
                self._work.wait(remaining)
            return True

    def _settle(self, count: int, *, written: bool, kept: bool = False) -> None:
        """Count in-flight rows as done (written, kept in the spool, or dropped), then wake
        flush() (after logging, so it sees the log)."""
        with self._lock:
            self._in_flight -= count
            if written:
                self._written += count
            elif not kept:
                self._dropped += count
            dropped = 0
            if written and self._streak_drops and self._held() < self.max_backlog:
                dropped, self._streak_drops = self._streak_drops, 0
        if dropped:
            log.warning("accounting: rows are accepted again; %d were dropped", dropped)
        with self._lock:
            self._finished += count
            self._settled.notify_all()

    def _abandon(self, left: list[RequestRecord]) -> bool:
        """At stop()'s deadline: keep `left` (in flight) and the queue in the spool, or
        drop them; whether they were kept."""
        with self._lock:
            self._in_flight += len(self._queue)
            rows = left + list(self._queue)
            self._queue.clear()
            self._left_at_stop += len(rows)
        kept = self._keep(rows)
        self._settle(len(rows), written=False, kept=kept)
        return kept

    def _keep(self, rows: list[RequestRecord]) -> bool:
        """Keep `rows` in the spool, saying so; False (and said why) when they are lost."""
        if self.spool is None:
            log.error(
                "accounting: the database is unavailable at shutdown; %d rows dropped", len(rows)
            )
            return False
        try:
            self.spool.keep(spooled(row) for row in rows)
        except OSError as exc:
            log.error(
                "accounting: the database is unavailable at shutdown and the spool %s cannot "
                "take %d rows (%s): they are lost",
                self.spool.directory, len(rows), exc.strerror or exc,
            )  # fmt: skip
            return False
        log.error(
            "accounting: the database is unavailable at shutdown; %d rows kept in %s, "
            "written at the next start",
            len(rows), self.spool.directory,
        )  # fmt: skip
        return True


_recorder: Recorder | None = None
_recorder_lock = threading.Lock()


def use_recorder(recorder: Recorder | None) -> Recorder | None:
    """Make `recorder` the process's (None: the next `get_recorder` builds one), and return
    the one it replaces. For a process that keeps its rows elsewhere: the fleet twin
    (bench/twin) counts them in memory."""
    global _recorder
    with _recorder_lock:
        previous, _recorder = _recorder, recorder
    return previous


def get_recorder() -> Recorder:
    """The process-wide recorder, spooling to the gateway's `var/spool` (`Spool.of_database`).

    crossbar_serve starts it with the server and stops it after (crossbar_site/lifecycle.py);
    in any other process it writes what it holds when the interpreter exits (`atexit`). A
    SIGKILL loses whatever is held in memory.
    """
    global _recorder
    if _recorder is None:
        with _recorder_lock:
            if _recorder is None:
                # A test run's connection names its test database.
                spool = Spool.of_database(settings.VAR_DIR, connection.settings_dict)
                recorder = Recorder(spool=spool)
                atexit.register(recorder.stop)
                _recorder = recorder
    return _recorder
