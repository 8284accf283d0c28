"""Asking the gateway for chats, over httpx or a raw socket, and reading what came back: the
request's row, the stream's events, what the fake host saw."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx

from accounting.models import ClientKey
from tests.fakes.llama_server import FakeLlamaServer
from tests.helpers import wire
from tests.helpers.fleet import MODEL, POLLS, add_host, add_route, chat
from tests.helpers.observe import wait_for_gauge
from tests.helpers.waits import wait_until

URL = "/chat/v1/chat/completions"


def only_row(ledger):
    wait_until(lambda: ledger.rows().exists(), what="the request's row")
    (row,) = ledger.rows()
    return row


def sse_events(body: bytes) -> list[bytes]:
    return [line for line in body.split(b"\n") if line.startswith(b"data: ")]


def completions(fake) -> list:
    """What the fake saw besides the gateway's health polls."""
    return [seen for seen in fake.seen if seen.path not in POLLS]


@contextmanager
def holding(url: str, body: dict, fake: FakeLlamaServer, key: str | None = None) -> Iterator[None]:
    """Keep one slot busy with a slow streamed request (of client key `key`) while the block
    runs."""
    before = fake.in_flight
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    thread = threading.Thread(
        target=lambda: httpx.post(url, json=body, headers=headers, timeout=60)
    )
    thread.start()
    wait_until(lambda: fake.in_flight > before, what="the slot to be taken")
    try:
        yield
    finally:
        thread.join()


def slow(content: str = "hold", tokens: int = 20) -> dict:
    return chat(content, stream=True, max_tokens=tokens)


PAIR = {"host": "gpu1", "model": MODEL}


def send_chat(gateway, ledger, body: dict, **options: Any):
    """Send a chat request over a raw socket, to leave at a moment of the test's choosing."""
    ledger.sent()
    return wire.send(gateway.url, b"POST", URL.encode(), json.dumps(body).encode(), **options)


def conversation(opening: str, *later: str) -> dict:
    """The body of a turn of the conversation that opens with `opening`, after `later`."""
    body = chat(opening)
    for number, content in enumerate(later):
        body["messages"] += [
            {"role": "assistant", "content": f"answer {number}"},
            {"role": "user", "content": content},
        ]
    return body


def turn(gateway, opening: str, *later: str, alone: bool = True) -> httpx.Response:
    """One turn of the conversation that opens with `opening`: its history and a new question.
    `alone` (no other request of the test's running): returned once the gateway has freed
    every slot of the host, its own too, which may come an instant after the client read the
    whole answer."""
    return send(gateway, conversation(opening, *later), alone=alone)


def send(gateway, body: dict, alone: bool = True) -> httpx.Response:
    """One turn with the body `body` (see `turn`)."""
    response = httpx.post(f"{gateway.url}/chat/v1/chat/completions", json=body, timeout=10)
    assert response.status_code == 200, response.text
    host = response.headers["X-Crossbar-Host"]
    if alone:
        wait_for_gauge(gateway.url, "crossbar_in_flight", 0, host=host, model=MODEL)
    return response


def issue(name: str, **fields: object) -> str:
    """Create a client key as the admin does; return the key."""
    row = ClientKey(name=name, **fields)
    key = row.issue_key()
    row.save()
    return key


def post(gateway, route: str = "chat", key: str | None = None, **body: Any) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(
        f"{gateway.url}/{route}/v1/chat/completions",
        json=chat(**body) if body else chat(),
        headers=headers,
        timeout=30,
    )


def one_slot_route(gateway, fake: FakeLlamaServer, queue_max: int) -> str:
    """The route `chat` over one host, `gpu1` (`fake`), of one slot and `queue_max` places in
    line, in force; its chat URL."""
    add_route("chat", [add_host("gpu1", fake.url, models={MODEL: (1, queue_max)})])
    gateway.sync()
    return f"{gateway.url}{URL}"


def asked(url: str, key: str, content: str, answers: dict[str, httpx.Response]) -> threading.Thread:
    """Ask for a chat of `content` with client key `key` in a thread; its answer lands in
    `answers[content]`."""

    def ask() -> None:
        headers = {"Authorization": f"Bearer {key}"}
        answers[content] = httpx.post(url, json=chat(content), headers=headers, timeout=60)

    thread = threading.Thread(target=ask)
    thread.start()
    return thread
