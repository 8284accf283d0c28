"""The body of a waiting stream (`StatusStream`), driven directly, at moments a real client
cannot hit on purpose: here, leaving just as the host's response head arrives.

The stream runs on a real `Runtime` (its limiter holds the slot) and reads the request's
lifecycle through what it offers a status stream: `waiting`, `trail`, `through()`, `relay()`,
`fail` and `end`. The host is a stand-in for the lifecycle's `forward` that answers when the
test says, so the test knows the answer is in while the body has not yet taken it up.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any, cast

import httpx
import pytest

from accounting.models import Request
from accounting.recorder import get_recorder
from routing.config.shape import FleetConfig, HostConfig, ModelConfig, RouteConfig
from routing.core.limiter import Slot
from routing.core.pairs import Pair
from routing.core.placement import Waiting
from routing.core.prefixes import NO_PREFIX
from routing.proxy.ask import Ask
from routing.proxy.lifecycle import Lifecycle
from routing.proxy.record import Arrival, Trail
from routing.proxy.waiting import StatusStream
from routing.runtime import Runtime
from tests.helpers.fleet import MODEL

pytestmark = pytest.mark.django_db(transaction=True)
ROUTE = "status-stream-test"  # this module's rows: the session gateway may write others


class _Body(httpx.AsyncByteStream):
    """A host's response body that is never read; says when it is closed."""

    def __init__(self) -> None:
        self.closed = asyncio.Event()

    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield b""

    async def aclose(self) -> None:
        self.closed.set()


class _AnswerOnCue:
    """A host that answers when `answer()` is called (the lifecycle's `forward`)."""

    def __init__(self) -> None:
        self.body = _Body()
        self.asking = asyncio.Event()
        self._head = asyncio.Event()
        self._answered = asyncio.Event()

    async def forward(self, *_: object) -> httpx.Response:
        self.asking.set()
        await self._head.wait()
        self._answered.set()  # in the step that returns: `through()` is over when it is seen
        return httpx.Response(200, stream=self.body)

    async def answer(self) -> None:
        """Let the host's head arrive; return once `through()` has returned it."""
        self._head.set()
        await self._answered.wait()


class _AnswerThoughCancelled(_AnswerOnCue):
    """A host call that loses its cancellation and answers anyway, as one whose Redis call
    ended as the cancellation came did on Python 3.11 (its asyncio.wait_for drops it)."""

    async def forward(self, *_: object) -> httpx.Response:
        self.asking.set()
        try:
            await self._head.wait()
        except asyncio.CancelledError:
            pass
        return httpx.Response(200, stream=self.body)


def _ask() -> Ask:
    """A streamed chat of no conversation (no lease, no slot of its own to name)."""
    return cast(Ask, SimpleNamespace(
        model=MODEL, fingerprint="", prefix=NO_PREFIX, takes_slot=True, host="",
        names_slot=False, payload=None,
    ))  # fmt: skip


async def _placed(runtime: Runtime, host: _AnswerOnCue) -> Lifecycle:
    """The lifecycle of a request placed on gpu1, whose host is `host`."""
    route = runtime.fleet.routes[ROUTE]
    trail = Trail(Arrival(), route=ROUTE, model=MODEL, streamed=True)
    life = Lifecycle(trail, runtime, route, forward=cast(Any, host.forward))
    await life.place(_ask())
    assert runtime.state.in_flight("gpu1", MODEL) == 1
    return life


def _fleet() -> FleetConfig:
    host = HostConfig(
        name="gpu1",
        url="http://127.0.0.1:9",  # never asked: a stand-in answers for the host
        weight=1.0,
        enabled=True,
        draining=False,
        api_key="",
        models={MODEL: ModelConfig(MODEL, "", parallel=1, queue_max=1)},
    )
    route = RouteConfig(
        name=ROUTE,
        default_model=MODEL,
        lease_ttl=60,
        strict=False,
        enabled=True,
        hosts=("gpu1",),
        wait_status=True,
    )
    return FleetConfig(hosts={"gpu1": host}, routes={ROUTE: route}, revision=0)


