"""daphne, as crossbar serves with it: backpressure, bounded request bodies, cut responses.

`GatewayServer` is daphne's `Server` with five changes, each a thing no ASGI application can do
on daphne (the rest of crossbar's guards are the application's, the same on every server:
crossbar_site/lifecycle.py, crossbar_site/handler.py, routing/proxy/relay.py):

- **Backpressure.** Daphne's `send` writes into Twisted's transport and returns at once, so a
  client that reads slowly makes the gateway buffer the whole upstream response in memory (a
  long generation read by a stalled client: hundreds of MB). Here `send` of a body chunk returns
  only once the connection's write buffer is below Twisted's high-water mark (64 KiB), using
  Twisted's own push-producer protocol, as uvicorn's `send` does; the proxy meanwhile reads the
  host into its own bounded buffer, and cuts a client that falls behind it or reads nothing
  (routing/proxy/relay.py).
- **Unfinished responses end the connection.** An application that returns before its
  response's end (the proxy cut a client, or the stop cut a request) gets the connection
  aborted, as uvicorn closes it; daphne alone would keep it open.
- **Short bodies end the connection.** When a host fails in the middle of a whole (non-SSE)
  answer, the proxy ends the body early; the response already declared the host's
  Content-Length, so a finished response would leave the client waiting for bytes that never
  come. Such a response closes its connection instead: the client sees an incomplete body.
- **Bounded request bodies.** Daphne calls the application only once a request's whole body
  has arrived: Twisted spools it to a temporary file, and daphne then hands all of it over at
  once, in memory. Here at most `BODY_CAP` bytes of a body are kept and the rest is read and
  dropped, so the proxy still sees "too large" (413, with its row) while a huge or endless
  upload costs bandwidth, not memory or disk. (On uvicorn, which hands the body over as it
  arrives, the application stops reading at the cap and answers at once.)
- **A time limit on request heads.** Twisted's idle timeout restarts at every byte, so a head
  trickled a line at a time held its connection forever: each connection's channel gives a
  head `CROSSBAR_HEAD_TIMEOUT` seconds (crossbar_site/heads.py).

It listens on a socket it is given (crossbar_site/serve.py binds it) and stops as
crossbar_site/lifecycle.py says, at SIGTERM or SIGINT; daphne's own command line stops the
reactor at once, dropping every stream.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import weakref
from http import HTTPStatus
from typing import Any

# Twisted's asyncio reactor is installed by daphne.server, which Django's app loading already
# imported (the daphne app): the reactor imported below is that one.
from daphne.http_protocol import HTTPFactory, WebRequest
from daphne.server import Server
from twisted.internet import reactor, tcp
from twisted.internet.endpoints import AdoptedStreamServerEndpoint
from twisted.internet.interfaces import IDelayedCall, IListeningPort, IPushProducer
from twisted.internet.protocol import connectionDone
from twisted.python.failure import Failure
from twisted.web import http

# The proxy HTTPFactory puts in front of each connection (to switch protocols after TLS's
# negotiation): the one way to give it a channel of another class.
from twisted.web.http import _GenericHTTPChannelProtocol
from zope.interface import implementer

from crossbar_site import heads
from crossbar_site.handler import BODY_CAP
from crossbar_site.lifecycle import GracefulStop, close_runtime, start_runtime

log = logging.getLogger("crossbar.serve")

_FLUSH_WAIT = 5.0  # seconds the last bytes of finished responses may take to leave at a stop


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


class _HeadTimedChannel(http.HTTPChannel):
    """Twisted's HTTP connection, giving each request's head `head_timeout()` seconds to
    arrive whole (crossbar_site/heads.py says what the clock covers): from the connection's
    opening, then from the first byte after each request, until the head's end."""

    _head_clock: IDelayedCall | None = None
    _in_request = False  # from a head's end to its request's end: the clock stops

    def connectionMade(self) -> None:
        super().connectionMade()
        self._start_head_clock()

    def dataReceived(self, data: bytes) -> None:
        if not self._in_request and self._head_clock is None:
            self._start_head_clock()  # the first byte of a kept-alive connection's next head
        super().dataReceived(data)

    def allHeadersReceived(self) -> None:
        self._stop_head_clock()
        self._in_request = True
        super().allHeadersReceived()

    def requestDone(self, request: Any) -> None:
        self._in_request = False
        super().requestDone(request)

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self._stop_head_clock()
        super().connectionLost(reason)

    def _start_head_clock(self) -> None:
        self._head_clock = reactor.callLater(heads.head_timeout(), self._head_late)

    def _stop_head_clock(self) -> None:
        if self._head_clock is not None and self._head_clock.active():
            self._head_clock.cancel()
        self._head_clock = None

    def _head_late(self) -> None:
        self._head_clock = None
        if self.transport is not None:
            self.transport.write(heads.late())
            self.transport.loseConnection()


