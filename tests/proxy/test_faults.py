"""Upstream faults through the real server: what the client gets, what the row says, and that
nothing is held afterwards (the `ledger` checks slots, queues and rows after every test)."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.fakes.llama_server import SHORT_STREAM_EVENT
from tests.helpers.asking import URL, only_row, sse_events
from tests.helpers.fleet import MODEL, chat
from tests.helpers.gateway import running_gateway
from tests.helpers.waits import wait_until
from tests.helpers.wire import KeptAlive

pytestmark = pytest.mark.django_db(transaction=True)

CHAT_HOST = {"models": {MODEL: (1, 0)}}  # the `chat_route` fixture's host (tests/conftest.py)


@pytest.fixture(scope="module")
def gateway(django_db_setup, django_db_blocker, tmp_path_factory):
    """This module's gateway: its health poller stays quiet, so only requests meet a fault."""
    with django_db_blocker.unblock():
        log_dir = tmp_path_factory.mktemp("faults")
        with running_gateway(log_dir, CROSSBAR_HEALTH_INTERVAL="600") as gw:
            yield gw


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


@pytest.mark.parametrize(
    ("status_line", "quoted"),
    [
        ("999 Weird", "999 Weird"),
        ("600 Beyond", "600 Beyond"),
        ("101 Switching Protocols", "101 Switching Protocols"),
        ("099 Early", "099 Early"),
        # Characters no terminal should print, and a reason as long as a head may be.
        ("999 Weird\u2028\u00e9" + "A" * 3000, "999 WeirdAAA"),
        # Bytes that are no UTF-8 (the fake writes lone surrogates as the bytes they stand for).
        ("999 Weird\udcff\udcfe", "999 Weird"),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_a_host_status_the_gateway_cannot_relay_is_a_502_and_gives_the_slot_back(
    chat_route, fake, ledger, status_line, quoted, stream
):
    """A status outside 200-599 (or a 1xx as the final answer) is no answer a client can be
    given: it gets the gateway's own 502 quoting a short, printable excerpt of the host's
    status line, one row, and the slot back (gpu1 has one slot and no queue)."""
    fake.odd_status = status_line
    fake.fail_mode = "odd_status"

    response = ledger.client.post(URL, json=chat(stream=stream))

    assert response.status_code == 502
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert (error["code"], error["type"]) == ("upstream_failed", "server_error")
    assert error["message"].startswith(f"host gpu1 answered an unusable status line: {quoted}")
    assert error["message"].isprintable() and error["message"].isascii()
    assert len(error["message"]) <= 160
    row = only_row(ledger)
    assert (row.status, row.host, row.error) == (502, "gpu1", error["message"])
    fake.fail_mode = None
    assert ledger.client.post(URL, json=chat(stream=stream)).status_code == 200


def test_a_stream_the_host_declared_a_length_for_ends_on_a_connection_that_stays_usable(
    chat_route, fake, ledger, gateway
):
    """A host's SSE stream with a Content-Length, cut short: the gateway's error event must not
    go out past a length it declared (the next answer on the client's connection would start
    inside it), so the next request on the same connection reads its own answer."""
    fake.fail_mode = "short_stream"
    client = KeptAlive(gateway.url)
    body = json.dumps(chat(stream=True)).encode()

    try:
        broken = client.ask(b"POST", URL.encode(), body, content_type=b"application/json")
        ledger.sent()
        fake.fail_mode = None
        served = client.ask(b"POST", URL.encode(), body, content_type=b"application/json")
        ledger.sent()
    finally:
        client.close()

    assert broken.status == 200
    declared = broken.headers.get("content-length")
    assert declared is None or int(declared) == len(broken.body)
    assert broken.body.startswith(SHORT_STREAM_EVENT)
    *_, last = sse_events(broken.body)
    assert json.loads(last.removeprefix(b"data: "))["error"]["code"] == "upstream_failed"
    assert served.status == 200 and sse_events(served.body)[-1] == b"data: [DONE]"
    assert ledger.statuses() == [200, 502]
