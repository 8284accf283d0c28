"""What a fault test checks when it ends: the gateway holds nothing, and lost nothing.

`Ledger` counts the requests a test sends (through `ledger.client`, or `ledger.sent()` for
requests written to a raw socket) and `settle()` then checks two invariants:

- every limiter pair is back to zero in flight and zero queued, and no client key holds a
  request. The limiter lives in the gateway process, so this is read where an operator reads
  it: the `crossbar_in_flight`, `crossbar_queued` and `crossbar_client_in_flight` gauges of
  `/metrics`, which the gateway computes from the limiter itself at scrape time;
- exactly one Request row was written per request sent, no fewer and no more.

The `ledger` fixture (conftest.py) settles when its test passes.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import TracebackType

import httpx
from django.utils import timezone

from accounting.models import Request
from tests.helpers.gateway import Gateway
from tests.helpers.observe import series
from tests.helpers.waits import wait_until

HELD = ("crossbar_in_flight", "crossbar_queued", "crossbar_client_in_flight")
_NOT_PROXIED = ("/health", "/metrics")  # the gateway's own: no row


def held(url: str) -> dict[str, float]:
    """Every slot, queue place or client-key count the gateway holds right now, by series."""
    return series(url, HELD)


def wait_until_free(url: str, timeout: float = 10.0) -> None:
    """Wait until the gateway holds no slot, queue place or client count; fail otherwise."""
    last: list[dict[str, float]] = [{}]

    def free() -> bool:
        last[0] = held(url)
        return not last[0]

    try:
        wait_until(free, timeout, what="every slot and queue place to be given back")
    except BaseException:
        print(f"still held: {last[0]}")
        raise


def rss_mib(pid: int) -> float:
    """A process's resident memory, in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for process {pid}")


class Ledger:
    """The requests one test sent to one gateway, and the check that all of them ended well."""

    def __init__(self, gateway: Gateway) -> None:
        self.url = gateway.url
        self.started = timezone.now()
        self.count = 0
        self._lock = threading.Lock()
        self.client = httpx.Client(
            base_url=gateway.url, timeout=30, event_hooks={"request": [self._count]}
        )

    def _count(self, request: httpx.Request) -> None:
        if request.url.path not in _NOT_PROXIED or "x-crossbar-route" in request.headers:
            self.sent()

    def sent(self, n: int = 1) -> None:
        """Count requests sent some other way (a raw socket)."""
        with self._lock:
            self.count += n

    def rows(self):
        """The rows of requests that arrived since the ledger opened."""
        return Request.objects.filter(started__gte=self.started)

    def statuses(self, timeout: float = 20.0) -> list[int]:
        """The statuses of the rows so far, sorted, once every request sent has its row."""
        rows = self.rows()
        wait_until(
            lambda: rows.count() >= self.count, timeout, what=f"{self.count} accounting rows"
        )
        return sorted(rows.values_list("status", flat=True))

    def settle(self, timeout: float = 20.0) -> None:
        """Check both invariants, waiting for the gateway to finish what it still does."""
        wait_until_free(self.url, timeout)
        rows = self.rows()
        wait_until(
            lambda: rows.count() >= self.count, timeout, what=f"{self.count} accounting rows"
        )
        time.sleep(0.7)  # longer than the recorder's flush interval: an extra row would show
        assert rows.count() == self.count, f"{rows.count()} rows for {self.count} requests"

    def __enter__(self) -> Ledger:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.client.close()
