"""The relay's idle timeout: a host that stalls mid-stream ends the stream; a slow client
does not count as a stalled host."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import httpx

from routing.proxy.relay import Relay
from tests.helpers.relay import Ends, relayed

FIRST = b'data: {"choices": [{"delta": {"content": "hi"}}]}\n\n'


class _Stalling(httpx.AsyncByteStream):
    """One chunk, then nothing until `resume` is set, then a second chunk."""

    def __init__(self) -> None:
        self.resume = asyncio.Event()
        self.closed = asyncio.Event()

    async def aclose(self) -> None:
        self.closed.set()

    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield FIRST
        await self.resume.wait()
        yield b"data: [DONE]\n\n"


def make_relay(upstream: _Stalling, idle: float) -> Relay:
    response = httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=upstream)
    return relayed(response, idle=idle)


async def test_a_host_silent_past_the_idle_timeout_ends_the_stream_with_an_error_event(ends: Ends):
    relay = make_relay(_Stalling(), idle=0.2)

    received = [chunk async for chunk in relay]

    assert received[0] == FIRST
    assert len(received) == 2
    event = json.loads(received[1].removeprefix(b"data: "))
    assert event["error"]["code"] == "upstream_failed" and "0.2 s" in event["error"]["message"]
    assert ends.finished[0][:2] == (504, event["error"]["message"])
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]  # the watchdog's cancel was taken back (a test runs as a task)


async def test_time_the_client_takes_to_read_is_not_counted_as_the_hosts_silence(ends: Ends):
    upstream = _Stalling()
    relay = make_relay(upstream, idle=1.0)

    first = await anext(relay)
    await asyncio.sleep(0.6)  # a slow client: the relay is not reading meanwhile
    asyncio.get_running_loop().call_later(0.6, upstream.resume.set)  # 1.2 s after the first
    rest = [chunk async for chunk in relay]

    assert first == FIRST and rest == [b"data: [DONE]\n\n"]
    assert ends.finished[0][0] == 200


async def test_a_client_that_takes_nothing_for_the_idle_timeout_is_cut(ends: Ends):
    upstream = _Stalling()
    relay = make_relay(upstream, idle=0.2)

    async def client_stuck_in_send() -> None:
        await anext(relay)
        await asyncio.Event().wait()  # its server's `send`, to a client that reads nothing

    client = asyncio.create_task(client_stuck_in_send())
    done, _ = await asyncio.wait([client], timeout=10)

    assert done == {client} and client.cancelled()  # the server ends its connection
    (outcome,) = ends.finished
    status, error, code = outcome[:3]
    assert (status, error, code) == (499, "client read nothing for 0.2 s: response cut",
                                     "client_disconnected")  # fmt: skip
    await asyncio.wait_for(upstream.closed.wait(), 5)  # closed in a task of its own


async def test_a_client_that_leaves_is_not_taken_for_a_stall(ends: Ends):
    relay = make_relay(_Stalling(), idle=5)

    first = asyncio.Event()

    async def consume() -> None:
        async for _ in relay:
            first.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(first.wait(), 10)  # mid-stream: the host's first chunk read
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)

    assert ends.finished[0][:2] == (499, "client disconnected mid-stream")
