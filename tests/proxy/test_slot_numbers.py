"""A conversation served on its lease's host names a slot of its own there (`id_slot`), while
the host has a slot for each conversation leased to it; otherwise llama-server chooses.

What the host receives is what a user of llama-server would see in its log: the request body
the gateway sent, read here off the fake llama-server over real sockets; with
`CROSSBAR_TEST_SHARED=1`, through the Redis-shared state, which keeps the numbers in Redis.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest

from tests.fakes.llama_server import FakeLlamaServer
from tests.helpers import wire
from tests.helpers.asking import conversation, send, turn
from tests.helpers.fleet import MODEL, POLLS, add_host, add_route, chat
from tests.helpers.gateway import running_gateway, running_gateway_on_the_tests_backing, signed_in
from tests.helpers.observe import (
    gauge,
    slot_naming,
    wait_for_health_poll,
    wait_for_host_state,
)
from tests.helpers.waits import wait_until

pytestmark = pytest.mark.django_db(transaction=True)


def sent(fake: FakeLlamaServer) -> list[dict]:
    """The bodies of the generations the host was asked, in order."""
    return [json.loads(seen.body) for seen in fake.seen if seen.path not in POLLS]


def test_each_conversation_names_a_slot_of_its_own_and_keeps_it_turn_after_turn(gateway, fake):
    add_route("chat", [add_host("gpu1", fake.url, models={MODEL: (2, 2)})])
    gateway.sync()
    wait_for_health_poll(fake)  # its /props said its slots

    turn(gateway, "first conversation")
    turn(gateway, "second conversation")
    turn(gateway, "first conversation", "and then?")
    turn(gateway, "second conversation", "and then?")

    assert [body.get("id_slot") for body in sent(fake)] == [0, 1, 0, 1]


def test_a_conversations_parallel_request_leaves_its_busy_slot_to_the_host(gateway, fake):
    add_route("chat", [add_host("gpu1", fake.url, models={MODEL: (2, 2)})])
    gateway.sync()
    wait_for_health_poll(fake)
    fake.token_delay = 0.05  # the first request streams for a while
    url = f"{gateway.url}/chat/v1/chat/completions"

    with httpx.stream("POST", url, json={**chat("one"), "stream": True}, timeout=10) as first:
        lines = first.iter_lines()  # kept: a generator dropped closes the response
        next(lines)  # it streams: its slot is busy
        turn(gateway, "one", alone=False)  # the same conversation, meanwhile
        assert fake.max_concurrent == 2
    turn(gateway, "one", "again")  # after the first ended

    # The second would otherwise wait in llama-server for slot 0 while slot 1 sits idle;
    # re-reading a prompt this short there costs nothing to speak of.
    assert [body.get("id_slot") for body in sent(fake)] == [0, None, 0]


def test_a_conversations_parallel_request_waits_for_its_slot_when_its_prompt_is_slow_to_read(
    gateway, fake
):
    add_route("chat", [add_host("gpu1", fake.url, models={MODEL: (2, 2)})])
    gateway.sync()
    wait_for_health_poll(fake)
    fake.prompt_token_ms = 50.0  # 20 prompt tokens a second
    turn(gateway, opening("one"))
    fake.token_delay = 0.05

    with streaming(gateway, conversation(opening("one"), "again")):
        turn(gateway, opening("one"), "again", alone=False)  # the same turn, meanwhile

    # Slot 0 will hold the whole prompt; slot 1, nothing of it.
    assert [body.get("id_slot") for body in sent(fake)] == [0, 0, 0]


def test_with_more_conversations_than_slots_they_share_the_slots_as_evenly_as_they_can(
    gateway, fake
):
    add_route("chat", [add_host("gpu1", fake.url, models={MODEL: (2, 2)})])
    gateway.sync()
    wait_for_health_poll(fake)

    for opening in ("one", "two", "three", "four"):
        turn(gateway, opening)
    turn(gateway, "one", "again")
    turn(gateway, "two", "again")

    assert [body.get("id_slot") for body in sent(fake)] == [0, 1, 0, 1, 0, 1]


def opening(name: str) -> str:
    """An opening of its own, some 600 characters: whole blocks of the prefix index (256
    characters each) that no other conversation's prompt shares. Its first word is every
    opening's, as a chat template's opening is every chat's."""
    return "Hello " + " ".join(f"{name}-{i}" for i in range(80))


