"""A burst of new conversations is served up to the fleet's room, and only the rest is refused.

Placement takes a slot or a queue place in one step, so no request is refused while another
host of the route still has room; these run through the gateway as `make run` serves it.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import httpx
import pytest
from django.utils import timezone

from accounting.models import Request
from tests.fakes.llama_server import FakeLlamaServer
from tests.helpers.fleet import MODEL, add_host, add_route, chat
from tests.helpers.waits import wait_until

pytestmark = pytest.mark.django_db(transaction=True)


async def _burst(url: str, count: int) -> list[httpx.Response]:
    """`count` streaming new conversations sent at the same instant, each read to its end."""
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=None)) as client:
        start_line = asyncio.Barrier(count)  # all go once the last one is there

        async def one(number: int) -> httpx.Response:
            await start_line.wait()
            body = chat(f"conversation {number}", stream=True, max_tokens=20)
            response = await client.post(url, json=body)
            return response

        return await asyncio.gather(*(one(n) for n in range(count)))


def _fleet(fakes: list[FakeLlamaServer], rooms: list[tuple[int, int]]) -> None:
    """A route over `fakes`, gpu1, gpu2, ...; `rooms` gives each its (parallel, queue_max)."""
    hosts = [
        add_host(f"gpu{n}", fake.url, models={MODEL: room})
        for n, (fake, room) in enumerate(zip(fakes, rooms, strict=True), 1)
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
    _fleet(slow_fakes, [(1, 1)] * 3)
    gateway.sync()
    started = timezone.now()

    responses = asyncio.run(_burst(f"{gateway.url}/chat/v1/chat/completions", 9))

    assert Counter(r.status_code for r in responses) == {200: 6, 503: 3}
    refused = [r for r in responses if r.status_code == 503]
    assert {r.json()["error"]["code"] for r in refused} == {"queue_full"}
    served = Counter(r.headers["x-crossbar-host"] for r in responses if r.status_code == 200)
    assert served == {"gpu1": 2, "gpu2": 2, "gpu3": 2}
    assert max(fake.max_concurrent for fake in slow_fakes) == 1
    mine = Request.objects.filter(started__gte=started)  # an earlier test's row may still land
    rows = wait_until(lambda: mine.count() == 9 and mine.all(), what="rows")
    assert Counter(row.status for row in rows) == {200: 6, 503: 3}


def test_twelve_streams_on_two_hosts_with_two_slots_and_two_places_serve_eight(gateway, slow_fakes):
    _fleet(slow_fakes[:2], [(2, 2)] * 2)
    gateway.sync()

    responses = asyncio.run(_burst(f"{gateway.url}/chat/v1/chat/completions", 12))

    assert Counter(r.status_code for r in responses) == {200: 8, 503: 4}
    served = Counter(r.headers["x-crossbar-host"] for r in responses if r.status_code == 200)
    assert served == {"gpu1": 4, "gpu2": 4}
    assert max(fake.max_concurrent for fake in slow_fakes[:2]) == 2


def test_a_burst_fills_every_slot_and_then_the_line_of_the_host_that_has_one(gateway, slow_fakes):
    # gpu1 ranks first whenever both are full (route order), but has no line: the requests
    # that find every slot taken must queue on gpu2, not be refused.
    _fleet(slow_fakes[:2], [(2, 0), (2, 4)])
    gateway.sync()

    responses = asyncio.run(_burst(f"{gateway.url}/chat/v1/chat/completions", 10))

    assert Counter(r.status_code for r in responses) == {200: 8, 503: 2}
    served = [r for r in responses if r.status_code == 200]
    at_once = [r for r in served if r.headers["x-crossbar-queued-ms"] == "0"]
    assert Counter(r.headers["x-crossbar-host"] for r in at_once) == {"gpu1": 2, "gpu2": 2}
    assert Counter(r.headers["x-crossbar-host"] for r in served) == {"gpu1": 2, "gpu2": 6}
    assert [fake.max_concurrent for fake in slow_fakes[:2]] == [2, 2]