class _HTTPFactory(HTTPFactory):
    def protocol(self) -> Any:  # Twisted's HTTPFactory calls this for each connection
        return _GenericHTTPChannelProtocol(_HeadTimedChannel())

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
    """Daphne's server with backpressure, capped request bodies and aborted unfinished
    responses, serving one listening socket until `GracefulStop` ends it."""

    def __init__(
        self,
        application: Any,
        listening: socket.socket,
        *,
        grace: float,
        lifeline: int | None = None,
    ) -> None:
        self.listening = listening
        self.lifeline = lifeline  # a worker's: reads end-of-file once its supervisor is gone
        self.ports: list[IListeningPort] = []
        self._responses: weakref.WeakKeyDictionary[WebRequest, _Response] = (
            weakref.WeakKeyDictionary()
        )
        self.stop_gracefully = GracefulStop(
            grace, stop_listening=self._stop_listening, stop=self._stop
        )
        # daphne refuses an empty list of endpoints; `run` listens on the socket instead.
        super().__init__(
            application,
            endpoints=[f"fd:fileno={listening.fileno()}"],
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
        reactor.callLater(0, self._started)  # inside the loop, once it runs
        # daphne listens on endpoint strings only, whose "fd:" form cannot say IPv6 (and scans
        # Twisted's plugins): the socket is listened on directly.
        self.endpoints: list[str] = []
        reactor.callLater(0, self._listen)
        super().run()

    def _started(self) -> None:
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self.stop_gracefully.begin, signal.Signals(signum).name)
        if self.lifeline is not None:
            self.stop_gracefully.watch_lifeline(self.lifeline)
        start_runtime()

    def _listen(self) -> None:
        # Twisted listens on a duplicate of the socket: this copy goes, so that stopping to
        # listen closes the port.
        with self.listening:
            endpoint = AdoptedStreamServerEndpoint(
                reactor, self.listening.fileno(), self.listening.family
            )
            listening = endpoint.listen(self.http_factory)
        listening.addCallback(self.listen_success)
        listening.addErrback(self.listen_error)

    def listen_success(self, port: IListeningPort) -> None:
        super().listen_success(port)
        self.ports.append(port)

    def create_application(self, protocol: Any, scope: dict[str, Any]) -> Any:
        queue = super().create_application(protocol, scope)
        instance = self.connections.get(protocol, {}).get("application_instance")
        if instance is not None and isinstance(protocol, WebRequest):
            instance.add_done_callback(lambda _: self._returned(protocol))
        return queue

    def _returned(self, protocol: WebRequest) -> None:
        """An application that returned before its response's end (a client cut) leaves a
        connection daphne would keep open: close it, without waiting for a client that may
        read nothing to take what its write buffer holds."""
        if self._responses.pop(protocol, None) is not None and protocol.channel is not None:
            protocol.channel.transport.abortConnection()

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
                writable = response.watch(protocol)
                if writable is not None and not writable.event.is_set():
                    # As long as it takes: the proxy cuts a client that reads nothing.
                    await writable.event.wait()
            return
        await super().handle_reply(protocol, message)

    # -- the graceful stop's two steps ---------------------------------------------------

    def _stop_listening(self) -> None:
        for port in self.ports:
            port.stopListening()

    async def _stop(self) -> None:
        # Finished responses may still sit in the write buffers of slow readers: let them leave.
        for _ in range(int(_FLUSH_WAIT / 0.05)):
            if not _unsent():
                break
            await asyncio.sleep(0.05)
        await close_runtime()
        log.info("stopped")
        reactor.stop()


def _unsent() -> int:
    """Client connections with response bytes not yet handed to the kernel."""
    return sum(1 for writer in reactor.getWriters() if isinstance(writer, tcp.Server))


def run(application: Any, listening: socket.socket, *, grace: float, lifeline: int | None) -> None:
    """Serve `application` on the listening socket until the graceful stop ends. Blocks."""
    GatewayServer(application, listening, grace=grace, lifeline=lifeline).run()
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
