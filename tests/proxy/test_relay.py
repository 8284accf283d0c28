"""The relay, the piece that hands the host's bytes to the client: whatever chunks the host's
answer arrives in, the client gets the same chunks, byte for byte, and the row the same token
counts. No server and no database: a made-up upstream response and a stand-in exchange."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any, cast
from unittest import mock

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from routing.core.patience import Figures
from routing.core.tee import Usage
from routing.proxy import lifecycle as lifecycle_module
from routing.proxy.lifecycle import Answered, Lifecycle
from routing.proxy.record import Arrival, Trail
from routing.runtime import Runtime
from tests.helpers.relay import Ends, relayed
from tests.helpers.sse_streams import streams

SSE = "text/event-stream"


class _Upstream(httpx.AsyncByteStream):
    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks:
            yield chunk


def relay(chunks: list[bytes], content_type: str) -> tuple[list[bytes], tuple[object, ...]]:
    """What the client receives through a relay, and what the exchange was finished with."""

    async def run() -> tuple[list[bytes], tuple[object, ...]]:
        upstream = httpx.Response(
            200, headers={"content-type": content_type}, stream=_Upstream(chunks)
        )
        ends = Ends()
        with mock.patch.object(lifecycle_module, "finish", ends):
            received = [chunk async for chunk in relayed(upstream)]
        (outcome,) = ends.finished
        return received, outcome

    return asyncio.run(run())


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    cuts = sorted(cuts)
    return [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]


@given(stream=streams(), data=st.data())
def test_any_chunking_of_a_stream_reaches_the_client_unchanged_with_the_same_counts(
    stream: bytes, data: st.DataObject
) -> None:
    chunks = split(stream, data.draw(st.lists(st.integers(0, len(stream)), max_size=20)))

    received, outcome = relay(chunks, SSE)

    assert received == [chunk for chunk in chunks if chunk]
    assert outcome == relay([stream], SSE)[1]
    assert outcome[0] == 200 and outcome[1] == ""


_counts = st.none() | st.integers(min_value=0, max_value=100_000)


@given(
    usage=st.fixed_dictionaries(
        {"prompt_tokens": _counts, "completion_tokens": _counts},
        optional={"prompt_tokens_details": st.fixed_dictionaries({"cached_tokens": _counts})},
    ),
    text=st.text(max_size=50),
    data=st.data(),
)
def test_any_chunking_of_a_whole_json_answer_reaches_the_client_unchanged_with_the_same_counts(
    usage: dict[str, Any], text: str, data: st.DataObject
) -> None:
    body = json.dumps(
        {"choices": [{"message": {"content": text}}], "usage": usage}, ensure_ascii=False
    ).encode()
    chunks = split(body, data.draw(st.lists(st.integers(0, len(body)), max_size=20)))

    received, outcome = relay(chunks, "application/json")

    assert b"".join(received) == body
    assert outcome == relay([body], "application/json")[1]
    assert outcome[3] == Usage(
        usage["prompt_tokens"],
        (usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
        usage["completion_tokens"],
    )


class _Slot:
    """A held slot that counts its releases."""

    def __init__(self) -> None:
        self.releases = 0

    def release(self) -> None:
        self.releases += 1


def test_a_response_that_cannot_be_built_gives_back_the_slot_and_closes_the_hosts_answer():
    """Between the slot taken and the response handed to the server, the lifecycle owns them:
    whatever raises there (here Django refusing the host's status, which placement lets
    through to no other caller) is answered by its `fail`, which gives both back, once."""

    async def run() -> tuple[_Slot, bool, list[tuple[object, ...]]]:
        upstream = httpx.Response(999, headers={"content-type": SSE}, stream=_Upstream([]))
        slot = _Slot()
        trail = Trail(Arrival(), host="gpu1")
        runtime = SimpleNamespace(stream_idle_timeout=5.0, figures=Figures())
        life = Lifecycle(trail, cast(Runtime, runtime))
        life.answered(Answered(upstream, cast(Any, SimpleNamespace(slot=slot)), trail))
        ends = Ends()
        with mock.patch.object(lifecycle_module, "finish", ends):
            with pytest.raises(ValueError, match="HTTP status code") as failed:
                life.respond(frozenset())
            life.fail(failed.value)
            life.fail(failed.value)  # a second ending changes nothing
        # The host's answer is closed in a background task: let it run.
        await asyncio.gather(*asyncio.all_tasks() - {asyncio.current_task()})
        return slot, upstream.is_closed, ends.finished

    slot, closed, finished = asyncio.run(run())

    assert slot.releases == 1 and closed
    assert [outcome[:3] for outcome in finished] == [
        (500, "internal gateway error", "internal_error")
    ]
