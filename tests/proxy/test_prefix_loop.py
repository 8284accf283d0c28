"""The prefix index's loop through the real gateway: each request's row says how much of its
prompt the index expected its host to hold and how much the host reported, and a host that
lost its cache is counted."""

from __future__ import annotations

import time
import uuid

import httpx
import pytest
from django.utils import timezone

from accounting.models import Request
from routing.core.prefixes import prefix_blocks
from tests.helpers.fleet import MODEL, add_host, add_route
from tests.helpers.observe import series
from tests.helpers.waits import wait_until

pytestmark = pytest.mark.django_db(transaction=True)

COUNTERS = (
    "crossbar_cache_lost_total",
    "crossbar_prefix_predicted_blocks_total",
    "crossbar_prefix_reported_blocks_total",
    "crossbar_prefix_confirmed_blocks_total",
)


def counters(url: str) -> dict[str, float]:
    """gpu1's prefix counters, by name (0 for a series not there yet)."""
    found = series(url, COUNTERS)
    return {name: found.get(f"{name}{[('host', 'gpu1')]}", 0.0) for name in COUNTERS}


def rows_since(started: object, count: int) -> list[Request]:
    mine = Request.objects.filter(started__gte=started).order_by("started")
    wait_until(lambda: mine.count() >= count, what=f"{count} accounting rows")
    time.sleep(0.7)  # longer than the recorder's flush interval: an extra row would show
    found = list(mine)
    assert len(found) == count
    return found


@pytest.fixture
def chat_url(gateway, fake) -> str:
    add_route("chat", [add_host("gpu1", fake.url)])
    gateway.sync()
    return f"{gateway.url}/chat/v1/chat/completions"


def test_each_turn_records_the_predicted_and_reported_cache_and_a_restart_counts_a_loss(
    gateway, fake, chat_url
):
    system = f"{uuid.uuid4()} " + " ".join(f"rule{i}" for i in range(400))  # ~3,000 characters
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "first?"}]
    bodies = []
    before = counters(gateway.url)
    started = timezone.now()

    def turn(question: str) -> None:
        body = {"model": MODEL, "messages": list(messages), "max_tokens": 4}
        bodies.append(body)
        answer = httpx.post(chat_url, json=body, timeout=10)
        assert answer.status_code == 200
        messages.append(answer.json()["choices"][0]["message"])
        messages.append({"role": "user", "content": question})

    turn("and what of the second question? " * 20)  # some 700 characters: a few blocks
    turn("and of the third? " * 20)
    fake.forget_cache()  # the host restarts: what it held is gone
    turn("fourth?")

    first, second, third = rows_since(started, 3)
    after = counters(gateway.url)
    sent = [len(prefix_blocks(body).blocks) for body in bodies]

    assert (first.predicted_cached_blocks, first.reported_cached_blocks) == (0, 0)
    # The second turn: the index expected the first turn's blocks, and the host had them.
    assert second.predicted_cached_blocks == sent[0] > 10
    assert second.reported_cached_blocks is not None
    assert second.reported_cached_blocks >= sent[0] - 1  # the conversion is good to a block
    # After the restart: the index expected the second turn's blocks; the host had none.
    assert third.predicted_cached_blocks == sent[1] > sent[0]
    assert third.reported_cached_blocks == 0
    assert third.cached_tokens == 0

    gained = {name: after[name] - before[name] for name in COUNTERS}
    assert gained == {
        "crossbar_cache_lost_total": 1,
        "crossbar_prefix_predicted_blocks_total": sent[0] + sent[1],
        "crossbar_prefix_reported_blocks_total": second.reported_cached_blocks,
        "crossbar_prefix_confirmed_blocks_total": min(sent[0], second.reported_cached_blocks),
    }


def test_a_streamed_turn_is_checked_like_a_whole_one(gateway, fake, chat_url):
    system = f"{uuid.uuid4()} " + " ".join(f"rule{i}" for i in range(400))
    body = {
        "model": MODEL,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": "hi"}],
        "stream": True,
        "max_tokens": 2,
    }
    started = timezone.now()

    for _ in range(2):
        with httpx.stream("POST", chat_url, json=body, timeout=10) as answer:
            assert answer.status_code == 200
            answer.read()

    first, second = rows_since(started, 2)
    sent = len(prefix_blocks(body).blocks)
    assert (first.predicted_cached_blocks, first.reported_cached_blocks) == (0, 0)
    assert second.predicted_cached_blocks == sent
    assert second.reported_cached_blocks in (sent - 1, sent)  # all but the last token: cached


def test_a_host_moved_to_another_machine_is_expected_to_hold_nothing(gateway, fake, fake2):
    gpu1 = add_host("gpu1", fake.url)
    add_route("chat", [gpu1])
    gateway.sync()
    url = f"{gateway.url}/chat/v1/chat/completions"
    system = f"{uuid.uuid4()} " + " ".join(f"rule{i}" for i in range(400))
    body = {"model": MODEL, "messages": [{"role": "system", "content": system}], "max_tokens": 2}
    started = timezone.now()
    assert httpx.post(url, json=body, timeout=10).status_code == 200

    gpu1.url = fake2.url  # the same name, another machine: its cache holds nothing of ours
    gpu1.save()
    gateway.sync()
    assert httpx.post(url, json=body, timeout=10).status_code == 200

    first, second = rows_since(started, 2)
    assert first.predicted_cached_blocks == 0
    assert (second.predicted_cached_blocks, second.reported_cached_blocks) == (0, 0)


def test_a_request_without_a_prompt_to_cache_records_no_prediction(gateway, fake, chat_url):
    started = timezone.now()

    embedded = httpx.post(
        chat_url.replace("/chat/completions", "/embeddings"),
        json={"model": MODEL, "input": "word " * 400},
        timeout=10,
    )

    assert embedded.status_code == 200
    (row,) = rows_since(started, 1)
    assert (row.predicted_cached_blocks, row.reported_cached_blocks) == (None, None)
