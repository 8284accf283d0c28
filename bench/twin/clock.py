"""An asyncio event loop in virtual time: when nothing is ready to run, its clock jumps to the
next timer, so a ten-minute workload takes as long as its Python takes, and the same seed
gives the same run (nothing waits on a real clock or a real socket).

The jump happens in the selector: asyncio's loop asks its selector to wait until the next
timer is due, and this one adds that wait to the clock at once and reports no I/O. With no
timer and nothing ready, every task waits on something no timer brings: the twin has
deadlocked, and says so rather than hanging.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Coroutine, Mapping
from typing import Any, TypeVar

T = TypeVar("T")


class Deadlocked(RuntimeError):
    """Every task waits, and no timer is set that could wake one."""


class _Jumping(selectors.BaseSelector):
    """A selector that never waits: `select(timeout)` moves the loop's clock by `timeout`."""

    def __init__(self, clock: VirtualLoop) -> None:
        self._clock = clock
        self._keys: dict[Any, selectors.SelectorKey] = {}

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        key = selectors.SelectorKey(fileobj, _fd(fileobj), events, data)
        self._keys[fileobj] = key
        return key

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self._keys.pop(fileobj)

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is None:
            raise Deadlocked("every task waits and no timer is set: the twin cannot go on")
        if timeout > 0:
            self._clock.jump(timeout)
        return []

    def close(self) -> None:
        self._keys.clear()

    def get_map(self) -> Mapping[Any, selectors.SelectorKey]:
        return self._keys


def _fd(fileobj: Any) -> int:
    return fileobj if isinstance(fileobj, int) else int(fileobj.fileno())


class VirtualLoop(asyncio.SelectorEventLoop):
    """An event loop whose `time()` starts at 0 and moves only to the next due timer."""

    def __init__(self) -> None:
        self._now = 0.0
        super().__init__(_Jumping(self))

    def time(self) -> float:
        return self._now

    def jump(self, seconds: float) -> None:
        self._now += seconds


def in_virtual_time(main: Coroutine[Any, Any, T]) -> T:
    """Run `main` to its end on a fresh `VirtualLoop`."""
    loop = VirtualLoop()
    try:
        return loop.run_until_complete(main)
    finally:
        loop.close()
