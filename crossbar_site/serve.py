"""Serving crossbar with daphne: backpressure, a bounded request body, and a graceful stop.

`manage.py crossbar_serve` (what `make run` runs) serves the ASGI application through
`GatewayServer`, daphne's `Server` with five changes:

- **Backpressure.** Daphne's `send` writes into Twisted's transport and returns at once, so a
  client that reads slowly makes the gateway buffer the whole upstream response in memory (a
  long generation read by a stalled client: hundreds of MB). Here `send` of a body chunk returns
  only once the connection's write buffer is below Twisted's high-water mark (64 KiB), using
  Twisted's own push-producer protocol, as uvicorn's does; the proxy meanwhile reads the host
  into its own bounded buffer (routing/proxy/relay.py), and cuts a client that falls further
  behind. A client that reads nothing at all for `stall_timeout` seconds is disconnected, like
  any other client that leaves.
- **Unfinished responses end the connection.** An application that returns before its
  response's end (the proxy cuts a client that fell too far behind its host) gets the
  connection aborted, as uvicorn closes it; daphne alone would keep it open.
- **Short bodies end the connection.** When a host fails in the middle of a whole (non-SSE)
  answer, the proxy ends the body early; the response already declared the host's
  Content-Length, so a finished response would leave the client waiting for bytes that never
  come. Such a response closes its connection instead: the client sees an incomplete body.
- **Bounded request bodies.** Twisted spools a request body to a temporary file and daphne then
  hands all of it to the application at once, in memory. Here at most `BODY_CAP` bytes of a body
  are kept and the rest is read and dropped, so the proxy still sees "too large" (413, with its
  accounting row) while a huge or endless upload costs bandwidth, not memory or disk.
- **Graceful stop.** On SIGTERM or SIGINT: `/health` answers 503 `draining` from then on (to
  a load balancer probing over a kept-alive connection), stop listening (new connections are
  refused), let the HTTP requests in flight finish for up to `grace` seconds, wait for their
  last bytes to leave the socket buffers, then stop. Requests still running when the grace is
  over are cut as if their clients had left (slot freed, host told, a 499 row); a second signal
  cuts them at once. The accounting recorder writes what it holds when the interpreter exits
  (`atexit`).

Daphne's own command line stops the reactor at once on SIGTERM, dropping every stream.

With `CROSSBAR_WORKERS=N` the process started by `make run` supervises N such servers on one
listening socket instead (crossbar_site/workers.py).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import weakref
from http import HTTPStatus
from typing import Any

# Twisted's asyncio reactor is installed by daphne.server, which Django's app loading already
# imported (the daphne app): the reactor imported below is that one.
from daphne.endpoints import build_endpoint_description_strings
from daphne.http_protocol import HTTPFactory, WebRequest
from daphne.server import Server
from django.conf import settings
from twisted.internet import reactor, tcp
from twisted.internet.endpoints import AdoptedStreamServerEndpoint
from twisted.internet.interfaces import IListeningPort, IPushProducer
from twisted.web import http
from zope.interface import implementer

log = logging.getLogger("crossbar.serve")

# One byte more than the proxy accepts, so that it can tell "too large" from "exactly the limit".
BODY_CAP = settings.DATA_UPLOAD_MAX_MEMORY_SIZE + 1
_FLUSH_WAIT = 5.0  # seconds the last bytes of finished responses may take to leave at a stop
_CUT_WAIT = 5.0  # seconds requests cut at the end of the grace may take to wind up


class _CappedRequest(WebRequest):
    """Daphne's request, keeping at most `BODY_CAP` bytes of the body it receives, and
    sending the standard reason phrase for codes Twisted does not know (429 is not
    "Unknown Status")."""

    def setResponseCode(self, code: int, message: bytes | None = None) -> None:
        if message is None and code not in http.RESPONSES:
            try:
                message = HTTPStatus(code).phrase.encode()
            except ValueError:
                pass  # a code with no standard phrase at all
        super().setResponseCode(code, message)

    def gotLength(self, length: int | None) -> None:
        super().gotLength(length if length is None else min(length, BODY_CAP))
        self._kept = 0

    def handleContentChunk(self, data: bytes) -> None:
        room = BODY_CAP - self._kept
        if room > 0:
            data = data[:room]
            self._kept += len(data)
            super().handleContentChunk(data)


class _HTTPFactory(HTTPFactory):
    def buildProtocol(self, addr: Any) -> Any:
        protocol = super().buildProtocol(addr)
        protocol.requestFactory = _CappedRequest
        return protocol


@implementer(IPushProducer)
class _Writable:
    """One response's view of its connection: set while the write buffer has room.

    Registered on the Twisted request as a streaming producer, so the transport pauses and
    resumes it as its buffer crosses the high-water mark; `stopProducing` (the connection is
    gone) sets it too, so nothing waits on a dead connection.
    """

    def __init__(self, paused: bool) -> None:
        self.event = asyncio.Event()
        if not paused:
            self.event.set()

    def pauseProducing(self) -> None:
        self.event.clear()

    def resumeProducing(self) -> None:
        self.event.set()

    def stopProducing(self) -> None:
        self.event.set()


class _Response:
    """What the server follows of one response: the length it declared, the body bytes sent,
    and, once the body streams, its connection's room for more."""

    __slots__ = ("declared", "sent", "writable")

    def __init__(self, declared: int | None) -> None:
        self.declared = declared
        self.sent = 0
        self.writable: _Writable | None = None

    @classmethod
    def start(cls, protocol: WebRequest, message: dict[str, Any]) -> _Response:
        declared = None
        if protocol.method != b"HEAD" and message.get("status") not in (204, 304):
            for name, value in message.get("headers", ()):
                if name.lower() == b"content-length" and value.isdigit():
                    declared = int(value)
        return cls(declared)

    def short(self, last: int) -> bool:
        """Whether the body, ending with `last` more bytes, falls short of its length."""
        return self.declared is not None and self.sent + last < self.declared

    def watch(self, protocol: WebRequest) -> _Writable | None:
        """The connection's room for more, registered on first use; None once it is gone."""
        channel = protocol.channel
        if protocol.finished or channel is None:
            return None  # the application hears of the disconnect separately
        if self.writable is None:
            self.writable = _Writable(paused=getattr(channel, "_waitingForTransport", False))
            protocol.registerProducer(self.writable, True)
        return self.writable

    def unwatch(self, protocol: WebRequest) -> None:
        if self.writable is not None:
            self.writable = None
            if protocol.channel is not None:
                protocol.unregisterProducer()
            else:
                protocol.producer = None


