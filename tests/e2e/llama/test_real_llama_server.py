"""The gateway in front of a real llama-server (built by `make llama-server`), not the fake.

What the fake imitates is checked here against the real thing: the OpenAI client streams and
reads whole answers through the gateway, llama-server's token counts (and its KV cache on a
conversation's second turn) reach the Request row, and /health, /props, /v1/models and
/v1/embeddings pass through. Skips when no llama-server binary is found (conftest.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import openai
import pytest
from django.utils import timezone
from openai.types.chat import ChatCompletionMessageParam

from accounting.models import Request
from tests.e2e.llama.locate import NOT_BUILT, binary_expected
from tests.e2e.llama.props_gate import props_gate
from tests.e2e.llama.server import ALIAS
from tests.helpers.fleet import add_host, add_route
from tests.helpers.gateway import running_gateway, running_gateway_on_the_tests_backing
from tests.helpers.invariants import Ledger
from tests.helpers.observe import gauge, slot_naming, wait_for_gauge, wait_for_host_state
from tests.helpers.waits import wait_until

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.django_db(transaction=True),
    # Skipped before any fixture starts a gateway for nothing.
    pytest.mark.skipif(not binary_expected(), reason=NOT_BUILT),
]

FIRST_TURN: list[ChatCompletionMessageParam] = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "Say hello."},
]


def rows_since(started, count: int) -> list[Request]:
    """This test's `count` rows, oldest first, once the gateway's recorder has written them."""
    mine = Request.objects.filter(started__gte=started)
    wait_until(lambda: mine.count() >= count, timeout=20, what=f"{count} accounting rows")
    time.sleep(0.7)  # longer than the recorder's flush interval: an extra row would show
    found = list(mine.order_by("started"))
    assert len(found) == count
    return found


@pytest.fixture
def route(gateway, llama) -> str:
    """Route `tiny` to the real llama-server; returns the route's OpenAI base URL."""
    add_route("tiny", [add_host("llama1", llama.url, models={ALIAS: (2, 4)})])
    gateway.sync()
    return f"{gateway.url}/tiny/v1"


def test_the_openai_client_streams_a_chat_from_llama_server_through_the_gateway(route, ledger):
    started = timezone.now()
    client = openai.OpenAI(base_url=route, api_key="unused", http_client=ledger.client)

    raw = client.chat.completions.with_raw_response.create(
        model=ALIAS,
        messages=FIRST_TURN,
        stream=True,
        max_tokens=8,
        temperature=0,
        stream_options={"include_usage": True},
    )
    chunks = list(raw.parse())

    assert raw.http_response.headers["content-type"].startswith("text/event-stream")
    assert raw.http_response.headers["x-crossbar-host"] == "llama1"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] in ("length", "stop") and all(f is None for f in finishes[:-1])
    usage = chunks[-1].usage
    assert usage is not None and 0 < usage.completion_tokens <= 8
    (row,) = rows_since(started, 1)
    assert (row.route, row.host, row.model, row.status, row.streamed) == (
        "tiny", "llama1", ALIAS, 200, True
    )  # fmt: skip
    assert (row.prompt_tokens, row.completion_tokens) == (
        usage.prompt_tokens, usage.completion_tokens
    )  # fmt: skip


def test_the_openai_client_reads_a_whole_chat_answer_and_its_row_has_the_tokens(route, ledger):
    started = timezone.now()
    client = openai.OpenAI(base_url=route, api_key="unused", http_client=ledger.client)

    answer = client.chat.completions.create(
        model=ALIAS, messages=FIRST_TURN, max_tokens=6, temperature=0
    )

    assert answer.object == "chat.completion"
    assert answer.choices[0].message.role == "assistant"
    assert isinstance(answer.choices[0].message.content, str)
    assert answer.usage is not None and 0 < answer.usage.completion_tokens <= 6
    (row,) = rows_since(started, 1)
    assert (row.status, row.streamed) == (200, False)
    assert (row.prompt_tokens, row.completion_tokens) == (
        answer.usage.prompt_tokens, answer.usage.completion_tokens
    )  # fmt: skip


