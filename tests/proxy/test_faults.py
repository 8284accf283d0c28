"""Upstream faults through the real server: what the client gets, what the row says, and that
nothing is held afterwards (the `ledger` checks slots, queues and rows after every test)."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.conftest import running_gateway, wait_until
from tests.fleet import MODEL, add_host, add_route, chat

pytestmark = pytest.mark.django_db(transaction=True)
URL = "/chat/v1/chat/completions"


@pytest.fixture(scope="module")
def gateway(django_db_setup, django_db_blocker, tmp_path_factory):
    """This module's gateway: its health poller stays quiet, so only requests meet a fault."""
    with django_db_blocker.unblock():
        log_dir = tmp_path_factory.mktemp("faults")
        with running_gateway(log_dir, CROSSBAR_HEALTH_INTERVAL="600") as gw:
            yield gw


@pytest.fixture
def chat_route(gateway, fake):
    add_route("chat", [add_host("gpu1", fake.url, models={MODEL: (1, 0)})])
    gateway.sync()


def only_row(ledger):
    wait_until(lambda: ledger.rows().exists(), what="the request's row")
    (row,) = ledger.rows()
    return row


@pytest.mark.parametrize(
    ("fault", "status", "code", "message"),
    [
        ("refuse", 502, "upstream_unreachable", "host gpu1 ({url}) unreachable"),
        ("reset_before_headers", 502, "upstream_unreachable", "host gpu1 ({url}) closed the"),
        ("hang", 504, "upstream_timeout", "host gpu1 sent no response head within 3 s"),
    ],
)
def test_a_host_that_fails_before_its_head_gets_the_gateways_own_answer(
    chat_route, fake, ledger, fault, status, code, message
):
    fake.fail_mode = fault
    message = message.format(url=fake.url)  # a host that cannot be reached is named by its URL

    response = ledger.client.post(URL, json=chat())

    assert response.status_code == status
    assert response.headers["x-crossbar-host"] == "gpu1"
    assert response.json()["error"]["code"] == code
    assert response.json()["error"]["message"].startswith(message)
    row = only_row(ledger)
    assert (row.status, row.host, row.ttfb_ms) == (status, "gpu1", None)
    assert row.error.startswith(message)
    # What the gateway gave up on, the host is not left holding (a hung request is hung up on).
    wait_until(lambda: fake.in_flight == 0, what="the host to see the request go")


@pytest.mark.parametrize(
    ("setup", "status", "message"),
    [
        ({"fail_mode": "error_500"}, 500, "Internal server error (injected)"),
        ({"health": "loading"}, 503, "Loading model"),
    ],
)
def test_a_hosts_error_answer_is_passed_through_with_its_status_and_body(
    chat_route, fake, ledger, setup, status, message
):
    for knob, value in setup.items():
        setattr(fake, knob, value)

    for stream in (False, True):
        response = ledger.client.post(URL, json=chat(stream=stream))

        assert response.status_code == status
        assert response.json()["error"]["message"] == message
        assert response.headers["x-crossbar-host"] == "gpu1"

    wait_until(lambda: ledger.rows().count() == 2, what="two rows")
    assert [row.status for row in ledger.rows()] == [status, status]


def sse_events(body: bytes) -> list[bytes]:
    return [line for line in body.split(b"\n") if line.startswith(b"data: ")]


def test_a_reset_mid_stream_ends_the_stream_with_one_error_event(chat_route, fake, ledger):
    fake.fail_mode = "reset_mid_stream"

    response = ledger.client.post(URL, json=chat(stream=True, max_tokens=20))

    *tokens, last = sse_events(response.content)
    assert response.status_code == 200
    assert len(tokens) <= 3  # what arrived before the reset (unread bytes die with a reset)
    assert not any(b'"error"' in token for token in tokens)
    error = json.loads(last.removeprefix(b"data: "))["error"]
    assert error["code"] == "upstream_failed"
    assert error["message"].startswith("host gpu1 failed mid-stream")
    assert b"[DONE]" not in response.content
    row = only_row(ledger)
    assert row.status == 502 and row.streamed and "mid-stream" in row.error


def test_a_reset_in_the_middle_of_a_whole_answer_breaks_the_clients_response(
    chat_route, fake, ledger
):
    """The head already promised the host's Content-Length: the client must see the answer
    break, not wait for bytes that will never come."""
    fake.fail_mode = "reset_mid_stream"

    started = time.monotonic()
    with pytest.raises(httpx.RemoteProtocolError):
        ledger.client.post(URL, json=chat(max_tokens=20), timeout=20)

    assert time.monotonic() - started < 10  # well before the client's own timeout
    row = only_row(ledger)
    assert row.status == 502 and not row.streamed and "mid-stream" in row.error


def test_a_stream_silent_past_the_idle_timeout_ends_with_one_error_event(chat_route, fake, ledger):
    fake.token_delay = 0.05
    events = []

    with ledger.client.stream("POST", URL, json=chat(stream=True, max_tokens=50)) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line)
            if len(events) == 2:
                fake.token_delay = 30  # the host goes quiet mid-answer

    *tokens, last = events
    error = json.loads(last.removeprefix("data: "))["error"]
    assert 2 <= len(tokens) <= 3  # one more token may have been on its way
    assert not any('"error"' in token for token in tokens)
    assert error["message"] == "host gpu1 sent nothing for 3 s mid-stream"
    row = only_row(ledger)
    assert row.status == 504 and row.error == error["message"]
    assert row.completion_tokens is None  # the host never said how many it made