async def _leave_as_the_head_arrives() -> tuple[bytes, int]:
    """The frame the client read, and the slots in flight once it left and the host's
    response was closed."""
    runtime = Runtime(_fleet(), 0)
    try:
        host = _AnswerOnCue()
        stream = StatusStream(await _placed(runtime, host))

        frame = await anext(aiter(stream))  # the client has "running", and reads no more
        await host.answer()  # the head is in; the body has not resumed to take it up
        stream.close()  # the client is gone

        await asyncio.wait_for(host.body.closed.wait(), timeout=10)
        return frame, runtime.state.in_flight("gpu1", MODEL)
    finally:
        await runtime.aclose()


def test_a_client_leaving_as_the_hosts_head_arrives_gives_back_the_slot_and_closes_the_answer(
    settings,
):
    # The local limiter; "running" is said on the first keepalive once the host is asked.
    settings.CROSSBAR = {**settings.CROSSBAR, "REDIS_URL": "", "KEEPALIVE": 0.05}

    frame, in_flight = asyncio.run(_leave_as_the_head_arrives())

    assert frame == b": crossbar-status: running\n\n"
    assert in_flight == 0
    assert get_recorder().flush()
    rows = Request.objects.filter(route=ROUTE)
    assert [(row.status, row.host, row.error) for row in rows] == [
        (499, "gpu1", "client disconnected while queued")
    ]


async def _leave_a_passage_that_answers_anyway() -> int:
    """The slots in flight once the client left a request whose host answered after all."""
    runtime = Runtime(_fleet(), 0)
    try:
        host = _AnswerThoughCancelled()
        stream = StatusStream(await _placed(runtime, host))

        await anext(aiter(stream))  # "running"
        await host.asking.wait()
        stream.close()  # the client is gone while the host is asked

        await asyncio.wait_for(host.body.closed.wait(), timeout=10)
        return runtime.state.in_flight("gpu1", MODEL)
    finally:
        await runtime.aclose()


def test_a_client_leaving_a_passage_that_answers_anyway_gets_its_slot_and_answer_given_back(
    settings,
):
    settings.CROSSBAR = {**settings.CROSSBAR, "REDIS_URL": "", "KEEPALIVE": 0.05}

    in_flight = asyncio.run(_leave_a_passage_that_answers_anyway())

    assert in_flight == 0
    assert get_recorder().flush()
    rows = Request.objects.filter(route=ROUTE)
    assert [(row.status, row.error) for row in rows] == [(499, "client disconnected while queued")]


async def _running_after_a_grant_while_the_client_reads() -> list[bytes]:
    """The frames a client reads when its slot is granted while it holds `waiting 1`."""
    runtime = Runtime(_fleet(), 0)
    try:
        route = runtime.fleet.routes[ROUTE]
        other = await runtime.state.place([Pair("gpu1", MODEL)])  # another request's slot
        assert isinstance(other, Slot)
        body = _Body()

        async def host_answers(*_: object) -> httpx.Response:
            return httpx.Response(200, stream=body)

        trail = Trail(Arrival(), route=ROUTE, model=MODEL, streamed=True)
        life = Lifecycle(trail, runtime, route, forward=host_answers)
        await life.place(_ask())
        first = life.waiting
        assert isinstance(first, Waiting) and first.host == "gpu1"
        status = StatusStream(life)
        stream = aiter(status)
        frames = [await anext(stream)]  # `waiting 1`: the client holds it, reads nothing more
        other.release()  # the slot goes to this request meanwhile
        # Without a wake the next frame would come a keepalive (10 minutes here) later.
        frames.append(await asyncio.wait_for(anext(stream), timeout=60))
        status.close()  # the client leaves: the slot and the host's answer are given back
        await asyncio.wait_for(body.closed.wait(), timeout=10)
        assert runtime.state.in_flight("gpu1", MODEL) == 0
        return frames
    finally:
        await runtime.aclose()


def test_a_slot_granted_while_the_client_reads_its_place_is_announced_at_once(settings):
    settings.CROSSBAR = {**settings.CROSSBAR, "REDIS_URL": "", "KEEPALIVE": 600.0}

    frames = asyncio.run(_running_after_a_grant_while_the_client_reads())

    assert frames == [b": crossbar-status: waiting 1\n\n", b": crossbar-status: running\n\n"]
