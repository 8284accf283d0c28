"""The task that keeps a runtime's history sampled: each host's requests in flight and queue
depth once a second, into the rings (`History.sample`), and the rings' one rebuild from the
Request rows, in a worker thread.

The runtime has no hook for this, so whoever first needs the history starts it
(`ensure_sampler`): a dashboard opening, a scrape, or a request finishing
(`routing.ops.metrics.observe`). With shared state, the process's own share of the history is
sampled on the shared tick instead (routing/ops/dashboard_share.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref

from routing.ops.history_rings import History
from routing.ops.live import host_loads
from routing.runtime import Runtime

log = logging.getLogger("crossbar.dashboard")

SAMPLE_EVERY = 1.0  # seconds between samples of queue depth and in flight

_samplers: weakref.WeakKeyDictionary[Runtime, asyncio.Task[None]] = weakref.WeakKeyDictionary()
_rebuilds: weakref.WeakKeyDictionary[Runtime, asyncio.Task[None]] = weakref.WeakKeyDictionary()


def ensure_sampler(runtime: Runtime, history: History) -> None:
    """Sample `runtime`'s hosts into `history` every second from now on, and have `history`
    rebuilt from the rows once (in a worker thread); call on the runtime's loop.

    One sampler a runtime: a second call finds it running. A rebuild that failed (the
    database down) is tried again by the next call.
    """
    task = _samplers.get(runtime)
    if task is None or task.done():
        _samplers[runtime] = runtime.loop.create_task(
            _sample_forever(runtime, history), name="crossbar-history"
        )
    rebuild = _rebuilds.get(runtime)
    if not history.rebuilt and (rebuild is None or rebuild.done()):
        _rebuilds[runtime] = runtime.loop.create_task(
            _rebuild(history), name="crossbar-history-rebuild"
        )


def sampling(runtime: Runtime) -> bool:
    """Whether a sampler runs for `runtime`."""
    task = _samplers.get(runtime)
    return task is not None and not task.done()


async def _rebuild(history: History) -> None:
    from channels.db import database_sync_to_async

    try:
        # Not thread_sensitive, like the 24-hour read: a slow query holds up no other work.
        await database_sync_to_async(history.rebuild, thread_sensitive=False)()
    except Exception:  # the charts then start at this process's start, as they did before
        log.exception("history: cannot read the requests before this process started")


async def _sample_forever(runtime: Runtime, history: History) -> None:
    while not runtime.client.is_closed:
        try:
            history.sample(host_loads(runtime))
        except Exception:  # a sample missed is a gap in a chart, never a dead sampler
            log.exception("history: cannot sample the hosts")
        # On the second, so each step gets the same number of samples.
        await asyncio.sleep(SAMPLE_EVERY - time.time() % SAMPLE_EVERY)
