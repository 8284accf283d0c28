"""A conversation through the real gateway, turn by turn, as an agent holds one: each turn
sends the whole history, so what the host kept of the turns before is what it reuses."""

from __future__ import annotations

import uuid
from typing import Any

import httpx

from tests.fakes.llama_server import FakeLlamaServer
from tests.helpers.fleet import MODEL
from tests.helpers.observe import wait_for_gauge


class Conversation:
    """A chat with a long system prompt of its own (some 3,000 characters: a dozen of the
    prefix index's blocks), sent to `url`, a route's chat completions."""

    def __init__(self, url: str, system: str | None = None) -> None:
        system = system or f"{uuid.uuid4()} " + " ".join(f"rule{i}" for i in range(400))
        self.url = url
        self.messages: list[dict[str, Any]] = [
            {"role": "system", "content": system},
            {"role": "user", "content": "first?"},
        ]

    def turn(self, question: str = "and then?") -> None:
        """Send the history, keep the answer and ask `question` next; fails unless 200."""
        body = {"model": MODEL, "messages": list(self.messages), "max_tokens": 4}
        answer = httpx.post(self.url, json=body, timeout=10)
        assert answer.status_code == 200, answer.text
        self.messages.append(answer.json()["choices"][0]["message"])
        self.messages.append({"role": "user", "content": question})


def turns_on_an_emptying_host(
    gateway_url: str, route: str, fake: FakeLlamaServer, host: str
) -> None:
    """Three turns of one conversation through `route` to `fake` (the host `host`), its slot
    emptied before the second and the third, as a unified KV cache empties an idle slot:
    twice found emptied, the gateway stops naming the host's slots. Returns once the
    gateway has read the last answer's counts (as the response ended, an instant after the
    client had it)."""
    conversation = Conversation(f"{gateway_url}/{route}/v1/chat/completions")
    conversation.turn()
    for _ in range(2):
        wait_for_gauge(gateway_url, "crossbar_in_flight", 0, host=host, model=MODEL)
        fake.forget_cache()
        conversation.turn()
    wait_for_gauge(gateway_url, "crossbar_in_flight", 0, host=host, model=MODEL)


def turns_on_a_shared_slot_taken_as_it_is(
    gateway_url: str, route: str, fake: FakeLlamaServer, host: str
) -> None:
    """Four turns through `route` to `fake` (the host `host`, with 2 slots in the fleet and in
    the fake, which keeps its last two prompts: `cache_ram=0`), one at a time: three
    conversations whose system prompts open with the same long tool list (slots 0, 1, then 0
    again), then the first
    one's second turn. Back in slot 0, it finds only the tool list it shares with the third,
    as llama-server at its default --slot-prompt-similarity gives it: the gateway counts a
    shared slot lost (`crossbar_shared_slot_lost_total`). Returns once the gateway has read
    the last answer's counts."""
    tools = " ".join(f"tool-{i}" for i in range(150))
    url = f"{gateway_url}/{route}/v1/chat/completions"
    # Each own part in as many short words as the fake counts tokens: whole blocks of the
    # prefix index (256 characters) that no other conversation's prompt shares.
    first, *others = (
        Conversation(url, f"{tools} " + " ".join(f"{name}-{i}" for i in range(80)))
        for name in (uuid.uuid4().hex[:6] for _ in range(3))
    )
    for conversation in (first, *others, first):
        conversation.turn()
        wait_for_gauge(gateway_url, "crossbar_in_flight", 0, host=host, model=MODEL)