def test_a_conversations_second_turn_reads_its_prefix_from_llama_servers_kv_cache(route, ledger):
    started = timezone.now()
    client = openai.OpenAI(base_url=route, api_key="unused", http_client=ledger.client)
    # Unlike every other test's prompt, so that no slot holds any of it yet.
    first_turn: list[ChatCompletionMessageParam] = [
        {"role": "system", "content": "Answer in French, whatever the question. " * 8},
        {"role": "user", "content": "Bonjour ?"},
    ]
    first = client.chat.completions.create(
        model=ALIAS, messages=first_turn, max_tokens=4, temperature=0
    )
    second_turn: list[ChatCompletionMessageParam] = [
        *first_turn,
        {"role": "assistant", "content": first.choices[0].message.content or ""},
        {"role": "user", "content": "Au revoir."},
    ]

    raw = client.chat.completions.with_raw_response.create(
        model=ALIAS, messages=second_turn, max_tokens=4, temperature=0
    )
    second = raw.parse()

    assert raw.http_response.headers["x-crossbar-lease"] == "reused"
    one, two = rows_since(started, 2)
    assert one.fingerprint == two.fingerprint and two.lease == "reused"
    assert one.prompt_tokens is not None and two.prompt_tokens is not None
    assert one.prompt_tokens > 60 and one.cached_tokens is not None
    # At most the chat template's opening, which every prompt shares: `<|im_start|>system\n`
    # and the BOS are 10 tokens of the tiny model's vocabulary.
    assert one.cached_tokens <= 10
    # The whole first prompt comes from the slot's cache; only the new turn is evaluated.
    assert two.cached_tokens is not None and two.cached_tokens >= one.prompt_tokens
    assert two.prompt_tokens > two.cached_tokens
    assert second.usage is not None
    assert two.prompt_tokens == second.usage.prompt_tokens
    assert second.usage.prompt_tokens_details is not None
    assert two.cached_tokens == second.usage.prompt_tokens_details.cached_tokens


def test_a_second_turn_after_its_host_was_first_read_finds_its_first_in_the_slot_the_host_chose(
    django_db_setup, tmp_path, fresh_llama
):
    with (
        props_gate(fresh_llama.port) as front,
        running_gateway_on_the_tests_backing(tmp_path, CROSSBAR_HEALTH_TIMEOUT="60") as gateway,
        Ledger(gateway) as ledger,
    ):
        front.props_open.clear()  # the gateway's first read of the host waits on its /props
        add_route("paused", [add_host("llama-paused", front.url, models={ALIAS: (2, 4)})])
        gateway.sync()
        wait_until(lambda: front.props_asked > 0, timeout=10, what="the host's first read")
        started = timezone.now()
        http: Any = ledger.client  # the openai package's own httpx, to mypy
        client = openai.OpenAI(
            base_url=f"{gateway.url}/paused/v1", api_key="unused", http_client=http
        )
        first_turn: list[ChatCompletionMessageParam] = [
            {"role": "system", "content": "Answer in French, whatever the question. " * 8},
            {"role": "user", "content": "Bonjour ?"},
        ]
        first = client.chat.completions.create(
            model=ALIAS, messages=first_turn, max_tokens=4, temperature=0
        )
        # The user pauses; meanwhile the gateway reads the host: its /props gives its slots.
        front.props_open.set()
        wait_for_host_state(gateway.url, "llama-paused", "up")
        client.chat.completions.create(
            model=ALIAS,
            messages=[
                *first_turn,
                {"role": "assistant", "content": first.choices[0].message.content or ""},
                {"role": "user", "content": "Au revoir."},
            ],
            max_tokens=4,
            temperature=0,
        )
        one, two = rows_since(started, 2)
        ledger.settle()

    # Its slots unknown, the first turn named none: llama-server gave it its last slot (of
    # two empty ones, the last it looks at). Had the second named slot 0, the conversation's
    # number, it would have read its whole prompt again there.
    assert one.prompt_tokens is not None and two.cached_tokens is not None
    assert two.cached_tokens >= one.prompt_tokens, fresh_llama.log()[-1500:]


History = list[ChatCompletionMessageParam]


def conversations_on(
    gateway, ledger, route: str, host: str, url: str
) -> Callable[[History], History]:
    """A route `route` of one host `host` with 2 slots at `url`, up (its /props said its
    slots), and `ask`: a chat turn through it with the OpenAI client, which gives back the
    history with the answer added. A host of a name of its own, so that no lease of another
    test counts on it (`llama1`'s may)."""
    add_route(route, [add_host(host, url, models={ALIAS: (2, 4)})])
    gateway.sync()
    wait_for_host_state(gateway.url, host, "up")
    client = openai.OpenAI(
        base_url=f"{gateway.url}/{route}/v1", api_key="unused", http_client=ledger.client
    )

    def ask(messages: History) -> History:
        answer = client.chat.completions.create(
            model=ALIAS, messages=messages, max_tokens=4, temperature=0
        )
        # The gateway reads the answer's counts as the response ends, an instant after the
        # client has it: the next turn is named by what they said.
        wait_for_gauge(gateway.url, "crossbar_in_flight", 0, host=host, model=ALIAS)
        return [*messages, {"role": "assistant", "content": answer.choices[0].message.content}]

    return ask


