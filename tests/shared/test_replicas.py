"""Two gateway processes sharing one Redis behave like one gateway, as clients and hosts see it.

Each test starts its own redis-server and two gateways as `make run` serves them (daphne,
`manage.py crossbar_serve`) with the same `CROSSBAR_REDIS_URL` and database, in front of fake
llama-servers over real sockets.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import signal
import threading
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest
import redis
from django.utils import timezone

from accounting.models import Request
from tests.fakes.llama_server import FakeLlamaServer
from tests.helpers.asking import issue, post
from tests.helpers.fleet import MODEL, add_host, add_route, chat
from tests.helpers.gateway import two_gateways
from tests.helpers.invariants import Ledger, wait_until_free
from tests.helpers.soak import Faults, load
from tests.helpers.waits import eventually, wait_until

pytestmark = pytest.mark.django_db(transaction=True)

CHAT = "/chat/v1/chat/completions"


@pytest.fixture
def slow_fake() -> Iterator[FakeLlamaServer]:
    """A fake host whose 20-token answers take about a second, so requests overlap."""
    with FakeLlamaServer(slots=8, token_delay=0.05) as server:
        yield server


async def _burst(urls: list[str]) -> list[httpx.Response]:
    """One streaming new conversation per URL, all sent at the same instant, read to the end."""
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=None)) as client:
        start = asyncio.Event()
        lined_up, at_the_line = asyncio.Event(), 0

        async def one(number: int, url: str) -> httpx.Response:
            nonlocal at_the_line
            at_the_line += 1
            if at_the_line == len(urls):
                lined_up.set()
            await start.wait()
            body = chat(f"conversation {number}", stream=True, max_tokens=20)
            return await client.post(url, json=body)

        tasks = [asyncio.create_task(one(n, url)) for n, url in enumerate(urls)]
        await lined_up.wait()  # every task waits at the start line
        start.set()
        return await asyncio.gather(*tasks)


def test_eight_streams_through_two_gateways_get_two_slots_two_places_and_four_refusals(
    tmp_path, redis_url, slow_fake
):
    add_route("chat", [add_host("gpu1", slow_fake.url, models={MODEL: (2, 2)})])
    since = timezone.now()

    with two_gateways(tmp_path, redis_url) as (first, second):
        urls = [gateway.url + CHAT for gateway in (first, second)] * 4
        responses = asyncio.run(_burst(urls))

    assert Counter(r.status_code for r in responses) == {200: 4, 503: 4}
    refused = [r for r in responses if r.status_code == 503]
    assert {r.json()["error"]["code"] for r in refused} == {"queue_full"}
    assert slow_fake.max_concurrent == 2  # never more than the host's slots, over both
    rows = Request.objects.filter(started__gte=since)
    wait_until(lambda: rows.count() == 8, what="eight rows")
    assert Counter(rows.values_list("status", flat=True)) == {200: 4, 503: 4}


async def _queued(
    client: httpx.AsyncClient, url: str, content: str, said: list[str], heard: asyncio.Event
) -> None:
    """A stream that asks for wait status; records the first comment it hears, then reads on."""
    body = chat(content, stream=True, max_tokens=5)
    headers = {"X-Crossbar-Wait-Status": "on"}
    async with client.stream("POST", url, json=body, headers=headers) as response:
        async for line in response.aiter_lines():
            if not heard.is_set() and line.startswith(":"):
                said.append(f"{content} {line}")
                heard.set()
        assert response.status_code == 200


def test_a_queue_is_first_in_first_out_across_gateways(tmp_path, redis_url):
    with FakeLlamaServer(slots=4, token_delay=0.05) as fake:
        add_route("chat", [add_host("gpu1", fake.url, models={MODEL: (1, 2)})])
        with two_gateways(tmp_path, redis_url) as (first, second):

            async def holding() -> bool:
                return fake.in_flight >= 1

            async def scene() -> list[str]:
                said: list[str] = []
                async with httpx.AsyncClient(timeout=60) as client:
                    holder = asyncio.create_task(
                        client.post(first.url + CHAT, json=chat("holder", max_tokens=40))
                    )
                    await eventually(holding, "the holder to take the host's one slot")
                    heard = asyncio.Event()
                    early = asyncio.create_task(
                        _queued(client, second.url + CHAT, "early", said, heard)
                    )
                    await heard.wait()  # queued in Redis before the next one asks
                    late = asyncio.create_task(
                        _queued(client, first.url + CHAT, "late", said, asyncio.Event())
                    )
                    await asyncio.gather(holder, early, late)
                return said

            said = asyncio.run(scene())

    assert said == ["early : crossbar-status: waiting 1", "late : crossbar-status: waiting 2"]
    posts = [seen.json for seen in fake.seen if seen.method == "POST"]
    contents = [post["messages"][-1]["content"] for post in posts if isinstance(post, dict)]
    assert contents == ["holder", "early", "late"]  # served in the order they queued


def test_a_conversations_next_turn_through_the_other_gateway_reuses_its_host(
    tmp_path, redis_url, fake, fake2
):
    add_route("chat", [add_host("gpu1", fake.url), add_host("gpu2", fake2.url)])

    with two_gateways(tmp_path, redis_url) as (first, second):
        turns = []
        for number in range(4):
            opening = httpx.post(first.url + CHAT, json=chat(f"conversation {number}"))
            history = chat(f"conversation {number}")
            history["messages"] += [
                opening.json()["choices"][0]["message"],
                {"role": "user", "content": "and then?"},
            ]
            following = httpx.post(second.url + CHAT, json=history)
            turns.append((opening, following))

    for opening, following in turns:
        assert (opening.status_code, following.status_code) == (200, 200)
        assert opening.headers["x-crossbar-lease"] == "new"
        assert following.headers["x-crossbar-lease"] == "reused"
        assert following.headers["x-crossbar-host"] == opening.headers["x-crossbar-host"]


def test_a_gateway_killed_mid_stream_gives_its_slot_back_within_the_expiry(tmp_path, redis_url):
    with FakeLlamaServer(slots=4, token_delay=0.05) as fake:
        add_route("chat", [add_host("gpu1", fake.url, models={MODEL: (1, 0)})])
        with two_gateways(tmp_path, redis_url) as (doomed, survivor):
            with httpx.stream(
                "POST", doomed.url + CHAT, json=chat("long", stream=True, max_tokens=2000),
                timeout=30,
            ) as stream:  # fmt: skip
                lines = stream.iter_lines()  # kept: a dropped generator closes the stream
                next(lines)  # it holds the host's one slot now
                while_held = httpx.post(survivor.url + CHAT, json=chat("meanwhile"))
                doomed.process.send_signal(signal.SIGKILL)
                doomed.process.wait(timeout=10)

            recovered = wait_until(
                lambda: (
                    (r := httpx.post(survivor.url + CHAT, json=chat("after"))).status_code == 200
                    and r
                ),
                timeout=20,
                interval=0.2,
                what="the killed gateway's slot to come back",
            )

    assert while_held.status_code == 503
    assert while_held.json()["error"]["code"] == "queue_full"
    assert recovered.headers["x-crossbar-host"] == "gpu1"


def test_redis_gone_answers_503_state_unavailable_and_recovers_without_a_leaked_slot(
    tmp_path, redis_server, fake
):
    add_route("chat", [add_host("gpu1", fake.url, models={MODEL: (1, 0)})])
    since = timezone.now()

    with two_gateways(tmp_path, redis_server.url) as (first, second):
        assert httpx.post(first.url + CHAT, json=chat()).status_code == 200
        redis_server.stop()
        refused = httpx.post(first.url + CHAT, json=chat())
        health = wait_until(
            lambda: (h := httpx.get(second.url + "/health")).status_code == 503 and h,
            what="/health to say the shared state is gone",
        )
        redis_server.start()
        wait_until(
            lambda: httpx.get(second.url + "/health").status_code == 200,
            timeout=20,
            what="/health to recover",
        )
        # One slot, none leaked: each gateway in turn gets it, over and over.
        after = [
            httpx.post(gateway.url + CHAT, json=chat()).status_code
            for gateway in (first, second, first, second)
        ]

    assert refused.status_code == 503
    assert refused.json()["error"]["code"] == "state_unavailable"
    assert refused.headers["retry-after"]
    assert health.json()["status"] == "state_unavailable"
    assert after == [200, 200, 200, 200]
    rows = Request.objects.filter(started__gte=since, code="state_unavailable")
    wait_until(lambda: rows.count() >= 1, what="the refusal's row")


def test_more_requests_at_once_than_connections_to_redis_are_all_served(tmp_path, redis_url):
    with FakeLlamaServer(slots=256, token_delay=0.01) as fake:
        add_route("chat", [add_host("gpu1", fake.url, models={MODEL: (256, 0)})])
        with two_gateways(tmp_path, redis_url) as (first, _):
            responses = asyncio.run(_burst([first.url + CHAT] * 160))

    statuses = Counter(r.status_code for r in responses)
    assert statuses == {200: 160}, [r.text for r in responses if r.status_code != 200][:3]


@pytest.mark.soak
def test_a_soak_through_two_gateways_leaves_no_slot_place_or_stray_key_in_redis(
    tmp_path, redis_url
):
    # The single-process soak's load and faults (tests/e2e/test_soak.py), through two gateways.
    with contextlib.ExitStack() as stack:
        fakes = [stack.enter_context(FakeLlamaServer(slots=4, token_delay=0.002)) for _ in range(4)]
        hosts = [
            add_host(f"gpu{i}", fake.url, models={MODEL: (4, 8)}) for i, fake in enumerate(fakes)
        ]
        add_route("chat", hosts)
        first, second = stack.enter_context(two_gateways(tmp_path, redis_url))
        store = redis.Redis.from_url(redis_url, decode_responses=True)
        stack.callback(store.close)
        rng = random.Random(15)

        async def both(ledger: Ledger, seconds: float) -> Counter[str]:
            halves = await asyncio.gather(
                load(first.url, ledger, seconds, rng), load(second.url, ledger, seconds, rng)
            )
            return halves[0] + halves[1]

        with Ledger(first) as ledger:
            asyncio.run(both(ledger, 1.0))  # warm up: pools, leases, scripts
            wait_until_free(first.url)
            memory_before = store.info("memory")["used_memory"]
            faults = Faults(fakes, rng)
            injector = threading.Thread(target=faults.run)
            injector.start()
            try:
                outcomes = asyncio.run(both(ledger, 6.0))
            finally:
                faults.stop.set()
                injector.join()
            for gateway in (first, second):
                wait_until_free(gateway.url, timeout=15)  # both read the shared state
            ledger.settle(timeout=30)  # one row per request, whichever gateway served it
            memory_after = store.info("memory")["used_memory"]
            stray = [
                key
                for key in store.scan_iter(count=1000)
                if any(part in key for part in (":waiter:", ":watch:", ":queue:", ":held:"))
            ]

    print(
        f"\nreplica soak: {ledger.count} requests, outcomes {dict(outcomes)}, "
        f"{faults.total()} faults {dict(faults.injected)}, Redis memory "
        f"{memory_before / 2**20:.2f} -> {memory_after / 2**20:.2f} MiB"
    )
    assert outcomes["200"] > 0 and outcomes["left"] >= 1
    assert stray == []  # no slot held, no place kept, no waiter left behind
    # Leases of the soak's few hundred conversations are all that may grow.
    assert memory_after - memory_before < 2 * 2**20


def test_a_keys_concurrency_limit_holds_across_gateways(tmp_path, redis_url):
    with FakeLlamaServer(slots=4, token_delay=0.1) as fake:
        add_route("chat", [add_host("gpu1", fake.url)])
        key = issue("team-a", max_concurrent=1)
        with two_gateways(tmp_path, redis_url) as (first, second):
            holder = threading.Thread(
                target=post, args=(first,), kwargs={"key": key, "stream": True, "max_tokens": 15}
            )
            holder.start()
            wait_until(lambda: fake.in_flight == 1, what="the first request to run")
            limited = post(second, key=key)
            holder.join()
            wait_until(  # its release reaches Redis in a task of its own
                lambda: post(second, key=key).status_code == 200, what="the key's slot back"
            )

    assert limited.status_code == 429
    assert limited.json()["error"]["code"] == "rate_limit_exceeded"


def test_a_gateway_stalled_past_the_expiry_loses_its_slot_and_never_counts_it_again(
    tmp_path, redis_url
):
    """A process stopped (SIGSTOP) while it holds the host's one slot: once its hold expires
    the other gateway takes the slot; when it resumes, its stream ends with a `slot_lost`
    error event, and Redis never counts two slots of a pair that has one."""
    held = redis.Redis.from_url(redis_url, decode_responses=True)
    counts: list[int] = []  # Redis's slots held of the pair, from the stall to the end
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            counts.append(held.hlen(f"crossbar:held:gpu1/{MODEL}"))
            done.wait(0.01)

    with FakeLlamaServer(slots=4, token_delay=0.05) as fake:
        add_route("chat", [add_host("gpu1", fake.url, models={MODEL: (1, 0)})])
        with two_gateways(tmp_path, redis_url) as (stalled, other):
            sampler = threading.Thread(target=sample, daemon=True)
            with httpx.stream(
                "POST", stalled.url + CHAT, json=chat("long", stream=True, max_tokens=2000),
                timeout=30,
            ) as stream:  # fmt: skip
                lines = stream.iter_lines()
                next(lines)  # it holds the host's one slot now
                sampler.start()
                stalled.process.send_signal(signal.SIGSTOP)
                try:
                    taken = wait_until(
                        lambda: (
                            (r := httpx.post(other.url + CHAT, json=chat("meanwhile"))).status_code
                            == 200
                            and r
                        ),
                        timeout=20,
                        interval=0.2,
                        what="the other gateway to take the stalled one's slot",
                    )
                finally:
                    stalled.process.send_signal(signal.SIGCONT)
                rest = list(lines)
            after = httpx.post(other.url + CHAT, json=chat("after"))
            done.set()
            sampler.join(timeout=5)

    assert taken.headers["x-crossbar-host"] == "gpu1"
    errors = [line for line in rest if line.startswith("data: {") and '"error"' in line]
    assert len(errors) == 1 and '"slot_lost"' in errors[0], rest[-3:]
    assert counts and max(counts) <= 1
    assert after.status_code == 200
    row = wait_until(
        lambda: Request.objects.filter(code="slot_lost").first(), what="the lost slot's row"
    )
    assert (row.status, row.host) == (503, "gpu1")