class GatewayServer(Server):
    """Daphne's server with backpressure, capped request bodies and a graceful stop."""

    def __init__(
        self,
        application: Any,
        endpoints: list[str],
        *,
        grace: float,
        stall_timeout: float,
        adopted: tuple[int, int] | None = None,
        lifeline: int | None = None,
    ) -> None:
        self.grace = grace
        self.adopted = adopted  # (fd, address family) of a listening socket from a supervisor
        self.lifeline = lifeline  # reads end-of-file once that supervisor is gone
        self.stall_timeout = stall_timeout
        self.in_flight = 0  # HTTP requests whose application has not returned yet
        self.ports: list[IListeningPort] = []
        self._responses: weakref.WeakKeyDictionary[WebRequest, _Response] = (
            weakref.WeakKeyDictionary()
        )
        self._stopping = False
        self._stopper: asyncio.Future[None] | None = None
        self._idle = asyncio.Event()  # set while no HTTP request is in flight
        self._idle.set()  # a server stopped before its first request has nothing to wait for
        self._hurry = asyncio.Event()  # a second signal: no more grace
        super().__init__(
            self._counting(application),
            endpoints=endpoints,
            signal_handlers=False,
            application_close_timeout=10,
        )

    # daphne's run() builds its HTTP factory inline; this puts ours (capped bodies) in its place.
    @property
    def http_factory(self) -> HTTPFactory:
        return self._http_factory

    @http_factory.setter
    def http_factory(self, factory: HTTPFactory) -> None:
        self._http_factory = _HTTPFactory(self)

    def run(self) -> None:
        reactor.callLater(0, self._install_signal_handlers)  # inside the loop, once it runs
        # The gateway's runtime at once, not at the first request: the host admin shows live
        # state from the start, and the first request pays no load.
        reactor.callLater(0, _start_runtime)
        if self.adopted is not None:
            # daphne listens on endpoint strings only, whose "fd:" form cannot say IPv6 (and
            # scans Twisted's plugins): the supervisor's socket is listened on directly.
            self.endpoints: list[str] = []
            reactor.callLater(0, self._listen_adopted, *self.adopted)
        super().run()

    def _listen_adopted(self, fd: int, family: int) -> None:
        listening = AdoptedStreamServerEndpoint(reactor, fd, family).listen(self.http_factory)
        listening.addCallback(self.listen_success)
        listening.addErrback(self.listen_error)

    def listen_success(self, port: IListeningPort) -> None:
        super().listen_success(port)
        self.ports.append(port)
        address = port.getHost()
        log.info("listening on http://%s:%s", address.host, address.port)  # type: ignore[attr-defined]  # a TCP port's IAddress is an IPv4Address or IPv6Address

    def create_application(self, protocol: Any, scope: dict[str, Any]) -> Any:
        queue = super().create_application(protocol, scope)
        instance = self.connections.get(protocol, {}).get("application_instance")
        if instance is not None and isinstance(protocol, WebRequest):
            instance.add_done_callback(lambda _: self._returned(protocol))
        return queue

    def _returned(self, protocol: WebRequest) -> None:
        """An application that returned before its response's end (the proxy cut a client that
        fell too far behind) leaves a connection daphne would keep open: close it, without
        waiting for a client that may read nothing to take what its write buffer holds."""
        if self._responses.pop(protocol, None) is not None and protocol.channel is not None:
            protocol.channel.transport.abortConnection()

    def _counting(self, application: Any) -> Any:
        async def counted(scope: dict[str, Any], receive: Any, send: Any) -> None:
            if scope["type"] != "http":
                return await application(scope=scope, receive=receive, send=send)
            self.in_flight += 1
            self._idle.clear()
            try:
                return await application(scope=scope, receive=receive, send=send)
            finally:
                self.in_flight -= 1
                if not self.in_flight:
                    self._idle.set()

        return counted

    # -- responses: backpressure, short bodies ------------------------------------------

    async def handle_reply(self, protocol: WebRequest, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self._responses[protocol] = _Response.start(protocol, message)
        elif message["type"] == "http.response.body":
            response = self._responses.get(protocol)
            if response is not None and not message.get("more_body", False):
                del self._responses[protocol]
                response.unwatch(protocol)  # Twisted wants it gone before the request finishes
                if response.short(len(message.get("body", b""))):
                    # The body ended before its Content-Length (the host failed mid-answer).
                    # Finishing it would leave the client waiting for the rest: close instead,
                    # so the client sees an incomplete response.
                    if protocol.channel is not None:
                        protocol.channel.transport.loseConnection()
                    return
            await super().handle_reply(protocol, message)
            if response is not None and message.get("more_body", False):
                response.sent += len(message.get("body", b""))
                await self._until_writable(protocol, response)
            return
        await super().handle_reply(protocol, message)

    async def _until_writable(self, protocol: WebRequest, response: _Response) -> None:
        writable = response.watch(protocol)
        if writable is None or writable.event.is_set():
            return
        try:
            async with asyncio.timeout(self.stall_timeout):
                await writable.event.wait()
        except TimeoutError:
            log.warning(
                "client %s read nothing for %g s; closing its connection",
                ":".join(map(str, protocol.client_addr or ["?"])),
                self.stall_timeout,
            )
            if protocol.channel is not None:
                protocol.channel.transport.abortConnection()

    # -- graceful stop -------------------------------------------------------------------

    def _install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self._on_signal, signal.Signals(signum).name)
        if self.lifeline is not None:
            loop.add_reader(self.lifeline, self._supervisor_gone, self.lifeline)

    def _supervisor_gone(self, lifeline: int) -> None:
        asyncio.get_running_loop().remove_reader(lifeline)
        self._on_signal("the supervisor is gone")

    def _on_signal(self, name: str) -> None:
        if self._stopping:
            log.warning("%s again: cutting the requests in flight now", name)
            self._hurry.set()
            return
        self._stopping = True
        from routing.runtime import STOPPING

        STOPPING.set()  # /health: 503 draining
        log.warning(
            "%s: no new connections; waiting up to %g s for %d requests in flight",
            name,
            self.grace,
            self.in_flight,
        )
        for port in self.ports:
            port.stopListening()
        self._stopper = asyncio.ensure_future(self._stop_when_idle())  # held: tasks are weak

    async def _stop_when_idle(self) -> None:
        if not await self._idle_within(self.grace, or_hurry=True):
            if not self._hurry.is_set():
                log.warning("grace of %g s over; cutting %d requests", self.grace, self.in_flight)
            # Cut as if the clients had left: the proxy then frees their slots, cancels their
            # upstream requests and records them (499), as for any client that goes away.
            self._disconnect_clients()
            if not await self._idle_within(_CUT_WAIT):
                self._cancel_applications()
        # Finished responses may still sit in the write buffers of slow readers: let them leave.
        for _ in range(int(_FLUSH_WAIT / 0.05)):
            if not _unsent():
                break
            await asyncio.sleep(0.05)
        await _close_runtime()
        log.info("stopped")
        reactor.stop()

    async def _idle_within(self, seconds: float, *, or_hurry: bool = False) -> bool:
        """Wait until no HTTP request is in flight; False when `seconds` pass first (or, with
        `or_hurry`, a second signal comes)."""
        waits = [asyncio.ensure_future(self._idle.wait())]
        if or_hurry:
            waits.append(asyncio.ensure_future(self._hurry.wait()))
        await asyncio.wait(waits, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
        for wait in waits:
            wait.cancel()
        return not self.in_flight

    def _disconnect_clients(self) -> None:
        for protocol in list(self.connections):
            transport = getattr(protocol, "transport", None)
            if transport is not None:
                transport.abortConnection()

    def _cancel_applications(self) -> None:
        for details in self.connections.values():
            instance = details.get("application_instance")
            if instance is not None and not instance.done():
                instance.cancel()


def _unsent() -> int:
    """Client connections with response bytes not yet handed to the kernel."""
    return sum(1 for writer in reactor.getWriters() if isinstance(writer, tcp.Server))


def _start_runtime() -> None:
    from routing.core.background import spawn
    from routing.runtime import get_runtime

    async def start() -> None:
        try:
            await get_runtime()
        except Exception as exc:  # e.g. the database is down: the first request tries again
            log.warning("gateway runtime not started yet: %s", exc)

    spawn(start(), "crossbar-start-runtime")


async def _close_runtime() -> None:
    from routing.runtime import close_runtime

    try:
        await close_runtime()
    except Exception:
        log.exception("closing the gateway runtime failed")


def serve(host: str, port: int, *, grace: float) -> None:
    """Serve the site on host:port until SIGTERM/SIGINT, then stop gracefully. Blocks.

    With CROSSBAR_WORKERS=N > 1, supervise N worker processes on host:port instead; a worker
    (started so by its supervisor) serves the socket it was given. Raises CommandError for a
    bad CROSSBAR_WORKERS, or N > 1 without CROSSBAR_REDIS_URL."""
    from crossbar_site import workers

    wanted = workers.count()
    given = workers.inherited()
    if given is None and wanted > 1:
        code = workers.supervise(host, port, wanted, grace)
        if code:
            raise SystemExit(code)
        return
    from crossbar_site.asgi import application

    endpoints = build_endpoint_description_strings(host=host, port=port)
    if given is not None:
        endpoints = [f"fd:fileno={given[0]}"]  # a placeholder: daphne refuses an empty list
    server = GatewayServer(
        application,
        endpoints,
        grace=grace,
        stall_timeout=settings.CROSSBAR["STREAM_IDLE_TIMEOUT"],
        adopted=given[:2] if given is not None else None,
        lifeline=given[2] if given is not None else None,
    )
    server.run()
    _finish_tasks(asyncio.get_event_loop())  # the loop daphne ran, now stopped


def _finish_tasks(loop: asyncio.AbstractEventLoop) -> None:
    """Cancel and run out whatever the stop left on the loop, then close it.

    Suspended tasks left for the interpreter to collect at exit can crash it (seen with
    Python 3.11), and the recorder's final write runs after that, at exit.
    """
    for _ in range(3):  # cancelled tasks may start others (closing an upstream response)
        pending = asyncio.all_tasks(loop)
        if not pending:
            break
        for task in pending:
            task.cancel()
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
    loop.run_until_complete(loop.shutdown_asyncgens())
    loop.close()
