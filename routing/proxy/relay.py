"""The upstream body on its way to the client, chunk for chunk, at the host's pace.

The relay only moves bytes: it tells the request's lifecycle when the host is done with
(`host_done`: its slot goes back while a slow client still reads the buffer) and how the
answer ended (`end`, with an `Outcome`); what is learnt from the answer, and the row, are the
lifecycle's (routing/proxy/lifecycle.py).
"""

from __future__ import annotations

import asyncio
import json
from collections import deque
from typing import Any, Protocol

import httpx

from hosts.failures import failure
from routing.core import sse
from routing.core.background import spawn
from routing.core.errors import Answer
from routing.core.fairness import Work
from routing.core.running import RunningRequest, data_events
from routing.core.tee import Tee
from routing.proxy.record import Outcome, work_done

# How far a client may fall behind its host: bytes read from the host that the client's
# connection has not taken yet (the server's write buffer, 64 KiB, and the kernel's socket
# buffers hold more, uncounted). A whole completion fits, so a slow reader does not hold the
# host's slot: llama-server's chat SSE events are 150-250 bytes per token (one token's delta,
# the id, the model's name, the timestamp), so 1 MiB holds 4,000-7,000 tokens. It is also what
# one stream whose client lags can cost in memory; a client further behind is cut.
BUFFER_BYTES = 1 << 20
# A client whose server `send` has not come back for this long (its connection's buffers are
# full) gets a pump: a task that reads the host into the buffer meanwhile. Until then the
# client's own task reads the host, so a client that keeps up pays no task switch per chunk.
# The socket buffers between the host and the gateway take seconds of a generation meanwhile.
AWAY = 0.5


def close_soon(upstream: httpx.Response) -> None:
    """Close a host's response in a held background task (for a caller that cannot await)."""
    spawn(upstream.aclose(), "crossbar-close-upstream")


class Ending(Protocol):
    """Who hears how the relayed answer goes: the request's lifecycle."""

    def host_done(self, work: Work | None = None) -> None:
        """The host is done with (its stream ended, failed, or was cut): its slot back, after
        the request's key is charged `work` (what the host did, when known). The relay may say
        so more than once; only the first counts."""

    def end(self, outcome: Outcome) -> None:
        """The request has ended, so (once)."""


