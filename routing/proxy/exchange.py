"""The accounting of one proxied request: exactly one row and one log line."""

from __future__ import annotations

import logging
import threading
import time
from datetime import UTC, datetime

from accounting.recorder import RequestRecord, get_recorder
from routing.core.clients import ClientPass
from routing.core.placement import Placement
from routing.core.running import RunningRequest, RunningTable
from routing.ops import metrics

log = logging.getLogger("crossbar.proxy")


class Exchange:
    """The accounting of one request: exactly one row and one log line, however it ends.

    `finish` is idempotent and may be called from any thread (a response dropped by Django
    after a disconnect is finalized wherever its last reference goes); it only hands a row to
    the recorder, never touches the database.
    """

    __slots__ = (
        "route", "fingerprint", "model", "host", "lease", "fallback", "started", "t0",
        "queued_ms", "ttfb_ms", "streamed", "done", "_lock", "client", "client_pass",
        "running", "_running_in",
    )  # fmt: skip

    def __init__(self) -> None:
        self.route = ""
        self.fingerprint = ""
        self.model = ""
        self.host = ""
        self.lease = ""
        self.fallback = ""
        self.client = ""  # the client key's name
        self.client_pass: ClientPass | None = None  # released when the exchange finishes
        self.started = datetime.now(UTC)
        self.t0 = time.perf_counter()
        self.queued_ms = 0
        self.ttfb_ms: int | None = None
        self.streamed = False
        self.done = False
        self._lock = threading.Lock()
        self.running: RunningRequest | None = None  # the dashboard's running-requests entry
        self._running_in: RunningTable | None = None

    def track(self, table: RunningTable) -> None:
        """Show the request among the running ones until it finishes."""
        self._running_in = table
        self.running = table.add(self.route, self.model, self.client)

    def elapsed_ms(self) -> int:
        return int((time.perf_counter() - self.t0) * 1000)

    def placed(self, placement: Placement) -> None:
        """Note where the request runs. `route` stays the route the client asked for."""
        self.host = placement.host
        self.lease = placement.lease
        self.model = placement.model
        self.fallback = placement.fallback
        self.queued_ms = int(placement.waited * 1000)
        if self.running is not None and self._running_in is not None:
            self._running_in.placed(self.running, self.host, self.queued_ms)

    def finish(
        self,
        status: int,
        error: str = "",
        prompt_tokens: int | None = None,
        cached_tokens: int | None = None,
        completion_tokens: int | None = None,
        code: str = "",
    ) -> None:
        """Write the request's row once; `code` is the gateway's error code (empty: none)."""
        with self._lock:
            if self.done:
                return
            self.done = True
        if self.running is not None and self._running_in is not None:
            self._running_in.finish(self.running)
        if self.client_pass is not None:
            self.client_pass.release()
        total_ms = self.elapsed_ms()
        record = RequestRecord(
            route=self.route,
            fingerprint=self.fingerprint,
            model=self.model,
            host=self.host,
            started=self.started,
            queued_ms=self.queued_ms,
            ttfb_ms=self.ttfb_ms,
            total_ms=total_ms,
            status=status,
            streamed=self.streamed,
            lease=self.lease,
            prompt_tokens=prompt_tokens,
            cached_tokens=cached_tokens,
            completion_tokens=completion_tokens,
            error=error,
            client=self.client,
            fallback=self.fallback,
            code=code,
        )
        get_recorder().record(record)
        metrics.observe(record)
        log.info(
            "route=%s model=%s host=%s status=%d lease=%s queued_ms=%d total_ms=%d fp=%s%s",
            self.route or "-",
            self.model or "-",
            self.host or "-",
            status,
            self.lease or "-",
            self.queued_ms,
            total_ms,
            self.fingerprint[:8] or "-",
            f" error={error!r}" if error else "",
        )

    def __del__(self) -> None:
        # The last safety net: a response Django dropped before iterating it (the client left
        # between the view's return and the first byte) still leaves its row.
        if not self.done:
            self.finish(499, "client disconnected")
