"""The gateway's live state of each host, for the host admin (read from another thread)."""

from __future__ import annotations

import asyncio

from routing.ops.dashboard import state
from routing.runtime import current_runtime


def live_host_states() -> dict[str, dict[str, object]]:
    """Each host's live state, read on the runtime's own loop; safe from any thread.

    Blocks the calling thread (an admin view's) for at most a second; {} when no gateway
    runs in this process.
    """
    runtime = current_runtime()
    if runtime is None or runtime.loop.is_closed():
        return {}

    async def read() -> dict[str, object]:
        return state(runtime)

    try:
        running_here = asyncio.get_running_loop() is runtime.loop
    except RuntimeError:
        running_here = False
    snapshot = (
        state(runtime)
        if running_here
        else asyncio.run_coroutine_threadsafe(read(), runtime.loop).result(timeout=1)
    )
    return {host["name"]: host for host in snapshot["hosts"]}
