"""The upstream body on its way to the client, chunk for chunk."""

from __future__ import annotations

import asyncio
import json

import httpx

from routing.core import sse
from routing.core.errors import Answer, describe_error
from routing.core.limiter import Slot
from routing.core.running import data_events
from routing.core.tee import Tee
from routing.proxy.exchange import Exchange
from routing.runtime import Runtime


class Relay:
    """The upstream body as an async iterator for StreamingHttpResponse.

    Yields each upstream chunk unchanged (the tee only looks), enforces the idle timeout
    between chunks, and when the body ends, fails or is abandoned, closes the upstream
    response, frees the slot and finishes the exchange, once.

    Django may stop iterating without telling the iterator (a client that leaves while
    Django awaits the socket): `__del__` covers that, handing the cleanup to the loop.

    The idle timeout is a watchdog timer, not an `asyncio.timeout` per read (which cost ~9 µs
    per chunk in `make bench`): each read only notes when it started, and the timer, which
    wakes about once per idle period, cancels the read that has waited too long. Time the
    client takes to accept a chunk does not count: that is backpressure, not a stalled host.
    """

    __slots__ = (
        "_upstream", "_chunks", "_slot", "_tee", "_exchange", "_idle", "_loop", "_status",
        "_closed", "_task", "_read_since", "_watchdog", "_stalled", "_running",
    )  # fmt: skip

    def __init__(
        self, upstream: httpx.Response, slot: Slot | None, exchange: Exchange, runtime: Runtime
    ) -> None:
        self._upstream = upstream
        self._chunks = upstream.aiter_raw()
        self._slot = slot
        self._tee = Tee(upstream.headers.get("content-type", ""))
        self._exchange = exchange
        self._idle = runtime.stream_idle_timeout
        self._loop = asyncio.get_running_loop()
        self._status = upstream.status_code
        self._closed = False
        self._task: asyncio.Task[object] | None = None
        self._read_since: float | None = None  # when the pending read began; None between reads
        self._watchdog: asyncio.TimerHandle | None = None
        self._stalled = False
        exchange.streamed = exchange.streamed or self._tee.streamed
        # Tokens so far, for the dashboard's running requests: one per SSE event passed on.
        self._running = runtime.running if self._tee.streamed and exchange.running else None

    def __aiter__(self) -> Relay:
        return self

    async def __anext__(self) -> bytes:
        if self._closed:
            raise StopAsyncIteration
        self._read_since = self._loop.time()
        if self._watchdog is None:
            self._task = asyncio.current_task()
            self._watchdog = self._loop.call_at(self._read_since + self._idle, self._watch)
        try:
            chunk = await anext(self._chunks)
        except StopAsyncIteration:
            await self._close(self._status)
            raise
        except httpx.HTTPError as exc:
            message = f"host {self._exchange.host} failed mid-stream: {describe_error(exc)}"
            return await self._fail(502, message)
        except asyncio.CancelledError:
            if self._stalled and self._task is not None and self._task.uncancel() == 0:
                message = f"host {self._exchange.host} sent nothing for {self._idle:g} s mid-stream"
                return await self._fail(504, message)
            self._abandon(499, "client disconnected mid-stream")
            raise
        self._read_since = None
        self._tee.feed(chunk)
        if self._running is not None and self._exchange.running is not None:
            self._running.token(self._exchange.running, data_events(chunk))
        return chunk

    def _watch(self) -> None:
        """The watchdog: cancel a read that has waited the idle timeout, else look again."""
        if self._closed:
            return
        now = self._loop.time()
        since = self._read_since
        if since is None or now - since < self._idle:
            self._watchdog = self._loop.call_at((since or now) + self._idle, self._watch)
            return
        self._stalled = True
        if self._task is not None:
            self._task.cancel()

    async def _fail(self, status: int, message: str) -> bytes:
        """End a stream the host broke: an SSE client gets one error event, then the end."""
        await self._close(status, message)
        if not self._tee.streamed:
            raise StopAsyncIteration
        return sse.error_event(Answer(status, message, "server_error", "upstream_failed"))

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
        message = f"host {self._exchange.host} answered {self._status}"
        try:
            detail = json.loads(body)["error"]["message"]
            message = f"{message}: {detail}"
        except (ValueError, KeyError, TypeError):
            pass
        await self._close(self._status, message)
        return message

    async def _close(self, status: int, error: str = "") -> None:
        if self._closed:
            return
        self._release(status, error)
        await self._upstream.aclose()

    def _release(self, status: int, error: str) -> None:
        self._closed = True
        if self._watchdog is not None:
            self._watchdog.cancel()
        if self._slot is not None:
            self._slot.release()
        usage = self._tee.usage()
        self._exchange.finish(
            status, error, usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens
        )

    def _abandon(self, status: int, error: str) -> None:
        """Finish now and close the upstream in the background (cancelled or dropped)."""
        if self._closed:
            return
        self._release(status, error)
        self._loop.create_task(self._upstream.aclose())

    def __del__(self) -> None:
        if not self._closed and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._abandon, 499, "client disconnected")
