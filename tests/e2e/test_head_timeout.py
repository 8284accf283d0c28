"""A request's head has `CROSSBAR_HEAD_TIMEOUT` seconds to arrive whole (crossbar_site/heads.py),
on daphne and on uvicorn (`CROSSBAR_TEST_SERVER`): a client trickling header bytes, or sending
none, is answered 408 and its connection closed, counted in `crossbar_head_timeouts_total`.
What comes after the head (a body uploaded slowly, an answer streamed slowly, a kept-alive
connection waiting for its next request) is not the head timeout's to cut."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.fakes.llama_server import FakeLlamaServer
from tests.helpers.fleet import add_host, add_route, chat
from tests.helpers.gateway import running_gateway
from tests.helpers.observe import series
from tests.helpers.wire import KeptAlive, connect

pytestmark = pytest.mark.django_db(transaction=True)
URL = "/chat/v1/chat/completions"
HEAD_TIMEOUT = 1.0
LONG = 30.0  # seconds a connection may take to be closed on a busy machine


@pytest.fixture
def gateway_with_head_timeout(django_db_setup, tmp_path):
    with FakeLlamaServer(slots=2, token_delay=0.3) as fake:
        add_route("chat", [add_host("gpu1", fake.url)])
        with running_gateway(tmp_path, CROSSBAR_HEAD_TIMEOUT=str(HEAD_TIMEOUT)) as gateway:
            yield gateway


def head_timeouts(url: str) -> float:
    return series(url, ("crossbar_head_timeouts_total",)).get("crossbar_head_timeouts_total[]", 0.0)


def trickled(sock: socket.socket, pieces: Iterator[bytes]) -> bytes:
    """Send `pieces` a tenth of a second apart until the gateway answers or closes; what it
    sent. Fails when it is still reading after LONG seconds."""
    sock.settimeout(0.1)
    deadline = time.monotonic() + LONG
    received = b""
    for piece in pieces:
        if time.monotonic() > deadline:
            pytest.fail(f"the gateway still read the head after {LONG} s")
        try:
            sock.sendall(piece)
        except OSError:  # closed by the gateway: what it said is in the receive buffer
            break
        try:
            received = sock.recv(4096)
        except TimeoutError:
            continue
        break
    sock.settimeout(5)
    while chunk := _recv(sock):
        received += chunk
    return received


def _recv(sock: socket.socket) -> bytes:
    try:
        return sock.recv(4096)
    except OSError:
        return b""


def endless_head() -> Iterator[bytes]:
    """A request head that never ends: a header line at a time, each one progress."""
    yield b"POST " + URL.encode() + b" HTTP/1.1\r\nHost: localhost\r\n"
    number = 0
    while True:
        number += 1
        yield b"X-Trickle-%d: x\r\n" % number


def test_a_request_head_trickled_past_the_head_timeout_is_answered_408_and_closed(
    gateway_with_head_timeout,
):
    url = gateway_with_head_timeout.url
    with connect(url) as sock:
        answer = trickled(sock, endless_head())

    assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
    assert head_timeouts(url) == 1


def test_the_next_head_on_a_kept_alive_connection_has_its_own_head_timeout(
    gateway_with_head_timeout,
):
    url = gateway_with_head_timeout.url
    client = KeptAlive(url, timeout=LONG)
    try:
        body = json.dumps(chat()).encode()
        first = client.ask(b"POST", URL.encode(), body, content_type=b"application/json")
        answer = trickled(client.sock, endless_head())
    finally:
        client.close()

    assert first.status == 200
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
    assert head_timeouts(url) == 1


def test_a_connection_that_sends_nothing_is_closed_after_the_head_timeout(
    gateway_with_head_timeout,
):
    url = gateway_with_head_timeout.url
    with connect(url, timeout=LONG) as sock:
        answer = b""
        while chunk := _recv(sock):
            answer += chunk

    assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
    assert head_timeouts(url) == 1


def test_a_slow_upload_a_slow_stream_and_an_idle_kept_alive_connection_are_not_cut(
    gateway_with_head_timeout,
):
    url = gateway_with_head_timeout.url
    body = json.dumps(chat(stream=True, max_tokens=8)).encode()

    def slowly() -> Iterator[bytes]:
        # The body over more than twice the head timeout, after a head sent at once.
        for start in range(0, len(body), len(body) // 10 + 1):
            time.sleep(HEAD_TIMEOUT / 4)
            yield body[start : start + len(body) // 10 + 1]

    with httpx.Client(base_url=url, timeout=LONG) as client:
        uploaded = client.post(URL, content=slowly(), headers={"Content-Type": "application/json"})
        # The answer streams for longer than the head timeout (8 tokens, 0.3 s apart).
        with client.stream("POST", URL, json=chat(stream=True, max_tokens=8)) as streamed:
            events = [line for line in streamed.iter_lines() if line.startswith("data: ")]
        # The kept-alive connection idles past the head timeout before its next request.
        time.sleep(HEAD_TIMEOUT * 2)
        again = client.post(URL, json=chat())

    assert uploaded.status_code == 200, uploaded.text
    assert streamed.status_code == 200
    assert events[-1] == "data: [DONE]" and len(events) >= 9
    assert again.status_code == 200, again.text
    assert head_timeouts(url) == 0
