"""A queued stream that hears how its wait goes: a view of the request's lifecycle, not a
second copy of it.

With wait status on, a streaming request that must queue gets its `200` head at once. Its body
then says, as SSE comments (which every SSE client ignores), where it waits
(`: crossbar-status: waiting 2`) whenever its place changes and at least every
`CROSSBAR_KEEPALIVE` seconds, `loading` when its model is being loaded on a router-mode host
(crossbar's load it waits for, or the host's own),
`fallback <route>` and `running` once it holds a slot, and then carries the host's stream. A
failure after the head went out becomes one `data:` error event; the row records the real
outcome (the lifecycle's `fail`, as for any request).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from hosts.describe import ModelState
from routing.core import sse
from routing.core.errors import Answer
from routing.proxy.lifecycle import Answered, Lifecycle
from routing.proxy.record import Outcome
from routing.proxy.relay import Relay
from routing.proxy.respond import StreamedResponse, set_placement_headers


def waiting_response(life: Lifecycle) -> StreamedResponse:
    """The head now (200, SSE), the wait's status comments, then the host's stream."""
    life.streams_status()
    response = StreamedResponse(StatusStream(life))
    response["Content-Type"] = "text/event-stream"
    response["Cache-Control"] = "no-cache"
    set_placement_headers(response, life.trail)
    return response


class StatusStream:
    """The body of a waiting stream. Ends its request exactly once: at its end, or `close()`."""

    __slots__ = ("_life", "_task", "_relay", "_announced", "_frames")

    def __init__(self, life: Lifecycle) -> None:
        self._life = life
        self._task: asyncio.Task[Answered] | None = None
        self._relay: Relay | None = None
        self._announced = False  # the client has `running` for the slot the request holds
        self._frames = self._run()

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self

    async def __anext__(self) -> bytes:
        return await anext(self._frames)

    def close(self) -> None:
        """The response is done with: end the request if nothing else has. The lifecycle gives
        back what it holds: a place in line the wait has not taken up yet (the body never ran,
        or its task not yet), and a slot and a host's answer that come after all."""
        if self._relay is not None:
            self._relay.close()
            return
        task = self._task
        if task is not None and not task.done():
            task.cancel()  # the wait gives back its place, or the slot it got
        self._life.end(Outcome(499, "client disconnected while queued", "client_disconnected"))

    async def _run(self) -> AsyncIterator[bytes]:
        life = self._life
        task = self._task = asyncio.get_running_loop().create_task(life.through())
        async for frame in self._while_waiting(task):
            yield frame
        try:
            status = task.result().upstream.status_code
        except Exception as exc:
            yield sse.error_event(life.fail(exc))
            return
        if not self._announced:
            for frame in self._placed_frames():
                yield frame
        relay = self._relay = life.relay()
        if status != 200:
            # The client already has a 200 head: the host's error goes out as an error event.
            message = await relay.error_message()
            yield sse.error_event(Answer(status, message, "server_error", "upstream_error"))
            return
        async for chunk in relay:
            yield chunk

    async def _while_waiting(self, task: asyncio.Task[Answered]) -> AsyncIterator[bytes]:
        """The status comments until `task` (the request's `through()`) is done: its place in
        line when it changes and every keepalive, `loading`, and `running` once placed."""
        life, keepalive = self._life, self._life.runtime.keepalive
        loop = asyncio.get_running_loop()
        said: int | None = None
        said_at = loop.time()
        said_loading = False
        while not task.done():
            waiting = life.waiting
            if waiting is None:
                if not self._announced and life.trail.host and not life.loading:
                    self._announced = True
                    for frame in self._placed_frames():
                        yield frame
                if not said_loading and (life.loading or self._loading(life.trail.host)):
                    said_loading = True
                    yield sse.comment("loading")
                # Asking the host (bounded by the headers timeout); a router may be loading.
                await asyncio.wait((task,), timeout=keepalive)
                continue
            self._announced = False
            if waiting.waiter.granted.done():
                await asyncio.sleep(0)  # the wait takes it from here, this turn or the next
                continue
            position = waiting.waiter.position
            if position != said or loop.time() - said_at >= keepalive:
                said, said_at = position, loop.time()
                yield sse.comment(f"waiting {position}")
                if not said_loading and self._loading(waiting.host):
                    said_loading = True
                    yield sse.comment("loading")
            changes = waiting.waiter.changes()
            changes.clear()
            if waiting.waiter.granted.done() or life.waiting is not waiting:
                continue  # it changed while the client read the last frame: look again now
            try:
                async with asyncio.timeout(max(0.0, said_at + keepalive - loop.time())):
                    await changes.wait()
            except TimeoutError:
                pass

    def _loading(self, host: str) -> bool:
        """Whether the request's model is being loaded on `host` (a router-mode host), as its
        last health poll said."""
        config = self._life.runtime.fleet.hosts.get(host)
        spec = config.models.get(self._life.trail.model) if config is not None else None
        described = self._life.runtime.health.get(host).described
        if spec is None or described is None or not described.router:
            return False
        state = described.models.get(spec.upstream_name or spec.name)
        return state in (ModelState.LOADING, ModelState.UNLOADED)

    def _placed_frames(self) -> list[bytes]:
        fallback = self._life.trail.fallback
        frames = [sse.comment(f"fallback {fallback}")] if fallback else []
        frames.append(sse.comment("running"))
        return frames
