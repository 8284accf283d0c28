"""The background tasks a shared-state object starts (a release from synchronous code, a
clean-up whose outcome it need not await), held until done so none is garbage-collected
half way, and cancelled together when the object closes."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

__all__ = ["Tasks"]


class Tasks:
    """A set of running tasks. Use it on one event loop."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coroutine: Coroutine[Any, Any, None]) -> None:
        """Run `coroutine` in a task held here until it is done (or `aclose`)."""
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def aclose(self) -> None:
        """Cancel the tasks still running and wait for them. Never raises."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
