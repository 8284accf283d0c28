"""A burst of new conversations is served up to the fleet's room, and only the rest is refused.

Placement takes a slot or a queue place in one step, so no request is refused while another
host of the route still has room; these run through the gateway as `make run` serves it.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import httpx
import pytest

from accounting.models import Request
from tests.conftest import wait_until
from tests.fakes.llama_server import FakeLlamaServer
from tests.fleet import MODEL, add_host, add_route, chat

pytestmark = pytest.mark.django_db(transaction=True)


async def _burst(url: str, count: int) -> list[httpx.Response]:
    """`count` streaming new conversations sent at the same instant, each read to its end."""
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=None)) as client:
        start = asyncio.Event()

        async def one(number: int) -> httpx.Response:
            await start.wait()
            body = chat(f"conversation {number}", stream=True, max_tokens=20)
            response = await client.post(url, json=body)
            return response

        tasks = [asyncio.create_task(one(n)) for n in range(count)]
        await asyncio.sleep(0.2)  # every task waits at the start line
        start.set()
        return await asyncio.gather(*tasks)


def _fleet(fakes: list[FakeLlamaServer], parallel: int, queue_max: int) -> None:
    hosts = [
        add_host(f"gpu{n}", fake.url, models={MODEL: (parallel, queue_max)})
        for n, fake in enumerate(fakes, 1)
    ]
    add_route("chat", hosts, lease_patience=60)


@pytest.fixture
def slow_fakes():
    """Three fake hosts whose answers take about a second, so a burst overlaps."""
    servers = [FakeLlamaServer(slots=4, token_delay=0.05) for _ in range(3)]
    for server in servers:
        server.start()
    yield servers
    for server in servers:
        server.stop()


def test_nine_new_conversations_on_three_hosts_with_one_slot_and_one_place_serve_six(
    gateway, slow_fakes
):
    _fleet(slow_fakes, parallel=1, queue_max=1)
    gateway.sync()

    responses = asyncio.run(_burst(f"{gateway.url}/chat/v1/chat/completions", 9))

    assert Counter(r.status_code for r in responses) == {200: 6, 503: 3}
    refused = [r for r in responses if r.status_code == 503]
    assert {r.json()["error"]["code"] for r in refused} == {"queue_full"}
    served = Counter(r.headers["x-crossbar-host"] for r in responses if r.status_code == 200)
    assert served == {"gpu1": 2, "gpu2": 2, "gpu3": 2}
    assert max(fake.max_concurrent for fake in slow_fakes) == 1
    rows = wait_until(lambda: Request.objects.count() == 9 and Request.objects.all(), what="rows")
    assert Counter(row.status for row in rows) == {200: 6, 503: 3}


def test_twelve_streams_on_two_hosts_with_two_slots_and_two_places_serve_eight(
    gateway, slow_fakes
):
    _fleet(slow_fakes[:2], parallel=2, queue_max=2)
    gateway.sync()

    responses = asyncio.run(_burst(f"{gateway.url}/chat/v1/chat/completions", 12))

    assert Counter(r.status_code for r in responses) == {200: 8, 503: 4}
    served = Counter(r.headers["x-crossbar-host"] for r in responses if r.status_code == 200)
    assert served == {"gpu1": 4, "gpu2": 4}
    assert max(fake.max_concurrent for fake in slow_fakes[:2]) == 2
