"""Tasks nobody awaits, held until they end.

The event loop keeps only a weak reference to a task, so a task created and forgotten can be
collected before it finishes (asyncio's `create_task` documentation says to keep a reference).
`spawn` keeps one until the task is done. Call from the loop that runs the task.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

__all__ = ["spawn"]

_held: set[asyncio.Task[Any]] = set()


def spawn(coroutine: Coroutine[Any, Any, Any], name: str | None = None) -> asyncio.Task[Any]:
    """Run `coroutine` in a task of its own, referenced until it ends."""
    task = asyncio.get_running_loop().create_task(coroutine, name=name)
    _held.add(task)
    task.add_done_callback(_held.discard)
    return task
