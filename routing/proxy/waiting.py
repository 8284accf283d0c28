"""A queued stream that hears how its wait goes: a view of the passage, not a second copy.

With wait status on, a streaming request that must queue gets its `200` head at once. Its body
then says, as SSE comments (which every SSE client ignores), where it waits
(`: crossbar-status: waiting 2`) whenever its place changes and at least every
`CROSSBAR_KEEPALIVE` seconds, `loading` when its model is being loaded on a router-mode host,
`fallback <route>` and `running` once it holds a slot, and then carries the host's stream. A
failure after the head went out becomes one `data:` error event; the row records the real
outcome.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from hosts.describe import ModelState
from routing.core import sse
from routing.core.errors import Answer, answer_for
from routing.proxy.passage import Answered, Passage
from routing.proxy.record import finish
from routing.proxy.refusal import counted_where_it_happened, explained
from routing.proxy.relay import Relay
from routing.runtime import Runtime


class StatusStream:
    """The body of a waiting stream. Ends its request exactly once: at its end, or `close()`."""

    __slots__ = ("_passage", "_runtime", "_task", "_relay", "_ended", "_frames")

    def __init__(self, passage: Passage, runtime: Runtime) -> None:
        self._passage = passage
        self._runtime = runtime
        self._task: asyncio.Task[Answered] | None = None
        self._relay: Relay | None = None
        self._ended = False  # the request was finished here (error event or close)
        self._frames = self._run()

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self

    async def __anext__(self) -> bytes:
        return await anext(self._frames)

    def close(self) -> None:
        """The response is done with: end the request if nothing else has."""
        if self._relay is not None:
            self._relay.close()
            return
        if self._ended:
            return
        self._ended = True
        waiting = self._passage.waiting
        if waiting is not None:
            # The wait may never have started (the body never ran, or its task not yet):
            # give its place back here, and a slot handed over meanwhile.
            granted = waiting.waiter.cancel()
            if granted is not None:
                granted.release()
        task = self._task
        if task is not None:
            if task.done():
                _give_back(task)  # a host may have answered just as the client left
            else:
                task.cancel()  # the passage gives back its place, or the slot it got ...
                # ... unless the cancellation is lost on its way (a library that swallows
                # one, as Python 3.11's asyncio.wait_for can) and the passage answers anyway.
                task.add_done_callback(_give_back)
        finish(self._passage.trail, 499, "client disconnected while queued", "client_disconnected")

    async def _run(self) -> AsyncIterator[bytes]:
        passage, keepalive = self._passage, self._runtime.keepalive
        loop = asyncio.get_running_loop()
        task = self._task = loop.create_task(passage.through())
        said: int | None = None
        said_at = loop.time()
        announced = said_loading = False
        while not task.done():
            waiting = passage.waiting
            if waiting is None:
                if not announced and passage.trail.host:
                    announced = True
                    for frame in self._placed_frames():
                        yield frame
                if not said_loading and self._loading(passage.trail.host):
                    said_loading = True
                    yield sse.comment("loading")
                # Asking the host (bounded by the headers timeout); a router may be loading.
                await asyncio.wait((task,), timeout=keepalive)
                continue
            announced = False
            if waiting.waiter.granted.done():
                await asyncio.sleep(0)  # the passage takes it from here, this turn or the next
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
            if waiting.waiter.granted.done() or passage.waiting is not waiting:
                continue  # it changed while the client read the last frame: look again now
            try:
                async with asyncio.timeout(max(0.0, said_at + keepalive - loop.time())):
                    await changes.wait()
            except TimeoutError:
                pass
        try:
            answered = task.result()
        except Exception as exc:
            exc = explained(self._runtime, passage.route, passage.trail.model or None, exc)
            answer = answer_for(exc)
            self._ended = True
            trail = counted_where_it_happened(passage.trail, exc)
            finish(trail, answer.status, answer.message, answer.code)
            yield sse.error_event(answer)
            return
        if not announced:
            for frame in self._placed_frames():
                yield frame
        placement = answered.placement
        relay = self._relay = Relay(
            answered.upstream, placement.slot if placement else None, answered.trail, self._runtime
        )
        if answered.upstream.status_code != 200:
            # The client already has a 200 head: the host's error goes out as an error event.
            message = await relay.error_message()
            status = answered.upstream.status_code
            yield sse.error_event(Answer(status, message, "server_error", "upstream_error"))
            return
        async for chunk in relay:
            yield chunk

    def _loading(self, host: str) -> bool:
        """Whether the request's model is being loaded on `host` (a router-mode host), as its
        last health poll said."""
        config = self._runtime.fleet.hosts.get(host)
        spec = config.models.get(self._passage.trail.model) if config is not None else None
        described = self._runtime.health.get(host).described
        if spec is None or described is None or not described.router:
            return False
        state = described.models.get(spec.upstream_name or spec.name)
        return state in (ModelState.LOADING, ModelState.UNLOADED)

    def _placed_frames(self) -> list[bytes]:
        fallback = self._passage.trail.fallback
        frames = [sse.comment(f"fallback {fallback}")] if fallback else []
        frames.append(sse.comment("running"))
        return frames


def _give_back(task: asyncio.Task[Answered]) -> None:
    """What a passage answered to a client that has left: its slot and the host's response."""
    if task.cancelled() or task.exception() is not None:
        return  # the passage gave back what it held itself
    task.result().give_back()