def test_conversations_sharing_a_system_prompt_each_find_their_own_history_in_its_slot(
    gateway, llama, ledger
):
    ask = conversations_on(gateway, ledger, "slots", "llama-slots", llama.url)
    started = timezone.now()
    system = "You work the night shift at a harbour's shipping desk. Be brief. " * 6

    # Each second conversation begins while the first sits idle in its slot: left to choose,
    # llama-server gives it the slot whose prompt shares the most with it, the first's.
    histories = [
        ask([{"role": "system", "content": system}, {"role": "user", "content": question}])
        for question in ("Where is crate 12?", "Which berth is free?")
    ]
    for history in histories:
        ask([*history, {"role": "user", "content": "And after that?"}])

    a1, b1, a2, b2 = rows_since(started, 4)
    assert [row.lease for row in (a1, b1, a2, b2)] == ["new", "new", "reused", "reused"]
    for first, second in ((a1, a2), (b1, b2)):
        assert first.prompt_tokens is not None and second.cached_tokens is not None
        # The whole first turn came from the conversation's own slot.
        assert second.cached_tokens >= first.prompt_tokens


THREE = (
    "List the harbour's berths, one by one. " * 8,
    "Name every crane on the quay in turn. " * 8,
    "Count the tugboats moored at dawn, please. " * 8,
)  # three conversations with nothing in common, on a host of two slots


def take_turns(
    ask: Callable[[History], History], openings: Sequence[str], rounds: int
) -> list[History]:
    """A conversation for each of `openings`, turn by turn in their order, `rounds` turns
    each; their histories. Three on a host of two slots: the first and the third share
    slot 0, each turn of one after a turn of the other."""
    histories = [ask([{"role": "user", "content": opening}]) for opening in openings]
    for _ in range(rounds - 1):
        histories = [ask([*h, {"role": "user", "content": "And after that?"}]) for h in histories]
    return histories


def test_on_a_unified_kv_cache_the_host_chooses_the_slots_once_it_emptied_a_named_one(
    gateway, llama_unified, ledger
):
    ask = conversations_on(gateway, ledger, "kvu", "llama-kvu", llama_unified.url)
    started = timezone.now()

    # Two conversations with nothing in common; each request that starts empties the idle
    # slots (into the host's --cache-ram), so the first's slot is empty when it comes back.
    first, _ = take_turns(ask, THREE[:2], rounds=3)
    ask([*first, {"role": "user", "content": "And last?"}])

    a1, b1, a2, b2, a3, b3, a4 = rows_since(started, 7)
    assert [row.lease for row in (a1, b1, a2, b2, a3, b3, a4)] == ["new"] * 2 + ["reused"] * 5
    # Named, the first's second and third turns found its slot empty and were read whole (a
    # restart would have emptied it once): what the gateway learns the host by. From then on
    # llama-server chooses, and loads each history back from its prompt cache.
    assert (a2.cached_tokens, a3.cached_tokens) == (0, 0)
    assert b3.cached_tokens is not None and b2.prompt_tokens is not None
    assert b3.cached_tokens >= b2.prompt_tokens
    assert a4.cached_tokens is not None and a3.prompt_tokens is not None
    assert a4.cached_tokens >= a3.prompt_tokens


def test_conversations_sharing_a_slot_take_turns_in_it_and_it_stays_named(gateway, llama, ledger):
    ask = conversations_on(gateway, ledger, "shared-slot", "llama-shared-slot", llama.url)
    started = timezone.now()

    take_turns(ask, THREE, rounds=2)

    a1, b1, c1, a2, b2, c2 = rows_since(started, 6)
    # Every turn found something of its slot's last prompt (the chat template's opening at
    # least, or its own history back from --cache-ram): nothing looked emptied.
    assert all(row.cached_tokens for row in (c1, a2, b2, c2)), [
        row.cached_tokens for row in (a1, b1, c1, a2, b2, c2)
    ]
    assert slot_naming(gateway.url)[f"llama-shared-slot/{ALIAS}"] == 1.0