@contextmanager
def streaming(gateway, body: dict) -> Iterator[None]:
    """A turn streaming, from its first line on: its slot is busy until the block ends,
    which closes the stream."""
    url = f"{gateway.url}/chat/v1/chat/completions"
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=10) as response:
        assert response.status_code == 200
        lines = response.iter_lines()  # kept: a generator dropped closes the response
        next(lines)
        yield


@contextmanager
def sent_in_background(gateway, fake: FakeLlamaServer, body: dict) -> Iterator[None]:
    """A turn sent from another thread, from the moment the host has it on: it may wait in
    the host for the slot it names, before any byte of its answer. Answered when the block
    ends."""
    before = len(sent(fake))
    worker = threading.Thread(target=send, args=(gateway, body, False))
    worker.start()
    try:
        wait_until(lambda: len(sent(fake)) > before, what="the host to have the turn")
        yield
    finally:
        worker.join(timeout=30)
    assert not worker.is_alive(), "the turn sent in the background was never answered"


def test_a_conversation_whose_slot_another_is_using_leaves_it_to_the_host_that_reads_it_sooner(
    gateway, fake
):
    add_route("chat", [add_host("gpu1", fake.url, models={MODEL: (2, 2)})])
    gateway.sync()
    wait_for_health_poll(fake)
    # Each answer holds its slot some 1.2 s (8 tokens): the wait for slot 0 is priced as that
    # less what three's turn has held it, which on a busy machine can be half a second.
    fake.token_delay = 0.15
    for name in ("one", "two", "three"):  # one and three share slot 0
        turn(gateway, opening(name))

    with streaming(gateway, conversation(opening("three"), "again")):  # slot 0 is busy
        turn(gateway, opening("one"), "again", alone=False)
        assert fake.max_concurrent == 2

    # Waiting for slot 0 (up to some 1.2 s) would cost more than reading one's prompt in slot
    # 1 (some 150 tokens at 10,000 a second), which would sit idle meanwhile.
    assert [body.get("id_slot") for body in sent(fake)] == [0, 1, 0, 0, None]


def test_a_conversation_waits_for_its_busy_slot_when_reading_its_prompt_elsewhere_is_slower(
    gateway, fake
):
    add_route("chat", [add_host("gpu1", fake.url, models={MODEL: (2, 2)})])
    gateway.sync()
    wait_for_health_poll(fake)
    fake.prompt_token_ms = 50.0  # 20 prompt tokens a second, as the host's timings say
    for name in ("one", "two", "three"):  # quick answers: a slot is held for milliseconds
        turn(gateway, opening(name))
    fake.token_delay = 0.05

    with streaming(gateway, conversation(opening("three"), "again")):
        turn(gateway, opening("one"), "again", alone=False)

    # Slot 1 holds nothing of one's prompt: read there, its some 150 tokens would take
    # seconds, and slot 0 holds all but its new turn.
    assert [body.get("id_slot") for body in sent(fake)] == [0, 1, 0, 0, 0]


def shared(name: str, *later: str) -> dict:
    """A turn of the conversation `name`, after a long system prompt every one shares."""
    body = conversation(name, *later)
    body["messages"].insert(0, {"role": "system", "content": opening("system")})
    return body


def busy_slot_with_a_shared_system_prompt(gateway, fake, token_delay: float) -> list[object]:
    """The slots named for one, two and three, which share a long system prompt on a host of
    two slots evaluating 20 prompt tokens a second, each answer's token `token_delay` apart;
    then for one's next turn, while three's (in one's slot 0) streams."""
    add_route("chat", [add_host("gpu1", fake.url, models={MODEL: (2, 2)})])
    gateway.sync()
    wait_for_health_poll(fake)
    fake.prompt_token_ms = 50.0
    fake.token_delay = token_delay
    for name in ("one", "two", "three"):  # one and three share slot 0
        send(gateway, shared(name))
    fake.token_delay = 0.05

    with streaming(gateway, shared("three", "again")):
        send(gateway, shared("one", "again"), alone=False)
    return [body.get("id_slot") for body in sent(fake)]


def test_a_conversation_waits_for_its_busy_slot_rather_than_overwrite_anothers_history(
    gateway, fake
):
    # Slot 1 holds all of one's system prompt, and two's own words after it: read there, one
    # would cost two its history, to be read again on two's next turn. Quick answers (a slot
    # is held for milliseconds) make the wait cheaper.
    assert busy_slot_with_a_shared_system_prompt(gateway, fake, 0.0) == [0, 1, 0, 0, 0]


