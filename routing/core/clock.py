"""The clock of a request's durations and the gateway's deadlines: the running event loop's.

asyncio's loop reads the monotonic clock (uvloop: the same clock, to the millisecond), so in
production this is `time.monotonic` by another name. Reading it through the loop is what lets
the fleet twin (bench/twin) run the real runtime in virtual time: a lease's TTL, how long a
request has held its slot (priced patience's `line_wait`) and a key's per-minute window then
pass as the twin's loop says, and the same seed gives the same decisions on every run.
"""

from __future__ import annotations

import asyncio
import time

__all__ = ["loop_time"]


def loop_time() -> float:
    """Seconds on the running event loop's clock; the monotonic clock outside a loop (a
    thread reading a table, a management command)."""
    try:
        return asyncio.get_running_loop().time()
    except RuntimeError:
        return time.monotonic()
