"""The upstream body on its way to the client, chunk for chunk."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import httpx

from routing.core import sse
from routing.core.errors import Answer, describe_error
from routing.core.running import data_events
from routing.core.state import Held
from routing.core.tee import Tee
from routing.proxy.record import Trail, finish
from routing.runtime import Runtime


class Relay:
    """The upstream body as an async iterator for StreamingHttpResponse.

    Yields each upstream chunk unchanged (the tee only looks) and enforces the idle timeout
    between chunks. The request ends exactly once, from whichever comes first: the body's end,
    a failure, the client's disconnect (the read is cancelled), or `close()` (the response is
    closed by the handler without having been read to the end). Ending frees the slot, closes
    the upstream response and finishes the record.

    The idle timeout is a watchdog timer, not an `asyncio.timeout` per read (which cost ~9 µs
    per chunk in `make bench`): each read only notes when it started, and the timer, which
    wakes about once per idle period, cancels the read that has waited too long. Time the
    client takes to accept a chunk does not count: that is backpressure, not a stalled host.
    """

    __slots__ = (
        "_upstream", "_chunks", "_slot", "_tee", "_trail", "_idle", "_loop", "_status",
        "_closed", "_task", "_read_since", "_watchdog", "_stalled", "_running",
    )  # fmt: skip

    def __init__(
        self, upstream: httpx.Response, slot: Held | None, trail: Trail, runtime: Runtime
    ) -> None:
        self._upstream = upstream
        self._chunks = upstream.aiter_raw()
        self._slot = slot
        self._tee = Tee(upstream.headers.get("content-type", ""))
        self._trail = replace(trail, streamed=trail.streamed or self._tee.streamed)
        self._idle = runtime.stream_idle_timeout
        self._loop = asyncio.get_running_loop()
        self._status = upstream.status_code
        self._closed = False
        self._task: asyncio.Task[object] | None = None
        self._read_since: float | None = None  # when the pending read began; None between reads
        self._watchdog: asyncio.TimerHandle | None = None
        self._stalled = False
        # Tokens so far, for the dashboard's running requests: one per SSE event passed on.
        self._running = trail.running if self._tee.streamed else None

    @property
    def streamed(self) -> bool:
        """Whether the host answers with an SSE stream."""
        return self._tee.streamed

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
            message = f"host {self._trail.host} failed mid-stream: {describe_error(exc)}"
            return await self._fail(502, message)
        except asyncio.CancelledError:
            if self._stalled and self._task is not None and self._task.uncancel() == 0:
                message = f"host {self._trail.host} sent nothing for {self._idle:g} s mid-stream"
                return await self._fail(504, message)
            self._abandon(499, "client disconnected mid-stream")
            raise
        self._read_since = None
        self._tee.feed(chunk)
        if self._running is not None:
            self._running.tokens += data_events(chunk)
        return chunk

    def close(self) -> None:
        """The response is done with, read to its end or not (Django's resource closer)."""
        self._abandon(499, "client disconnected")

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
        await self._close(status, message, "upstream_failed")
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
        message = f"host {self._trail.host} answered {self._status}"
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

    def _abandon(self, status: int, error: str) -> None:
        """End now and close the upstream in the background (cancelled, or closed unread)."""
        if self._closed:
            return
        self._end(status, error, "client_disconnected")
        self._loop.create_task(self._upstream.aclose())

    def _end(self, status: int, error: str, code: str) -> None:
        self._closed = True
        if self._watchdog is not None:
            self._watchdog.cancel()
        if self._slot is not None:
            self._slot.release()
        if not code and status >= 400:
            code = "upstream_error"  # the host's own error answer, passed through as it is
        finish(self._trail, status, error, code, self._tee.usage())