def test_a_conversation_whose_busy_slot_holds_little_more_than_a_free_one_leaves_it_to_the_host(
    gateway, fake
):
    # Answers that hold their slot over a second: more than one's few words of its own, and
    # two's, take to read again.
    assert busy_slot_with_a_shared_system_prompt(gateway, fake, 0.15) == [0, 1, 0, 0, None]


def test_no_request_waits_for_a_slot_behind_one_that_is_waiting_for_it(gateway, fake):
    add_route("chat", [add_host("gpu1", fake.url, models={MODEL: (3, 2)})])
    gateway.sync()
    wait_for_health_poll(fake)
    fake.prompt_token_ms = 50.0
    names = [f"c{n}" for n in range(1, 8)]  # c1, c4 and c7 share slot 0
    for name in names:
        turn(gateway, opening(name))
    fake.token_delay = 0.05

    with (
        streaming(gateway, conversation(opening("c4"), "again")),
        sent_in_background(gateway, fake, conversation(opening("c1"), "again")),  # waits for 0
    ):
        turn(gateway, opening("c7"), "again", alone=False)
        assert fake.max_concurrent == 3

    assert [body.get("id_slot") for body in sent(fake)] == [0, 1, 2, 0, 1, 2, 0, 0, 0, None]


def two_conversations_begun(gateway, fake: FakeLlamaServer) -> None:
    """A route of the one host `fake` with two slots, read, and a first turn of "first
    conversation" and of "second conversation" on it: slots 0 and 1."""
    add_route("chat", [add_host("gpu1", fake.url, models={MODEL: (2, 2)})])
    gateway.sync()
    wait_for_health_poll(fake)
    turn(gateway, "first conversation")
    turn(gateway, "second conversation")


def test_a_host_found_emptying_one_of_its_slots_twice_is_named_no_slot_again(gateway, fake):
    two_conversations_begun(gateway, fake)
    naming = [slot_naming(gateway.url)]
    # What llama-server with a unified KV cache does to idle slots when a task starts: it
    # saves them to --cache-ram and empties them. Each next answer on a named slot says 0
    # cached; slot 0 found emptied a second time settles it.
    fake.forget_cache()
    turn(gateway, "first conversation", "and then?")
    fake.forget_cache()
    turn(gateway, "second conversation", "and then?")
    fake.forget_cache()
    turn(gateway, "first conversation", "and then?", "and after?")
    turn(gateway, "second conversation", "and then?", "and after?")
    turn(gateway, "first conversation", "and then?", "and after?", "and last?")
    naming.append(slot_naming(gateway.url))

    assert [body.get("id_slot") for body in sent(fake)] == [0, 1, 0, 1, 0, None, None]
    assert naming == [{f"gpu1/{MODEL}": 1.0}, {f"gpu1/{MODEL}": 0.0}]  # an operator sees it


def test_a_restart_the_poller_did_not_see_leaves_the_hosts_slots_named(gateway, fake):
    two_conversations_begun(gateway, fake)

    fake.forget_cache()  # every slot emptied at once, between two polls
    turn(gateway, "first conversation", "and then?")  # read whole: emptied, once
    turn(gateway, "second conversation", "and then?")
    turn(gateway, "first conversation", "and then?", "and after?")  # its slot holds it again
    turn(gateway, "second conversation", "and then?", "and after?")

    assert [body.get("id_slot") for body in sent(fake)] == [0, 1, 0, 1, 0, 1]
    assert slot_naming(gateway.url) == {f"gpu1/{MODEL}": 1.0}


