"""A gateway process's life, whichever server runs it: the runtime at start, the requests in
flight, and the graceful stop.

The stop (`GracefulStop`, at SIGTERM or SIGINT) is the application's, not the server's, so it
is the same on daphne and on uvicorn (crossbar_site/serve.py gives each server its two
callbacks, `stop_listening` and `stop`):

1. `/health` answers 503 `draining` from then on (`routing.runtime.STOPPING`), on new
   connections as on kept-alive ones, while the server keeps listening and serving: a load
   balancer takes the process out when its probe says so, and what it sends meanwhile is served,
   not refused.
2. Once no HTTP request is in flight, or `grace` seconds after the signal, the server stops
   listening. Requests still running then are cut as if their clients had left (`cut`: each
   frees its slot, tells its host and writes a 499 row); a second signal cuts them at once.
3. The server stops (`stop`): it closes its connections, the runtime closes, the accounting
   recorder writes what it holds (`stop_accounting`), and the process exits 0, or 75 when
   rows the database could not take were left in the spool (written at the next start).

Everything here runs on the server's event loop, and nothing else in the process touches it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from accounting.recorder import get_recorder
from routing.core.background import spawn
from routing.runtime import STOPPING

log = logging.getLogger("crossbar.serve")

CUT_WAIT = 5.0  # seconds requests cut at the end of the grace may take to write their rows
# The exit status when accounting rows were left unwritten (sysexits' EX_TEMPFAIL): kept in
# the spool for the next start, or lost. A supervisor sees a stop that needs a look.
EXIT_ROWS_LEFT = 75


class InFlight:
    """The HTTP requests this process is serving, and the proxied ones that can be cut.

    A request is counted from `enter` to `leave`; `cuttable` registers how to end a proxied
    request as if its client had left (crossbar_site/handler.py: cancel the task serving it).
    """

    def __init__(self) -> None:
        self.count = 0
        self._idle = asyncio.Event()  # bound to a loop at its first wait, not here
        self._idle.set()
        self._cuttable: set[Callable[[], None]] = set()

    def enter(self) -> None:
        self.count += 1
        self._idle.clear()

    def leave(self) -> None:
        self.count -= 1
        if not self.count:
            self._idle.set()

    def cuttable(self, end: Callable[[], None]) -> Callable[[], None]:
        """Let `cut` call `end` until the function returned is called."""
        self._cuttable.add(end)
        return lambda: self._cuttable.discard(end)

    def cut(self) -> None:
        """End every proxied request in flight as if its client had left."""
        for end in list(self._cuttable):
            end()

    async def idle_within(self, seconds: float, *, unless: asyncio.Event | None = None) -> bool:
        """Wait until no request is in flight: True if so, False when `seconds` pass first or
        `unless` is set."""
        waits = [asyncio.ensure_future(self._idle.wait())]
        if unless is not None:
            waits.append(asyncio.ensure_future(unless.wait()))
        await asyncio.wait(waits, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
        for wait in waits:
            wait.cancel()
        return not self.count


REQUESTS = InFlight()


class GracefulStop:
    """The graceful stop of one server (the module docstring says what it does).

    `stop_listening()` closes the server's listening socket; `stop()` ends the server once the
    requests are done. `begin` may be called again (a second signal: cut now).
    """

    def __init__(
        self,
        grace: float,
        *,
        stop_listening: Callable[[], None],
        stop: Callable[[], Awaitable[None]],
    ) -> None:
        self.grace = grace
        self._stop_listening = stop_listening
        self._stop = stop
        self._hurry = asyncio.Event()
        self._stopping: asyncio.Task[None] | None = None

    def begin(self, why: str) -> None:
        """Begin the stop (`why`: "SIGTERM", ...), or hurry it when it has begun. Call on the
        server's loop."""
        if self._stopping is not None:
            log.warning("%s again: cutting the requests in flight now", why)
            self._hurry.set()
            return
        STOPPING.set()
        log.warning(
            "%s: draining (/health answers 503); waiting up to %g s for %d requests in flight",
            why,
            self.grace,
            REQUESTS.count,
        )
        self._stopping = spawn(self._run(), "crossbar-stop")

    def watch_lifeline(self, fd: int) -> None:
        """Begin the stop when `fd` reads end-of-file (a worker's supervisor is gone)."""
        loop = asyncio.get_running_loop()

        def gone() -> None:
            loop.remove_reader(fd)
            self.begin("the supervisor is gone")

        loop.add_reader(fd, gone)

    async def _run(self) -> None:
        idle = await REQUESTS.idle_within(self.grace, unless=self._hurry)
        self._stop_listening()
        if not idle:
            if not self._hurry.is_set():
                log.warning("grace of %g s over; cutting %d requests", self.grace, REQUESTS.count)
            REQUESTS.cut()
            await REQUESTS.idle_within(CUT_WAIT)
        await self._stop()


def start_accounting() -> None:
    """Start the accounting writer with the server: it first writes the rows a process
    before this one left in the spool."""
    get_recorder().start()


def stop_accounting() -> int:
    """Write the rows held (the database has `recorder.STOP_TIMEOUT` seconds to take them),
    then the exit status: 0, or `EXIT_ROWS_LEFT` when rows were left unwritten."""
    recorder = get_recorder()
    recorder.stop()
    if recorder.left_at_stop:
        log.error(
            "exiting with status %d: %d accounting rows were not written (see above)",
            EXIT_ROWS_LEFT,
            recorder.left_at_stop,
        )
        return EXIT_ROWS_LEFT
    return 0


def start_runtime() -> None:
    """Build the gateway's runtime now, in the background, not at the first request: the host
    admin shows live state from the start, and the first request pays no load. Call on the
    server's loop."""
    from routing.ops.dashboard_share import share_fleet
    from routing.ops.metrics import recent
    from routing.runtime import get_runtime

    async def start() -> None:
        try:
            # With shared state, the process's share of the dashboard from the start: a
            # request it runs shows on the dashboards other processes serve.
            share_fleet(await get_runtime(), recent)
        except Exception as exc:  # e.g. the database is down: the first request tries again
            log.warning("gateway runtime not started yet: %s", exc)

    spawn(start(), "crossbar-start-runtime")


async def close_runtime() -> None:
    """Close the running loop's runtime (its tasks, its upstream connections), logging a
    failure rather than raising it."""
    from routing.runtime import close_runtime as close

    try:
        await close()
    except Exception:
        log.exception("closing the gateway runtime failed")
