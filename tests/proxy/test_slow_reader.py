"""Clients that read slowly: the host is read at its own pace, not theirs.

The gateway reads a host's stream into a bounded buffer (1 MiB) while its client lags, so the
host's slot is free as soon as the host is done, and the client still gets every byte. A client
further behind than the buffer is cut (499 `client_too_slow`). The test clients shrink what
the kernel holds for them (`rcvbuf`, `maxseg`: a few hundred KiB, not the 4 MiB of loopback),
so that the gateway's own buffer is what is measured. The `ledger` checks slots, queues and
rows after each test.
"""

from __future__ import annotations

import json
import socket
import threading

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.fakes.flood_server import FloodServer
from tests.fakes.llama_formats import text_of
from tests.helpers.asking import PAIR, send_chat
from tests.helpers.fleet import MODEL, add_host, add_route, chat
from tests.helpers.invariants import rss_mib
from tests.helpers.observe import gauge
from tests.helpers.waits import wait_until
from tests.helpers.wire import parse_answer

pytestmark = pytest.mark.django_db(transaction=True)
KiB, MiB = 1024, 1024 * 1024
SLOW = {"rcvbuf": 4 * KiB, "maxseg": 536}  # the kernel holds 100-300 KiB for such a client
TOKENS = 4000  # ~210 bytes per SSE event: an 820 KiB completion, which the 1 MiB buffer holds


def requests_answered(url: str) -> float:
    """How many requests the gateway has finished (and so written a row for), from /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "crossbar_requests_total"
    )


def slot_free(gateway) -> bool:
    return gauge(gateway.url, "crossbar_in_flight", **PAIR) == 0


def read_to_the_end(client: socket.socket) -> bytes:
    """Whatever the gateway still sends, until it closes the connection (or resets it)."""
    data = b""
    try:
        while chunk := client.recv(MiB):
            data += chunk
    except ConnectionResetError:
        pass
    client.close()
    return data


def the_row(ledger, **match):
    rows = ledger.rows().filter(**match)
    wait_until(rows.exists, what=f"the row {match}")
    (row,) = rows
    return row


class Trickle(threading.Thread):
    """A client reading 2 KiB every 20 ms in a thread of its own, so that it goes on taking
    bytes while the test does other things (on a starved machine, a pause of the test's own
    past the idle timeout would otherwise cut it); `drain()` makes it read the rest at once."""

    def __init__(self, client: socket.socket) -> None:
        super().__init__(daemon=True)
        self.client = client
        self.received = b""
        self.hurry = threading.Event()

    def run(self) -> None:
        try:
            while not self.hurry.wait(0.02) and (chunk := self.client.recv(2 * KiB)):
                self.received += chunk
        except ConnectionResetError:
            pass
        self.received += read_to_the_end(self.client)

    def drain(self) -> bytes:
        self.hurry.set()
        self.join(timeout=60)
        assert not self.is_alive(), "the stream did not end"
        return self.received


def test_a_slow_reader_frees_the_hosts_slot_as_soon_as_the_host_is_done_and_gets_every_byte(
    gateway, fake, ledger
):
    add_route("chat", [add_host("gpu1", fake.url, models={MODEL: (1, 0)})])
    gateway.sync()
    answered = requests_answered(gateway.url)
    reader = Trickle(send_chat(gateway, ledger, chat(stream=True, max_tokens=TOKENS), **SLOW))
    reader.start()

    wait_until(lambda: slot_free(gateway), timeout=15, what="the slot freed under a slow reader")
    # The host's 820 KiB are out of the host and in the gateway; the client has read little.
    assert len(reader.received) < 200 * KiB
    assert requests_answered(gateway.url) == answered  # no row yet: the request goes on
    # parallel 1, queue 0: only a free slot lets the next request in.
    assert ledger.client.post("/chat/v1/chat/completions", json=chat("next")).status_code == 200
    answer = parse_answer(reader.drain())

    assert answer.status == 200
    events = [line for line in answer.body.split(b"\n\n") if line]
    assert events[-1] == b"data: [DONE]"
    contents = [json.loads(event[6:])["choices"][0]["delta"]["content"] for event in events[:-1]]
    assert "".join(contents) == text_of(0, TOKENS)  # every token, in order
    row = the_row(ledger, status=200, completion_tokens=TOKENS)
    assert row.streamed and row.host == "gpu1"


def test_a_client_that_reads_nothing_while_the_host_streams_more_than_the_buffer_is_cut(
    gateway, ledger
):
    with FloodServer(total=256 * MiB) as flood:
        add_route("chat", [add_host("gpu1", flood.url)])
        gateway.sync()
        before = rss_mib(gateway.process.pid)
        client = send_chat(gateway, ledger, chat(stream=True), **SLOW)
        received = client.recv(4096)  # the head is out; now the client reads nothing

        row = the_row(ledger, status=499)
        grown = rss_mib(gateway.process.pid) - before
        wait_until(lambda: slot_free(gateway), what="the slot freed")
        received += read_to_the_end(client)
        sent = flood.sent

    assert row.code == "client_too_slow" and "too slow" in row.error
    assert row.streamed and row.host == "gpu1"
    # The host's stream was closed, not read to its end: what the buffer and the socket buffers
    # between took, no more (without the cut, daphne reads all 256 MiB into memory).
    assert sent < 64 * MiB
    assert grown < 48
    assert received.startswith(b"HTTP/1.1 200") and b"data: [DONE]" not in received


def test_a_client_that_reads_nothing_is_cut_after_the_idle_timeout(gateway, fake, ledger):
    add_route("chat", [add_host("gpu1", fake.url, models={MODEL: (1, 0)})])
    gateway.sync()
    client = send_chat(gateway, ledger, chat(stream=True, max_tokens=TOKENS), **SLOW)
    received = client.recv(4096)

    wait_until(lambda: slot_free(gateway), what="the slot freed")  # the buffer has the answer
    row = the_row(ledger, status=499)  # 3 s later (CROSSBAR_STREAM_IDLE_TIMEOUT)
    # A client that reads again finds its answer cut: what the socket buffers held, no more.
    received += read_to_the_end(client)

    assert row.code == "client_disconnected" and row.streamed and row.host == "gpu1"
    assert row.error == "client read nothing for 3 s: response cut"
    assert received.startswith(b"HTTP/1.1 200") and b"data: [DONE]" not in received