def test_a_host_read_anew_after_it_was_down_is_named_slots_again_from_its_empty_slots(
    gateway, fake
):
    add_route("chat", [add_host("gpu1", fake.url, models={MODEL: (2, 2)})])
    gateway.sync()
    wait_for_health_poll(fake)
    turn(gateway, "first conversation")
    fake.forget_cache()
    turn(gateway, "first conversation", "and then?")
    fake.forget_cache()
    turn(gateway, "first conversation", "and then?", "and after?")  # twice: named no more
    stopped = slot_naming(gateway.url)

    # A restart the poller sees: down, every slot empty, up and read anew.
    fake.health = "error"
    wait_for_host_state(gateway.url, "gpu1", "down")
    fake.forget_cache()
    fake.health = "ok"
    wait_for_host_state(gateway.url, "gpu1", "up")
    wait_for_health_poll(fake)
    # Its first answer finds nothing cached, as after any restart: that says nothing of it.
    turn(gateway, "first conversation", "and then?", "and after?")
    turn(gateway, "first conversation", "and then?", "and after?", "and last?")

    assert [body.get("id_slot") for body in sent(fake)] == [0, 0, 0, 0, 0]
    assert (stopped, slot_naming(gateway.url)) == ({f"gpu1/{MODEL}": 0.0}, {f"gpu1/{MODEL}": 1.0})


def test_the_slot_named_is_below_the_hosts_own_slot_count(gateway):
    with FakeLlamaServer(slots=1) as fake:
        # parallel above the host's slots (a configuration check warns of it): slot 0 only.
        add_route("chat", [add_host("gpu1", fake.url, models={MODEL: (2, 2)})])
        gateway.sync()
        wait_for_health_poll(fake)

        turn(gateway, "one")
        turn(gateway, "two")

        # The first left to the host (its one slot, empty: llama-server gives it the slot
        # through --cache-ram), the second sharing the one.
        assert [body.get("id_slot") for body in sent(fake)] == [None, 0]


def slots_told_over_two_turns(gateway, fake: FakeLlamaServer) -> list[object]:
    """The `id_slot` each of a conversation's two turns named ("none": no field), on a route
    of the one host `fake` with two slots."""
    add_route("chat", [add_host("gpu1", fake.url, models={MODEL: (2, 2)})])
    gateway.sync()
    wait_for_health_poll(fake)
    turn(gateway, "one")
    turn(gateway, "one", "again")
    return [body.get("id_slot", "none") for body in sent(fake)]


def test_a_host_that_says_no_slot_count_is_never_told_a_slot(gateway):
    with FakeLlamaServer(router_models=(MODEL,)) as fake:  # a router: its /props says no slots
        assert slots_told_over_two_turns(gateway, fake) == ["none", "none"]
        assert slot_naming(gateway.url) == {}  # nothing to stop or to watch


def test_a_renamed_model_is_asked_with_the_conversations_slot_too(gateway, fake):
    host = add_host("gpu1", fake.url, models={MODEL: (2, 2)}, upstream_names={MODEL: "qwen"})
    add_route("chat", [host])
    gateway.sync()
    wait_for_health_poll(fake)

    turn(gateway, "one")

    [body] = sent(fake)
    assert (body["model"], body.get("id_slot")) == ("qwen", 0)


def test_a_responses_request_names_its_slot_too(gateway, fake):
    add_route("chat", [add_host("gpu1", fake.url, models={MODEL: (2, 2)})])
    gateway.sync()
    wait_for_health_poll(fake)
    body = {"model": MODEL, "input": "hello", "instructions": "be brief"}

    httpx.post(f"{gateway.url}/chat/v1/responses", json=body, timeout=10)

    assert [body.get("id_slot") for body in sent(fake)] == [0]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/chat/v1/embeddings", {"model": MODEL, "input": "hello"}),
        (  # llama-server's Anthropic conversion would drop it
            "/chat/v1/messages",
            {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]},
        ),
    ],
)
def test_paths_whose_body_llama_server_reads_no_slot_from_are_sent_as_they_came(
    gateway, fake, path, body
):
    add_route("chat", [add_host("gpu1", fake.url, models={MODEL: (2, 2)})])
    gateway.sync()
    wait_for_health_poll(fake)
    raw = json.dumps(body).encode()

    httpx.post(f"{gateway.url}{path}", content=raw, timeout=10)

    assert [seen.body for seen in fake.seen if seen.path not in POLLS] == [raw]


