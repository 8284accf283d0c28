"""Prefix affinity through the real gateway: a new conversation whose opening a host already
holds goes there, says so, and its row records how much the index expected it to hold."""

from __future__ import annotations

import uuid

import httpx
import pytest
from django.utils import timezone

from accounting.models import Request
from routing.core.prefixes import prefix_blocks
from tests.helpers.fleet import MODEL, add_host, add_route, chat
from tests.helpers.observe import wait_for_gauge
from tests.helpers.waits import wait_until

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_new_conversation_goes_to_the_host_holding_its_system_prompt_and_says_prefix(
    gateway, fake, fake2
):
    # gpu2 has more free slots, so the ranking puts it first for anything new.
    gpu1 = add_host("gpu1", fake.url, models={MODEL: (2, 2)})
    gpu2 = add_host("gpu2", fake2.url, models={MODEL: (4, 4)})
    add_route("solo", [gpu1])
    add_route("chat", [gpu1, gpu2])
    gateway.sync()
    system = f"{uuid.uuid4()} " + " ".join(f"rule{i}" for i in range(400))  # ~3,000 characters
    started = timezone.now()

    # Through a route of its own, gpu1 reads the system prompt: its cache holds it now.
    taught = httpx.post(f"{gateway.url}/solo/v1/chat/completions",
                        json=chat("first?", system=system), timeout=10)  # fmt: skip
    answer = httpx.post(f"{gateway.url}/chat/v1/chat/completions",
                        json=chat("another question", system=system), timeout=10)  # fmt: skip
    fresh = httpx.post(f"{gateway.url}/chat/v1/chat/completions",
                       json=chat("unrelated", system=f"{uuid.uuid4()}"), timeout=10)  # fmt: skip

    assert taught.status_code == answer.status_code == fresh.status_code == 200
    assert answer.headers["X-Crossbar-Host"] == "gpu1"
    assert answer.headers["X-Crossbar-Placement"] == "prefix"
    assert answer.headers["X-Crossbar-Lease"] == "new"
    assert (fresh.headers["X-Crossbar-Host"], fresh.headers["X-Crossbar-Placement"]) == (
        "gpu2",
        "new",
    )
    rows = Request.objects.filter(started__gte=started, route="chat").order_by("started")
    wait_until(lambda: rows.count() == 2, what="the chat route's two rows")
    row = rows.first()
    assert row is not None
    shared = len(prefix_blocks(chat("", system=system)).blocks)  # the system prompt's blocks
    assert (row.host, row.placement) == ("gpu1", "prefix")
    assert row.predicted_cached_blocks is not None
    assert shared - 1 <= row.predicted_cached_blocks <= shared + 1
    assert row.reported_cached_blocks is not None and row.reported_cached_blocks >= shared - 1


def test_a_new_conversation_skips_a_host_holding_as_many_conversations_as_it_has_slots(
    gateway, fake, fake2
):
    # gpu1 has two slots, gpu2 one: the ranking puts gpu1 first for anything new while it has
    # more free slots, until two conversations are leased there. A third would overwrite one
    # of theirs in gpu1's KV cache, so it goes to gpu2, which has room, though gpu1 still has
    # two free slots to gpu2's one.
    gpu1 = add_host("gpu1", fake.url, models={MODEL: (2, 2)})
    gpu2 = add_host("gpu2", fake2.url, models={MODEL: (1, 1)})
    add_route("chat", [gpu1, gpu2])
    gateway.sync()

    went = []
    for number in range(3):
        answer = httpx.post(f"{gateway.url}/chat/v1/chat/completions",
                            json=chat(f"conversation {number} {uuid.uuid4()}"),
                            timeout=10)  # fmt: skip
        assert answer.status_code == 200
        host = answer.headers["X-Crossbar-Host"]
        went.append((host, answer.headers["X-Crossbar-Lease"]))
        # Its slot back: a client may have read the whole answer an instant before the
        # gateway ends the response and frees the slot (CI saw it, on uvicorn), and until
        # then gpu1 counts one free slot, as gpu2 does.
        wait_for_gauge(gateway.url, "crossbar_in_flight", 0, host=host, model=MODEL)

    assert went == [("gpu1", "new"), ("gpu1", "new"), ("gpu2", "new")]
