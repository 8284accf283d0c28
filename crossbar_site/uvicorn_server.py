"""uvicorn, as crossbar serves with it (`CROSSBAR_SERVER=uvicorn make run`).

uvicorn with uvloop and httptools, on the listening socket crossbar_site/serve.py binds, with
these settings: the ASGI lifespan on (the runtime starts with the server and closes after it,
crossbar_site/asgi.py); no access log (the proxy logs one line per request, crossbar_site/asgi.py
the site's); no proxy headers (uvicorn would take the client's address from the
X-Forwarded-For of any loopback peer; `CROSSBAR_TRUSTED_PROXIES` decides whom to believe); and
Django's logging, not uvicorn's.

What crossbar needs of a server, uvicorn already does: its `send` waits while the connection's
write buffer is full (backpressure), it hands a request body over as it arrives (the handler
stops reading at the cap and answers 413 at once), and it closes the connection of a response
the application left unfinished (logging `ASGI callable returned without completing response`).
What it lacks, a time limit on a request's head (its keep-alive timer stops at the first byte),
its protocol here adds (crossbar_site/heads.py). Its stop is replaced: at SIGTERM or SIGINT
uvicorn would close its listener and every idle connection at once (so `/health` never says
`draining`) and exit by re-raising the signal (status 143). `GatewayUvicorn.handle_exit`,
uvicorn's signal hook, begins crossbar's graceful stop instead (crossbar_site/lifecycle.py), and
uvicorn's own shutdown runs only at its end, when nothing is in flight: the process then exits
0.
"""

from __future__ import annotations

import asyncio
import signal
import socket
from types import FrameType
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from crossbar_site import heads
from crossbar_site.lifecycle import CUT_WAIT, GracefulStop, log


class _HeadTimedHttpTools(HttpToolsProtocol):
    """uvicorn's HTTP connection (httptools), giving each request's head `head_timeout()`
    seconds to arrive whole (crossbar_site/heads.py says what the clock covers): from the
    connection's opening, then from the first byte of each later request, until the head's end."""

    _head_clock: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]  # as uvicorn's
        super().connection_made(transport)
        self._start_head_clock()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._head_clock is None:
            self._start_head_clock()  # the first byte of a kept-alive connection's next head

    def on_headers_complete(self) -> None:
        self._stop_head_clock()
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_clock()
        super().connection_lost(exc)

    def _start_head_clock(self) -> None:
        self._head_clock = self.loop.call_later(heads.head_timeout(), self._head_late)

    def _stop_head_clock(self) -> None:
        if self._head_clock is not None:
            self._head_clock.cancel()
            self._head_clock = None

    def _head_late(self) -> None:
        self._head_clock = None
        if not self.transport.is_closing():
            self.transport.write(heads.late())
            self.transport.close()


class GatewayUvicorn(uvicorn.Server):
    """uvicorn's server, stopping as crossbar_site/lifecycle.py says."""

    def __init__(self, config: uvicorn.Config, *, grace: float, lifeline: int | None) -> None:
        super().__init__(config)
        self.servers: list[Any] = []  # uvicorn sets its listeners at startup
        self.lifeline = lifeline  # a worker's: reads end-of-file once its supervisor is gone
        self.stop_gracefully = GracefulStop(
            grace, stop_listening=self._stop_listening, stop=self._stop
        )
        self._loop: asyncio.AbstractEventLoop | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """uvicorn's handler of SIGTERM and SIGINT (a `signal.signal` handler, so it runs in
        the main thread between two bytecodes): the stop begins on the loop. The signal is not
        kept for uvicorn to raise again at its end, so the process exits 0."""
        if self._loop is None:
            super().handle_exit(sig, frame)
            return
        self._loop.call_soon_threadsafe(self.stop_gracefully.begin, signal.Signals(sig).name)

    async def serve_on(self, listening: socket.socket) -> None:
        self._loop = asyncio.get_running_loop()
        if self.lifeline is not None:
            self.stop_gracefully.watch_lifeline(self.lifeline)
        await self.serve(sockets=[listening])

    def _stop_listening(self) -> None:
        for server in self.servers:
            server.close()

    async def _stop(self) -> None:
        # uvicorn's main loop sees it within 0.1 s, closes the connections (waiting at most
        # CUT_WAIT for those still writing) and sends the lifespan's shutdown.
        self.should_exit = True


def run(application: Any, listening: socket.socket, *, grace: float, lifeline: int | None) -> None:
    """Serve `application` on the listening socket until the graceful stop ends. Blocks."""
    config = uvicorn.Config(
        application,
        http=_HeadTimedHttpTools,
        lifespan="on",
        access_log=False,
        proxy_headers=False,
        log_config=None,
        timeout_graceful_shutdown=int(CUT_WAIT),
    )
    server = GatewayUvicorn(config, grace=grace, lifeline=lifeline)
    with asyncio.Runner(loop_factory=config.get_loop_factory()) as runner:
        runner.run(server.serve_on(listening))
    log.info("stopped")  # as daphne's: the runtime closed (its rows written), the loop done