def test_an_empty_slot_is_left_to_a_host_said_to_run_at_a_high_slot_prompt_similarity(
    django_db_setup, tmp_path
):
    with (
        FakeLlamaServer(slots=2) as fake,
        running_gateway(tmp_path, CROSSBAR_SLOT_PROMPT_SIMILARITY="0.95") as gateway,
    ):
        add_route("chat", [add_host("gpu1", fake.url, models={MODEL: (2, 2)})])
        gateway.sync()
        wait_for_health_poll(fake)
        first, second = (f"{SHARED} {opening(name)}" for name in ("one", "two"))

        turn(gateway, first)  # slot 0; slot 1 not known yet: named
        turn(gateway, second)  # slot 1, empty, and slot 0 holds under 95% of its prompt
        turn(gateway, second, "and then?")
        turn(gateway, first, "and then?")

    # The second's first turn named none: llama-server gives it its least recently used
    # slot, the empty one, loaded from --cache-ram, where naming it would load nothing. Its
    # next turn is told the slot it went to.
    assert [body.get("id_slot", "none") for body in sent(fake)] == [0, "none", 1, 0]


def test_at_the_default_similarity_an_empty_slot_is_named_when_another_holds_the_opening(
    gateway, fake_of_two
):
    add_route("chat", [add_host("gpu1", fake_of_two.url, models={MODEL: (2, 2)})])
    gateway.sync()
    wait_for_health_poll(fake_of_two)

    turn(gateway, f"{SHARED} {opening('one')}")
    turn(gateway, f"{SHARED} {opening('two')}")

    # Left to llama-server at 0.1, the second would take slot 0, which holds the opening the
    # two share: over 10% of its prompt.
    assert [body.get("id_slot", "none") for body in sent(fake_of_two)] == [0, 1]


def test_a_conversation_first_served_before_its_host_was_read_is_left_to_the_hosts_choice(
    django_db_setup, tmp_path, fake
):
    fake.props_open.clear()  # the host's first read waits on its /props
    with running_gateway_on_the_tests_backing(tmp_path, CROSSBAR_HEALTH_TIMEOUT="60") as gateway:
        add_route("chat", [add_host("gpu1", fake.url, models={MODEL: (2, 2)})])
        gateway.sync()
        wait_until(lambda: fake.requests_to("/props"), 10, what="the host's first read")
        turn(gateway, "first conversation")  # its slots unknown: the host chooses one
        fake.props_open.set()
        wait_for_health_poll(fake)  # its /props said its slots
        turn(gateway, "first conversation", "and then?")
        turn(gateway, "second conversation")

    # Named slot 0, the first's second turn would leave the slot the host gave its first
    # (llama-server gives an unnamed request on a fresh host its last slot); unnamed, it goes
    # where its history is. A conversation begun once the host was read is named as before.
    assert [body.get("id_slot") for body in sent(fake)] == [None, None, 0]


def test_an_operator_can_leave_every_slot_to_the_hosts(django_db_setup, tmp_path, fake):
    with running_gateway(tmp_path, CROSSBAR_NAME_SLOTS="false") as gateway:
        assert slots_told_over_two_turns(gateway, fake) == ["none", "none"]


# The opening three conversations share (some 1,100 characters: four of the prefix index's
# blocks), as agents share a system prompt and tools; each then has an opening of its own.
SHARED = " ".join(f"tool-{i}" for i in range(150))


def shared_slot_lost(gateway) -> float:
    return gauge(gateway.url, "crossbar_shared_slot_lost_total", host="gpu1", model=MODEL)


@pytest.fixture
def fake_of_two() -> Iterator[FakeLlamaServer]:
    """A fake llama-server with 2 slots and no prompt cache beyond them (`--cache-ram 0`): it
    keeps the last two prompts it was sent, so a slot another conversation took keeps only
    what the two share, as llama-server at its default --slot-prompt-similarity gives it."""
    with FakeLlamaServer(slots=2, cache_ram=0) as server:
        yield server


def test_a_conversation_given_back_only_the_opening_it_shares_with_its_slots_last_is_counted(
    gateway, fake_of_two
):
    fake = fake_of_two
    add_route("chat", [add_host("gpu1", fake.url, models={MODEL: (2, 2)})])
    gateway.sync()
    wait_for_health_poll(fake)
    first, second, third = (f"{SHARED} {opening(name)}" for name in ("one", "two", "three"))
    before = shared_slot_lost(gateway)  # the gateway's counters run across tests

    for each in (first, second, third):  # slots 0, 1, then 0 again
        turn(gateway, each)
    assert shared_slot_lost(gateway) == before  # the third was due only the opening
    turn(gateway, first, "and then?")

    # The fake keeps as many prompts as it has slots, the last two: the first's came back to
    # slot 0 and found only what it shares with the third's, as llama-server at its default
    # --slot-prompt-similarity does, where the index expected its whole first turn.
    assert [body.get("id_slot") for body in sent(fake)] == [0, 1, 0, 0]
    assert shared_slot_lost(gateway) == before + 1
    assert "--slot-prompt-similarity 0.95" in gateway.log()


