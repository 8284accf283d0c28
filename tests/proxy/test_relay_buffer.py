"""The relay's buffer: a client that lags gets the host's stream from a buffer the host fills at
its own pace, so the host's slot is freed when the host is done; a client further behind than
the buffer is cut. No server: a made-up upstream, a stand-in slot and a stand-in record (the
end-to-end tests over real sockets are in test_slow_reader.py)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from routing.proxy import lifecycle as lifecycle_module
from routing.proxy import relay as relay_module
from routing.proxy.relay import BUFFER_BYTES, Relay
from tests.helpers.relay import Ends, relayed

AWAY = 0.005  # a client away 5-10 ms gets a pump, so that the tests run quickly
EVENT = b'data: {"choices": [{"delta": {"content": "tok "}}]}\n\n'


class _Slot:
    def __init__(self) -> None:
        self.released = asyncio.Event()
        self.releases = 0

    def release(self) -> None:
        self.releases += 1
        self.released.set()


class _Host(httpx.AsyncByteStream):
    """`chunks`, each one read away (a socket read suspends), then an optional failure."""

    def __init__(self, chunks: list[bytes], fail: bool = False) -> None:
        self.chunks = chunks
        self.fail = fail
        self.closed = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks:
            await asyncio.sleep(0)
            yield chunk
        if self.fail:
            raise httpx.ReadError("connection reset by peer")

    async def aclose(self) -> None:
        self.closed = True


def make_relay(host: httpx.AsyncByteStream, slot: _Slot) -> Relay:
    response = httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=host)
    return relayed(response, slot)


@pytest.fixture
def ends(ends: Ends, monkeypatch: pytest.MonkeyPatch) -> Ends:
    """tests/proxy/conftest.py's, with a client away for AWAY seconds given a pump."""
    monkeypatch.setattr(relay_module, "AWAY", AWAY)
    return ends


async def test_a_lagging_client_gets_every_byte_after_the_hosts_slot_is_freed(ends: Ends):
    chunks = [EVENT] * 2000
    slot = _Slot()
    relay = make_relay(_Host(chunks), slot)

    first = await anext(relay)
    async with asyncio.timeout(5):  # the client is away (its `send` blocked) meanwhile
        await slot.released.wait()
    assert ends.finished == []  # the row waits for the client
    rest = [chunk async for chunk in relay]

    assert [first, *rest] == chunks
    assert slot.releases == 1
    assert len(ends.finished) == 1 and ends.finished[0][:3] == (200, "", "")


async def test_a_client_further_behind_than_the_buffer_is_cut(ends: Ends):
    host = _Host([b"x" * 65536] * (BUFFER_BYTES // 65536 + 2))
    slot = _Slot()
    relay = make_relay(host, slot)

    async def client() -> None:
        async for _ in relay:
            await asyncio.Event().wait()  # a `send` to a client that reads nothing

    task = asyncio.create_task(client())
    async with asyncio.timeout(5):
        await asyncio.gather(task, return_exceptions=True)

    assert task.cancelled()  # so that its server closes the connection
    (outcome,) = ends.finished
    assert outcome[0] == 499 and outcome[2] == "client_too_slow" and "too slow" in str(outcome[1])
    assert slot.releases == 1 and host.closed


async def test_a_host_that_fails_while_the_client_lags_gives_the_buffer_then_one_error_event(
    ends: Ends,
):
    chunks = [EVENT] * 100
    slot = _Slot()
    relay = make_relay(_Host(chunks, fail=True), slot)

    first = await anext(relay)
    async with asyncio.timeout(5):
        await slot.released.wait()
    rest = [chunk async for chunk in relay]

    assert [first, *rest[:-1]] == chunks
    event = json.loads(rest[-1].removeprefix(b"data: "))
    assert event["error"]["code"] == "upstream_failed"
    (outcome,) = ends.finished
    assert outcome[0] == 502 and outcome[1] == event["error"]["message"]


async def test_a_client_that_leaves_while_reading_the_buffer_is_recorded_as_gone(ends: Ends):
    slot = _Slot()
    relay = make_relay(_Host([EVENT] * 100), slot)

    await anext(relay)
    async with asyncio.timeout(5):
        await slot.released.wait()
    await anext(relay)
    relay.close()

    (outcome,) = ends.finished
    assert outcome[:3] == (499, "client disconnected", "client_disconnected")
    assert slot.releases == 1


@settings(max_examples=25, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 300), min_size=1, max_size=60),
    pauses=st.lists(st.sampled_from([0.0, 0.0, 0.0, 3 * AWAY]), max_size=60),
)
def test_any_pace_of_the_client_gets_the_same_bytes_and_outcome(
    sizes: list[int], pauses: list[float]
) -> None:
    chunks = [bytes([65 + i % 26]) * size for i, size in enumerate(sizes)]

    async def run() -> tuple[list[bytes], list[tuple[object, ...]]]:
        ends = Ends()
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(lifecycle_module, "finish", ends)
            patch.setattr(relay_module, "AWAY", AWAY)
            relay = make_relay(_Host(chunks), _Slot())
            received = []
            async for chunk in relay:
                received.append(chunk)
                if len(received) <= len(pauses) and pauses[len(received) - 1]:
                    await asyncio.sleep(pauses[len(received) - 1])  # a `send` that waits
        return received, ends.finished

    received, finished = asyncio.run(run())

    assert received == chunks
    assert [outcome[:3] for outcome in finished] == [(200, "", "")]


class _LosableSlot(_Slot):
    """A slot its backing can stop counting, as a shared state's after a stall (`on_lost`)."""

    def __init__(self) -> None:
        super().__init__()
        self.lose: Callable[[], None] | None = None

    def on_lost(self, callback: Callable[[], None]) -> None:
        self.lose = callback


class _EndlessHost(httpx.AsyncByteStream):
    """A host that streams until it is closed."""

    def __init__(self) -> None:
        self.closed = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while True:
            await asyncio.sleep(0.001)
            yield EVENT

    async def aclose(self) -> None:
        self.closed = True


@pytest.mark.parametrize("lagging", [False, True], ids=["keeping up", "lagging"])
async def test_a_lost_slot_ends_the_stream_with_one_error_event_and_closes_the_host(
    ends: Ends, lagging: bool
):
    slot = _LosableSlot()
    host = _EndlessHost()
    relay = make_relay(host, slot)
    received = [await anext(relay), await anext(relay)]
    if lagging:
        await asyncio.sleep(10 * AWAY)  # away in `send`: the pump reads the host meanwhile
    assert slot.lose is not None
    asyncio.get_running_loop().call_soon(slot.lose)  # the shared state says: not yours now

    async with asyncio.timeout(5):
        received += [chunk async for chunk in relay]

    assert set(received[:-1]) == {EVENT}
    error = json.loads(received[-1].removeprefix(b"data: "))["error"]
    assert error["code"] == "slot_lost" and "gpu1" in error["message"]
    (outcome,) = ends.finished
    assert (outcome[0], outcome[2]) == (503, "slot_lost")
    assert host.closed


async def test_a_slot_lost_before_the_body_is_read_answers_only_the_error(ends: Ends):
    slot = _LosableSlot()
    relay = make_relay(_Host([EVENT] * 10), slot)
    assert slot.lose is not None
    slot.lose()

    received = [chunk async for chunk in relay]

    (event,) = received
    assert json.loads(event.removeprefix(b"data: "))["error"]["code"] == "slot_lost"
    assert [outcome[:1] + outcome[2:3] for outcome in ends.finished] == [(503, "slot_lost")]
