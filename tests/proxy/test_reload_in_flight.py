"""A host deleted or renamed while requests run on it and wait in its line, end to end.

A reload never drops what runs: a request running on a host that left the configuration ends
as it would have, and `/metrics` still counts it (the suite's "every slot came back" check
reads that count). A request waiting in such a host's line is placed again on the route's
other hosts, or refused with a 503 that says why; a host renamed (the same URL under another
name) keeps its running count, so the box never runs more than its `parallel`.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import httpx
import pytest

from hosts.models import Host
from tests.helpers.fleet import MODEL, add_host, add_route, chat
from tests.helpers.observe import gauge, wait_for_gauge
from tests.helpers.waits import wait_until

pytestmark = pytest.mark.django_db(transaction=True)

URL = "/chat/v1/chat/completions"
LONG = 1000  # tokens: minutes at the fakes' token delay, until the test sets it to 0


@pytest.fixture
def pool(request: pytest.FixtureRequest) -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(4) as executor:
        yield executor
        for name in ("fake", "fake2"):  # a failed test's long answers end at once
            if name in request.fixturenames:
                request.getfixturevalue(name).token_delay = 0


def ask(ledger, pool: ThreadPoolExecutor, content: str) -> Future[httpx.Response]:
    """A long streamed chat of its own conversation, sent from another thread."""
    body = chat(content, stream=True, max_tokens=LONG)
    return pool.submit(lambda: ledger.client.post(URL, json=body, timeout=60))


def test_a_request_waiting_in_a_deleted_hosts_line_is_served_by_the_routes_other_host(
    gateway, ledger, fake, fake2, pool
):
    fake.token_delay = fake2.token_delay = 0.1
    gpu1 = add_host("gpu1", fake.url, models={MODEL: (1, 2)})
    gpu2 = add_host("gpu2", fake2.url, models={MODEL: (1, 2)})
    add_route("chat", [gpu1, gpu2])
    gateway.sync()
    first = ask(ledger, pool, "first")
    wait_until(lambda: fake.in_flight == 1, what="gpu1's slot taken")
    second = ask(ledger, pool, "second")
    wait_until(lambda: fake2.in_flight == 1, what="gpu2's slot taken")
    third = ask(ledger, pool, "third")
    wait_for_gauge(gateway.url, "crossbar_queued", 1, host="gpu1", model=MODEL)

    Host.objects.filter(name="gpu1").delete()
    gateway.sync()
    # Placed again: in gpu2's line, while gpu1's request still runs and is still counted.
    wait_for_gauge(gateway.url, "crossbar_queued", 1, host="gpu2", model=MODEL)
    running_on_deleted = gauge(gateway.url, "crossbar_in_flight", host="gpu1", model=MODEL)
    fake.token_delay = 0
    answered = first.result()
    wait_for_gauge(gateway.url, "crossbar_in_flight", 0, host="gpu1", model=MODEL)
    fake2.token_delay = 0

    assert running_on_deleted == 1
    assert (answered.status_code, answered.headers["x-crossbar-host"]) == (200, "gpu1")
    assert second.result().status_code == 200
    moved = third.result()
    assert (moved.status_code, moved.headers["x-crossbar-host"]) == (200, "gpu2")
    assert moved.text.endswith("data: [DONE]\n\n")
    assert fake2.max_concurrent == 1


def test_a_request_waiting_in_the_line_of_a_routes_only_host_is_refused_naming_its_removal(
    gateway, ledger, fake, pool
):
    fake.token_delay = 0.1
    add_route("chat", [add_host("gpu1", fake.url, models={MODEL: (1, 2)})])
    gateway.sync()
    running = ask(ledger, pool, "first")
    wait_until(lambda: fake.in_flight == 1, what="gpu1's slot taken")
    waiting = ask(ledger, pool, "second")
    wait_for_gauge(gateway.url, "crossbar_queued", 1, host="gpu1", model=MODEL)

    Host.objects.filter(name="gpu1").delete()
    gateway.sync()
    refused = waiting.result()
    fake.token_delay = 0

    assert refused.status_code == 503
    error = refused.json()["error"]
    assert error["code"] == "host_removed"
    assert "gpu1" in error["message"] and "removed" in error["message"]
    assert running.result().status_code == 200


def test_a_host_renamed_while_it_runs_keeps_its_running_count(gateway, ledger, fake, pool):
    fake.token_delay = 0.1
    add_route("chat", [add_host("gpu1", fake.url, models={MODEL: (1, 2)})])
    gateway.sync()
    first = ask(ledger, pool, "first")
    wait_until(lambda: fake.in_flight == 1, what="gpu1's slot taken")

    host = Host.objects.get(name="gpu1")
    host.name = "box1"  # the same box (its URL) under another name
    host.save()
    gateway.sync()
    second = ask(ledger, pool, "second")
    wait_for_gauge(gateway.url, "crossbar_queued", 1, host="box1", model=MODEL)
    running = gauge(gateway.url, "crossbar_in_flight", host="box1", model=MODEL)
    fake.token_delay = 0

    assert running == 1
    assert first.result().status_code == 200
    after = second.result()
    assert (after.status_code, after.headers["x-crossbar-host"]) == (200, "box1")
    assert fake.max_concurrent == 1