def test_on_a_unified_kv_cache_conversations_sharing_a_slot_stop_its_naming_too(
    gateway, llama_unified, ledger
):
    ask = conversations_on(gateway, ledger, "kvu-shared", "llama-kvu-shared", llama_unified.url)
    started = timezone.now()

    take_turns(ask, THREE, rounds=3)

    a1, b1, c1, a2, b2, c2, a3, b3, c3 = rows_since(started, 9)
    # Slot 0, idle as the second's turns started, was found empty for the third's first two
    # turns (the first's second, after the third's in it, loaded its history back): named no
    # more, each next turn comes back whole from the host's prompt cache.
    assert (c1.cached_tokens, c2.cached_tokens) == (0, 0)
    assert slot_naming(gateway.url)[f"llama-kvu-shared/{ALIAS}"] == 0.0
    for before, after in ((a2, a3), (b2, b3), (c2, c3)):
        assert before.prompt_tokens is not None and after.cached_tokens is not None
        assert after.cached_tokens >= before.prompt_tokens


# Three conversations opening with the same long system prompt, on a host of two slots: the
# first and the third share slot 0. The prompt is most of each first turn, so a conversation
# coming back to the slot the other overwrote keeps more than half of what the slot holds.
HARBOUR = "You keep the harbour master's log. Answer with a berth and a time, nothing else. " * 5
# Each question is asked six times over: long enough that a conversation's own part is
# several of the prefix index's blocks, short enough that the system prompt stays over half of
# a first turn.
QUESTIONS = tuple(
    question * 6
    for question in (
        "Which berth takes the grain ship arriving from the north tonight? ",
        "When does the ferry to the islands leave on the morning tide? ",
        "Where do the fishing boats unload when the east quay is closed? ",
    )
)


def share_two_slots(ask: Callable[[History], History]) -> list[Request]:
    """Two turns of each of QUESTIONS, turn by turn, through `ask`; their six rows, oldest
    first: the first's, the second's, the third's first turns, then their second turns."""
    started = timezone.now()
    histories = [ask([{"role": "system", "content": HARBOUR}, {"role": "user", "content": q}])
                 for q in QUESTIONS]  # fmt: skip
    for history in histories:
        ask([*history, {"role": "user", "content": "And the one after?"}])
    return rows_since(started, 6)


def test_a_host_with_a_high_slot_prompt_similarity_gives_an_overwritten_slot_its_history_back(
    gateway, llama_similar, ledger
):
    ask = conversations_on(gateway, ledger, "similar", "llama-similar", llama_similar.url)

    a1, b1, c1, a2, b2, c2 = share_two_slots(ask)

    # Named slot 0 held the third's prompt when the first came back to it: under 95% of the
    # prompt, so llama-server saved the slot to its --cache-ram and loaded the first's back.
    # Every second turn found its whole first one.
    for first, second in ((a1, a2), (b1, b2), (c1, c2)):
        assert first.prompt_tokens is not None and second.cached_tokens is not None
        assert second.cached_tokens >= first.prompt_tokens, (first.cached_tokens, second)
    assert shared_slot_lost(gateway.url, "llama-similar") == 0


def test_with_the_default_similarity_a_slot_another_conversation_overwrote_keeps_only_the_opening(
    gateway, llama, ledger
):
    ask = conversations_on(gateway, ledger, "dissimilar", "llama-dissimilar", llama.url)

    a1, b1, c1, a2, b2, c2 = share_two_slots(ask)

    # Slot 0 held the third's prompt, which shares the system prompt with the first's: over
    # 10% of it, and more than half of what the slot held, so llama-server took the slot as
    # it was and read the first's own question again (why docs/config.md advises -sps 0.95).
    assert a1.prompt_tokens is not None and a2.cached_tokens is not None
    assert a1.cached_tokens is not None and c1.cached_tokens is not None
    # What it found is what the third had found of the first: the system prompt they share.
    assert a2.cached_tokens == c1.cached_tokens < a1.prompt_tokens + a1.cached_tokens
    # The second conversation had slot 1 to itself.
    assert b1.prompt_tokens is not None and b2.cached_tokens is not None
    assert b2.cached_tokens >= b1.prompt_tokens
    # The first's and the third's second turns each came back to a slot the other had used
    # and found only what they share: counted, for the operator (docs/config.md).
    assert shared_slot_lost(gateway.url, "llama-dissimilar") == 2


def second_conversation_on_a_fresh_host(ask: Callable[[History], History]) -> list[Request]:
    """Through `ask`, on a host just started: the first of QUESTIONS, two turns, then the
    second, two turns; their four rows, oldest first. A follow-up of some 30 tokens keeps
    each turn's prompt under 95% of the next, so that llama-server at -sps 0.95 saves a
    slot's prompt to its --cache-ram as a turn begins there."""
    started = timezone.now()
    follow_up: ChatCompletionMessageParam = {"role": "user", "content": "And the one after? " * 5}
    for question in QUESTIONS[:2]:
        history = ask(
            [{"role": "system", "content": HARBOUR}, {"role": "user", "content": question}]
        )
        ask([*history, follow_up])
    return rows_since(started, 4)


