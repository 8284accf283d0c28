"""A call to Redis (`Shared.script`) as the task making it sees it, against a real redis-server."""

from __future__ import annotations

import asyncio
import random

from routing.shared.state import Shared

CALLS = 300  # calls cancelled while under way; about a third returned before the fix


async def _cancel_calls_under_way(url: str) -> tuple[int, int]:
    """Cancel CALLS script calls at random points while they are under way: how many ended
    cancelled, and how many returned their reply all the same."""
    shared = Shared(url)
    call = shared.script("return 1")
    rng = random.Random(3)
    cancelled = returned = 0
    try:
        while cancelled + returned < CALLS:
            task = asyncio.ensure_future(call())
            for _ in range(rng.randrange(8)):  # into the send, the read, the pool's release
                await asyncio.sleep(0)
            if task.done():
                continue  # over before the cancellation: not one of the CALLS
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                cancelled += 1
            else:
                returned += 1
    finally:
        await shared.aclose()
    return cancelled, returned


def test_a_call_cancelled_while_under_way_ends_cancelled_even_as_its_reply_comes(redis_url):
    # redis-py sends through asyncio.wait_for, which on Python 3.11 returns the send's result
    # when the cancellation comes as the send ends. A caller that cancels a request's task
    # counts on the task to give back what the call took (a slot); a task that goes on as if
    # never cancelled keeps it, and nobody is left to give it back.
    cancelled, returned = asyncio.run(_cancel_calls_under_way(redis_url))

    assert (cancelled, returned) == (CALLS, 0)