class Relay:
    """The upstream body as an async iterator for StreamingHttpResponse.

    Yields the host's chunks unchanged and in order (the tee only looks) and enforces the idle
    timeout on reads of the host. The request ends exactly once, from whichever comes first:
    the body's end, a failure, the client's disconnect (the read is cancelled), `close()` (the
    response is closed by the handler without having been read to its end), or a client too
    slow to read. Ending closes the upstream response and hands the `Outcome` to `life.end`.

    The host is read at its own pace, not the client's. While the client keeps up, its own task
    reads the host and each chunk goes out as it arrives. A client away in the server's `send`
    for `AWAY` (its connection full: every server's `send` waits then, crossbar_site/serve.py)
    gets a pump task that reads the host into a buffer of up to `BUFFER_BYTES` meanwhile; the
    client's task then takes chunks from the buffer. When the host's stream ends, its slot is
    freed at once while the client still reads the buffer; the row is written when the client
    has it all (or leaves), with the host's outcome. A client that falls further behind than
    the buffer is cut: the upstream is closed, the slot freed, a 499 `client_too_slow` row
    written, and the client's task cancelled, so that its server closes the connection (its
    `send` may wait on a client that reads nothing at all). So is a client that has taken
    nothing for the idle timeout (a 499 `client_disconnected` row), whether or not the host is
    done: what the buffer held is freed with it.

    One watchdog timer does all the watching, not an `asyncio.timeout` per read or per `send`
    (which cost ~9 µs per chunk in `make bench`): each read notes when it started, and each
    chunk handed to the client when it was handed over. The timer wakes at the first moment
    one of those marks can have run out (at most `AWAY` apart until there is a pump): it
    cancels a read of the host that has waited the idle timeout, starts the pump for a client
    away `AWAY`, and cuts a client away the idle timeout. Time the client takes to accept a
    chunk never counts as a stalled host.
    """

    __slots__ = (
        "_upstream", "_chunks", "_life", "_tee", "_host", "_idle", "_loop", "_status",
        "_closed", "_client", "_read_since", "_given", "_watchdog", "_interrupt", "_running",
        "_pump", "_buffer", "_buffered", "_more", "_outcome",
    )  # fmt: skip

    def __init__(
        self,
        upstream: httpx.Response,
        life: Ending,
        host: str,
        idle: float,
        running: RunningRequest | None = None,
    ) -> None:
        """`host`: the host's name, for the errors it is named in; `idle`: the idle timeout;
        `running`: the request's line among the running requests, whose tokens it counts."""
        self._upstream = upstream
        self._chunks = upstream.aiter_raw()
        self._life = life
        self._tee = Tee(upstream.headers.get("content-type", ""))
        self._host = host
        self._idle = idle
        self._loop = asyncio.get_running_loop()
        self._status = upstream.status_code
        self._closed = False  # the request has ended: its row is written
        self._client: asyncio.Task[Any] | None = None  # the task that iterates this body
        self._read_since: float | None = None  # when the pending read began; None between reads
        # When the client's task took its last chunk to send; None while it asks for the next.
        self._given: float | None = None
        self._watchdog: asyncio.TimerHandle | None = None
        # Why the reader was cancelled, when the relay itself cancelled it: the host stalled,
        # or the slot was lost (status, message, code). None: the client left.
        self._interrupt: tuple[int, str, str] | None = None
        # Tokens so far, for the dashboard's running requests: one per SSE event read.
        self._running = running if self._tee.streamed else None
        self._pump: asyncio.Task[None] | None = None
        self._buffer: deque[bytes] = deque()  # read from the host by the pump, not yet passed on
        self._buffered = 0
        self._more: asyncio.Future[None] | None = None  # the client's task waits for the pump
        self._outcome: tuple[int, str, str] | None = None  # how the host's stream ended (pump)

    @property
    def streamed(self) -> bool:
        """Whether the host answers with an SSE stream."""
        return self._tee.streamed

    def __aiter__(self) -> Relay:
        return self

    async def __anext__(self) -> bytes:
        if self._closed:
            raise StopAsyncIteration
        if self._interrupt is not None:  # the slot was lost before the body began
            return await self._fail(*self._interrupt)
        self._given = None
        if self._pump is not None:
            chunk = await self._buffered_chunk()
            self._given = self._loop.time()
            return chunk
        self._read_since = self._loop.time()
        if self._watchdog is None:
            self._client = asyncio.current_task()
            self._watchdog = self._loop.call_at(
                self._read_since + min(self._idle, AWAY), self._watch
            )
        try:
            chunk = await anext(self._chunks)
        except StopAsyncIteration:
            await self._close(self._status)
            raise
        except httpx.HTTPError as exc:
            return await self._fail(502, self._broken(exc))
        except asyncio.CancelledError:
            interrupt = self._interrupt
            if interrupt is not None and self._client is not None and self._client.uncancel() == 0:
                return await self._fail(*interrupt)
            self._abandon("client disconnected mid-stream")
            raise
        self._read_since = None
        self._given = self._loop.time()
        self._look(chunk)
        return chunk

    def close(self) -> None:
        """The response is done with, read to its end or not (Django's resource closer)."""
        self._abandon("client disconnected")

    def _look(self, chunk: bytes) -> None:
        self._tee.feed(chunk)
        if self._running is not None:
            self._running.tokens += data_events(chunk)

    def _watch(self) -> None:
        """The watchdog: cancel a read of the host that has waited the idle timeout, cut a
        client that has been away in `send` as long, start the pump for one away `AWAY`; then
        look again when the first of those can next be due."""
        if self._closed:
            return
        now = self._loop.time()
        since, given, streaming = self._read_since, self._given, self._outcome is None
        if streaming and since is not None and now - since >= self._idle:
            self._interrupt = (504, self._silent(), "upstream_failed")
            self._cancel_reader()
            return
        if given is not None and now - given >= self._idle:
            self._stalled()
            return
        then = (given or now) + self._idle
        if streaming:
            then = min(then, (since or now) + self._idle)
            if self._pump is None:
                if given is not None and now - given >= AWAY:
                    self._start_pump()
                else:
                    then = min(then, (given or now) + AWAY)
        self._watchdog = self._loop.call_at(then, self._watch)

    def lost(self) -> None:
        """The shared state stopped counting this request's slot (its process was cut off past
        the hold TTL and another took the slot): the host may be running more than `parallel`,
        so the stream ends now, with an error the client and the row can read."""
        if self._closed or self._outcome is not None:
            return  # over already: the host's stream ended, and the slot was given back
        message = (
            f"slot on host {self._host} lost: this gateway lost touch with the shared "
            "state past its hold TTL and another request took the slot"
        )
        self._interrupt = (503, message, "slot_lost")
        self._cancel_reader()

    def _cancel_reader(self) -> None:
        reader = self._pump or self._client
        if reader is not None:
            reader.cancel()

    def _start_pump(self) -> None:
        self._pump = spawn(self._pump_host(), "crossbar-pump")

    async def _pump_host(self) -> None:
        """Read the rest of the host's stream into the buffer, as fast as the host writes it."""
        try:
            while True:
                self._read_since = self._loop.time()
                try:
                    chunk = await anext(self._chunks)
                except StopAsyncIteration:
                    self._host_done(self._status)
                    return
                except httpx.HTTPError as exc:
                    self._host_done(502, self._broken(exc), "upstream_failed")
                    return
                except asyncio.CancelledError:
                    pump, interrupt = self._pump, self._interrupt
                    if interrupt is None or pump is None or pump.uncancel() != 0:
                        raise  # the request ended: the client left, or the server stops
                    self._host_done(*interrupt)
                    return
                self._read_since = None
                self._look(chunk)
                self._buffer.append(chunk)
                self._buffered += len(chunk)
                self._wake()
                if self._buffered > BUFFER_BYTES:
                    mib = BUFFER_BYTES / 2**20
                    self._cut(f"client too slow: fell more than {mib:g} MiB behind the host",
                              "client_too_slow")  # fmt: skip
                    return
        finally:
            self._life.host_done(self._work())
            await self._upstream.aclose()

    def _host_done(self, status: int, error: str = "", code: str = "") -> None:
        """The host's stream ended: the request's outcome, once the client has the buffer."""
        if error and self._tee.streamed:
            self._buffer.append(sse.error_event(Answer(status, error, "server_error", code)))
        self._outcome = (status, error, code)
        self._wake()

    def _cut(self, message: str, code: str) -> None:
        """End the request of a client too far behind the host, or away too long."""
        self._buffer.clear()
        self._end(499, message, code)
        if self._client is not None:
            # Its task waits in the server's `send`, maybe for a client that reads nothing: the
            # cancel ends the response unfinished, and the server closes the connection.
            self._client.cancel()

    def _stalled(self) -> None:
        """End the request of a client that has taken nothing for the idle timeout."""
        self._cut(f"client read nothing for {self._idle:g} s: response cut", "client_disconnected")
        if self._pump is not None:
            self._pump.cancel()  # it closes the upstream; done already if the host's stream was
        else:
            close_soon(self._upstream)

    def _wake(self) -> None:
        more = self._more
        if more is not None and not more.done():
            more.set_result(None)

    async def _buffered_chunk(self) -> bytes:
        """The next chunk the pump read, once there is one; the end once the host's stream
        ended and the client has had it all."""
        try:
            if self._buffer:
                # A turn of the loop per chunk for a client that is behind: `send` to a closed
                # connection returns at once, and a disconnect must get its turn to be heard.
                await asyncio.sleep(0)
            while not self._buffer:
                if self._outcome is not None:
                    self._end(*self._outcome)
                    raise StopAsyncIteration
                self._more = self._loop.create_future()
                await self._more
        except asyncio.CancelledError:
            self._abandon("client disconnected mid-stream")
            raise
        chunk = self._buffer.popleft()
        self._buffered -= len(chunk)
        return chunk

    def _broken(self, exc: httpx.HTTPError) -> str:
        return f"host {self._host} failed mid-stream: {failure(exc)}"

    def _silent(self) -> str:
        return f"host {self._host} sent nothing for {self._idle:g} s mid-stream"

    async def _fail(self, status: int, message: str, code: str = "upstream_failed") -> bytes:
        """End a broken stream (the host's failure, or a lost slot): an SSE client gets one
        error event, then the end."""
        await self._close(status, message, code)
        if not self._tee.streamed:
            raise StopAsyncIteration
        return sse.error_event(Answer(status, message, "server_error", code))

    async def error_message(self) -> str:
        """Read a failed answer's body (bounded), close it, and say what the host said."""
        body = b""
        try:
            async with asyncio.timeout(self._idle):
                async for chunk in self._chunks:
                    body += chunk
                    if len(body) > 65536:
                        break
        except (TimeoutError, httpx.HTTPError):
            pass
        message = f"host {self._host} answered {self._status}"
        try:
            detail = json.loads(body)["error"]["message"]
            message = f"{message}: {detail}"
        except (ValueError, KeyError, TypeError):
            pass
        await self._close(self._status, message, "upstream_error")
        return message

    async def _close(self, status: int, error: str = "", code: str = "") -> None:
        if self._closed:
            return
        self._end(status, error, code)
        await self._upstream.aclose()

    def _abandon(self, error: str) -> None:
        """The client is gone (cancelled, or the response closed unread): end now. A failure of
        the host's that came first stays the request's outcome."""
        if self._closed:
            return
        outcome = self._outcome if self._outcome is not None else self._interrupt
        if outcome is not None and outcome[0] >= 400:
            self._end(*outcome)
        else:
            self._end(499, error, "client_disconnected")
        if self._pump is not None:
            self._pump.cancel()  # it closes the upstream; done already if the host's stream was
        else:
            close_soon(self._upstream)

    def _work(self) -> Work:
        """What the host did, from what the tee saw of its answer: read once no chunk is to
        come, so the key is charged before its slot goes to the next in line."""
        return work_done(self._tee.usage())

    def _end(self, status: int, error: str, code: str) -> None:
        self._closed = True
        if self._watchdog is not None:
            self._watchdog.cancel()
        self._life.host_done(self._work())
        if not code and status >= 400:
            code = "upstream_error"  # the host's own error answer, passed through as it is
        self._life.end(Outcome(status, error, code, self._tee.usage(), self._tee.prompt_ms()))