def test_a_host_said_to_run_at_0_95_gives_a_new_conversation_the_shared_opening_in_its_empty_slot(
    django_db_setup, tmp_path, fresh_llama_similar
):
    with (
        running_gateway(tmp_path, CROSSBAR_SLOT_PROMPT_SIMILARITY="0.95") as gateway,
        Ledger(gateway) as ledger,
    ):
        ask = conversations_on(gateway, ledger, "fresh", "llama-fresh", fresh_llama_similar.url)
        a1, a2, b1, b2 = second_conversation_on_a_fresh_host(ask)
        ledger.settle()

    # The second conversation's first turn named no slot: llama-server gave it slot 1, empty,
    # and loaded into it the first's prompt that its second turn had saved to --cache-ram, so
    # the system prompt they share (over half of a first turn) came from cache. Told slot 1
    # next, its second turn found its whole first there. (A row's prompt_tokens is the whole
    # prompt, cached_tokens the part of it the host took from cache.)
    assert a1.cached_tokens == 0 and b1.cached_tokens is not None and b1.prompt_tokens
    assert b1.cached_tokens > b1.prompt_tokens / 2
    assert b2.cached_tokens is not None and b2.cached_tokens >= b1.prompt_tokens


def test_at_the_default_similarity_a_new_conversation_reads_its_empty_named_slot_whole(
    gateway, fresh_llama_similar, ledger
):
    ask = conversations_on(
        gateway, ledger, "fresh-named", "llama-fresh-named", fresh_llama_similar.url
    )

    a1, a2, b1, b2 = second_conversation_on_a_fresh_host(ask)

    # Told to be at 0.1, the gateway named the empty slot 1 (at 0.1 llama-server would have
    # given the second conversation slot 0 and overwritten the first's history), and a named
    # empty slot loads nothing from --cache-ram: the whole prompt was read.
    assert b1.cached_tokens == 0
    assert b2.cached_tokens is not None and b1.prompt_tokens is not None
    assert b2.cached_tokens >= b1.prompt_tokens


def shared_slot_lost(url: str, host: str) -> float:
    return gauge(url, "crossbar_shared_slot_lost_total", host=host, model=ALIAS)


def test_text_completions_pass_through_with_their_token_counts(route, ledger):
    started = timezone.now()

    response = ledger.client.post(
        f"{route}/completions",
        json={"model": ALIAS, "prompt": "Once upon a time", "max_tokens": 5, "temperature": 0},
    )

    body = response.json()
    assert response.status_code == 200 and body["object"] == "text_completion"
    assert isinstance(body["choices"][0]["text"], str)
    (row,) = rows_since(started, 1)
    assert (row.status, row.prompt_tokens, row.completion_tokens) == (
        200, body["usage"]["prompt_tokens"], body["usage"]["completion_tokens"]
    )  # fmt: skip


def test_a_streamed_text_completion_ends_with_done(route, ledger):
    body = {"model": ALIAS, "prompt": "Once upon a time", "max_tokens": 5, "stream": True}

    with ledger.client.stream("POST", f"{route}/completions", json=body) as response:
        events = [line for line in response.iter_lines() if line.startswith("data: ")]

    assert response.status_code == 200
    assert events[-1] == "data: [DONE]" and len(events) >= 2


def test_embeddings_come_from_an_embeddings_instance(gateway, llama_embeddings, ledger):
    add_route("embed", [add_host("llama-embed", llama_embeddings.url, models={ALIAS: (2, 4)})])
    gateway.sync()
    client = openai.OpenAI(
        base_url=f"{gateway.url}/embed/v1", api_key="unused", http_client=ledger.client
    )

    result = client.embeddings.create(model=ALIAS, input=["hello world", "goodbye"])

    assert [item.index for item in result.data] == [0, 1]
    assert all(len(item.embedding) == 64 for item in result.data)  # the tiny model's width
    assert result.usage.prompt_tokens > 0


def test_models_lists_the_routes_model(route, ledger):
    client = openai.OpenAI(base_url=route, api_key="unused", http_client=ledger.client)

    listed = client.models.list()

    assert [m.id for m in listed.data] == [ALIAS]


def test_health_and_props_come_from_llama_server(gateway, route, ledger):
    health = ledger.client.get("/tiny/health")
    props = ledger.client.get("/tiny/props")

    assert (health.status_code, health.json()) == (200, {"status": "ok"})
    assert health.headers["x-crossbar-host"] == "llama1"
    assert props.status_code == 200
    assert props.json()["total_slots"] == 2
    assert props.json()["default_generation_settings"]["n_ctx"] > 0
