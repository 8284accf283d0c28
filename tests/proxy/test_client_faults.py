"""Clients that leave early.

A client that leaves gives back its slot or queue place at once, the host sees its request
cancelled, and a 499 row says so (clients that read slowly: test_slow_reader.py). The `ledger`
checks slots, queues and rows after each test.
"""

from __future__ import annotations

import pytest

from tests.helpers.asking import PAIR, URL, send_chat
from tests.helpers.fleet import MODEL, add_host, add_route, chat
from tests.helpers.observe import gauge
from tests.helpers.waits import wait_until

pytestmark = pytest.mark.django_db(transaction=True)


def completions(fake) -> list[str]:
    return [
        seen.json["messages"][-1]["content"]
        for seen in fake.seen
        if seen.path == "/v1/chat/completions"
    ]


def the_499(ledger):
    rows = ledger.rows().filter(status=499)
    wait_until(rows.exists, what="the 499 row")
    (row,) = rows
    assert "disconnected" in row.error
    return row


@pytest.mark.parametrize("wait_status", [False, True], ids=["plain", "with-wait-status"])
def test_a_client_leaving_while_queued_gives_its_place_back_at_once(
    gateway, fake, ledger, wait_status
):
    fake.token_delay = 0.1
    add_route("chat", [add_host("gpu1", fake.url, models={MODEL: (1, 1)})], wait_status=wait_status)
    gateway.sync()
    # Long enough to outlast every wait below on a busy machine; sped up once they are done.
    holder = send_chat(gateway, ledger, chat("holder", stream=True, max_tokens=300))
    wait_until(lambda: fake.in_flight == 1, what="the slot taken")
    impatient = send_chat(gateway, ledger, chat("impatient", stream=True))
    wait_until(lambda: gauge(gateway.url, "crossbar_queued", **PAIR) == 1, what="it queues")

    impatient.close()

    wait_until(
        lambda: gauge(gateway.url, "crossbar_queued", **PAIR) == 0,
        timeout=2,
        what="the queue place back",
    )
    # The holder's, untouched.
    assert gauge(gateway.url, "crossbar_in_flight", **PAIR) == 1
    fake.token_delay = 0.0
    # The freed place takes the next request (queue_max 1: it would be refused otherwise).
    after = ledger.client.post(URL, json=chat("next"))
    holder.close()
    assert after.status_code == 200
    assert completions(fake) == ["holder", "next"]
    assert the_499(ledger).host == "gpu1"


def test_a_client_leaving_while_the_host_prepares_its_head_cancels_the_upstream_request(
    gateway, fake, ledger
):
    add_route("chat", [add_host("gpu1", fake.url, models={MODEL: (1, 0)})])
    gateway.sync()
    fake.fail_mode, fake.fail_count = "hang", 1
    client = send_chat(gateway, ledger, chat("slow prompt"))
    wait_until(lambda: fake.in_flight == 1, what="the host to take the request")

    client.close()

    wait_until(lambda: fake.disconnects == 1, timeout=2, what="the host to see it cancelled")
    wait_until(
        lambda: gauge(gateway.url, "crossbar_in_flight", **PAIR) == 0, timeout=2, what="the slot"
    )
    # parallel 1, queue 0: only a slot given back lets the next request in.
    assert ledger.client.post(URL, json=chat("next")).status_code == 200
    row = the_499(ledger)
    assert row.ttfb_ms is None and row.host == "gpu1"


def test_a_client_leaving_mid_stream_cancels_the_upstream_request(gateway, fake, ledger):
    fake.token_delay = 0.1
    add_route("chat", [add_host("gpu1", fake.url, models={MODEL: (1, 0)})])
    gateway.sync()

    with ledger.client.stream("POST", URL, json=chat(stream=True, max_tokens=100)) as response:
        lines = response.iter_lines()
        next(line for line in lines if line.startswith("data: "))

    wait_until(lambda: fake.disconnects == 1, timeout=2, what="the host to see it cancelled")
    wait_until(
        lambda: gauge(gateway.url, "crossbar_in_flight", **PAIR) == 0, timeout=2, what="the slot"
    )
    row = the_499(ledger)
    assert row.streamed and row.ttfb_ms is not None