def test_the_shared_slot_warning_clears_once_the_host_is_restarted(
    gateway, fake_of_two, admin_user
):
    fake = fake_of_two
    add_route("chat", [add_host("gpu1", fake.url, models={MODEL: (2, 2)})])
    gateway.sync()
    wait_for_health_poll(fake)
    first, second, third = (f"{SHARED} {opening(name)}" for name in ("one", "two", "three"))
    for each in (first, second, third):
        turn(gateway, each)
    turn(gateway, first, "and then?")
    assert shared_slot_lost(gateway) >= 1
    admin = signed_in(gateway)
    assert "on a shared slot got back only" in admin.get("/admin/hosts/host/").text

    fake.fail_mode = "refuse"  # restarted, say with --slot-prompt-similarity 0.95
    wait_for_host_state(gateway.url, "gpu1", "down")
    fake.fail_mode = None
    wait_for_host_state(gateway.url, "gpu1", "up")
    wait_for_health_poll(fake)  # read anew

    assert shared_slot_lost(gateway) == 0
    assert "on a shared slot got back only" not in admin.get("/admin/hosts/host/").text


def test_a_conversation_that_lost_its_own_slots_cache_is_not_counted_as_a_shared_slot(
    gateway, fake
):
    add_route("chat", [add_host("gpu1", fake.url, models={MODEL: (2, 2)})])
    gateway.sync()
    wait_for_health_poll(fake)
    first = f"{SHARED} {opening('one')}"
    lost, shared = (
        gauge(gateway.url, "crossbar_cache_lost_total", host="gpu1"),
        shared_slot_lost(gateway),
    )
    turn(gateway, first)

    fake.forget_cache()  # evicted, or a restart the poller did not see
    turn(gateway, first, "and then?")

    assert gauge(gateway.url, "crossbar_cache_lost_total", host="gpu1") == lost + 1
    assert shared_slot_lost(gateway) == shared


def hanging(gateway, fake: FakeLlamaServer, body: dict) -> socket.socket:
    """A turn sent on a socket of its own, which `fake` holds without an answer (in the slot
    it took) until the socket is closed."""
    before = len(sent(fake))
    fake.fail_mode, fake.fail_count = "hang", 1
    sock = wire.send(
        gateway.url, b"POST", b"/chat/v1/chat/completions", json.dumps(body).encode(),
        {b"Content-Type": b"application/json"},
    )  # fmt: skip
    wait_until(lambda: len(sent(fake)) > before, what="the host to hold the turn")
    return sock


def test_a_home_request_never_names_a_slot_that_a_request_spilled_there_may_be_running_in(
    gateway, fake, fake2
):
    gpu1 = add_host("gpu1", fake.url, models={MODEL: (2, 2)})
    gpu2 = add_host("gpu2", fake2.url, models={MODEL: (1, 2)})
    add_route("chat", [gpu1, gpu2], lease_patience=0.0)  # a full home spills at once
    gateway.sync()
    wait_for_health_poll(fake)
    wait_for_health_poll(fake2)
    turn(gateway, "one")  # gpu1's slot 0
    fake.token_delay = 0.05
    with streaming(gateway, chat("two")):  # gpu1's slot 1; gpu1 now holds a lease per slot
        x = turn(gateway, "x")
    assert x.headers["X-Crossbar-Host"] == "gpu2"
    fake.token_delay = 0.0

    home = hanging(gateway, fake2, conversation("x", "again"))  # gpu2's one slot
    spilled = hanging(gateway, fake, conversation("x", "and again"))  # gpu1 runs it unnamed
    try:
        assert sent(fake)[-1].get("id_slot") is None
        assert fake._busy[None].keys() == {0}  # llama-server put it in slot 0, one's
        answer = turn(gateway, "one", "again", alone=False)  # at home: gpu1 has a free slot
    finally:
        home.close()
        spilled.close()

    # Naming slot 0 would hold one's turn in llama-server until the spilled request ends
    # (here: never), while slot 1 sits idle.
    assert answer.headers["X-Crossbar-Placement"] == "home"
    assert sent(fake)[-1].get("id_slot") is None
