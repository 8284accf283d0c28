"""The key upstream faults as the upstream transport (httpx on aiohttp, routing/upstream_client.py)
meets them, on a gateway whose health poller stays quiet, so only requests meet a fault: they
read in the plain words a client and an operator can act on, not aiohttp's own.
"""

from __future__ import annotations

import json

import pytest

from tests.helpers.asking import URL, completions, only_row, sse_events
from tests.helpers.fleet import MODEL, add_host, add_route, chat
from tests.helpers.gateway import running_gateway
from tests.helpers.waits import wait_until

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(scope="module")
def gateway(django_db_setup, django_db_blocker, tmp_path_factory):
    """A gateway whose health poller stays quiet, so only requests meet a fault."""
    with django_db_blocker.unblock():
        log_dir = tmp_path_factory.mktemp("upstream-failures")
        with running_gateway(log_dir, CROSSBAR_HEALTH_INTERVAL="600") as gw:
            yield gw


@pytest.fixture
def one_host(gateway, fake):
    add_route("chat", [add_host("gpu1", fake.url, models={MODEL: (1, 0)})])
    gateway.sync()


@pytest.fixture
def two_hosts(gateway, fake, fake2):
    add_route("chat", [add_host("gpu1", fake.url), add_host("gpu2", fake2.url)])
    gateway.sync()


@pytest.mark.parametrize(("fault", "attempts"), [("refuse", 0), ("reset_before_headers", 2)])
def test_a_host_that_refuses_or_resets_before_its_head_hands_the_request_to_the_next(
    two_hosts, fake, ledger, fault, attempts
):
    """A refused connect moves at once; a reset is tried once more on a fresh connection."""
    fake.fail_mode = fault

    response = ledger.client.post(URL, json=chat())

    assert response.status_code == 200
    assert response.headers["x-crossbar-host"] == "gpu2"
    assert response.headers["x-crossbar-placement"] == "moved"
    assert len(completions(fake)) == attempts
    row = only_row(ledger)
    assert (row.status, row.host, row.error) == (200, "gpu2", "")


def test_a_reset_mid_stream_is_one_error_event_and_a_502_row(one_host, fake, ledger):
    fake.fail_mode = "reset_mid_stream"

    response = ledger.client.post(URL, json=chat(stream=True, max_tokens=20))

    *tokens, last = sse_events(response.content)
    assert response.status_code == 200
    assert not any(b'"error"' in token for token in tokens)
    error = json.loads(last.removeprefix(b"data: "))["error"]
    assert error["code"] == "upstream_failed"
    assert error["message"] == (
        "host gpu1 failed mid-stream: the connection ended before the whole response arrived"
    )
    row = only_row(ledger)
    assert (row.status, row.streamed, row.error) == (502, True, error["message"])


def test_a_host_that_sends_no_head_in_time_gets_a_504_and_is_hung_up_on(one_host, fake, ledger):
    fake.fail_mode = "hang"

    response = ledger.client.post(URL, json=chat())

    assert response.status_code == 504
    assert response.headers["x-crossbar-host"] == "gpu1"
    error = response.json()["error"]
    assert (error["code"], error["message"]) == (
        "upstream_timeout",
        "host gpu1 sent no response head within 3 s",
    )
    row = only_row(ledger)
    assert (row.status, row.host, row.ttfb_ms) == (504, "gpu1", None)
    wait_until(lambda: fake.in_flight == 0, what="the host to see the request go")


def test_a_refused_connect_reads_in_plain_words(one_host, fake, ledger):
    """aiohttp's own text for it (`Cannot connect to host ... ssl:default`) suggests TLS on a
    plain-HTTP host."""
    fake.fail_mode = "refuse"

    response = ledger.client.post(URL, json=chat())

    error = response.json()["error"]
    assert response.status_code == 502 and error["code"] == "upstream_unreachable"
    assert error["message"] == (
        f"host gpu1 ({fake.url}) unreachable: connection refused (nothing listens at the host's "
        "address and port)"
    )
    assert only_row(ledger).error == error["message"]
