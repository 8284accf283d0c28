"""The proxy end to end: a real daphne server, fake llama-servers over real sockets."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.helpers.asking import completions
from tests.helpers.fleet import MODEL, add_host, add_route, chat
from tests.helpers.gateway import running_gateway
from tests.helpers.observe import wait_for_gauge, wait_for_health_poll, wait_for_host_state
from tests.helpers.waits import wait_until

pytestmark = pytest.mark.django_db(transaction=True)


def stream_lines(response: httpx.Response) -> list[bytes]:
    return [line for line in response.read().split(b"\n") if line.startswith(b"data: ")]


def test_streamed_chat_arrives_whole_with_host_and_lease_headers(gateway, fake):
    add_route("chat", [add_host("gpu1", fake.url)])
    gateway.sync()

    body = chat(stream=True, max_tokens=5)
    direct = httpx.post(f"{fake.url}/v1/chat/completions", json=body)
    through = httpx.post(f"{gateway.url}/chat/v1/chat/completions", json=body)

    assert through.status_code == 200
    assert through.headers["content-type"].startswith("text/event-stream")
    assert through.headers["x-crossbar-host"] == "gpu1"
    assert through.headers["x-crossbar-lease"] == "new"
    assert through.headers["x-crossbar-queued-ms"] == "0"
    assert len(stream_lines(through)) == len(stream_lines(direct)) == 5 + 1
    assert through.text.endswith("data: [DONE]\n\n")


def test_the_openai_client_streams_and_reads_whole_answers_through_the_gateway(gateway, fake):
    add_route("chat", [add_host("gpu1", fake.url)])
    gateway.sync()
    client = openai.OpenAI(base_url=f"{gateway.url}/chat/v1", api_key="client-secret")

    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "count to four"}],
        stream=True,
        max_tokens=4,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    whole = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "again"}], max_tokens=3
    )

    assert text == "tok0 tok1 tok2 tok3 "
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4
    assert whole.choices[0].message.content == "tok0 tok1 tok2 "
    assert whole.usage is not None and whole.usage.completion_tokens == 3


def test_the_route_can_come_from_the_header_with_a_plain_v1_path(gateway, fake):
    add_route("chat", [add_host("gpu1", fake.url)])
    gateway.sync()

    response = httpx.post(
        f"{gateway.url}/v1/chat/completions", json=chat(), headers={"X-Crossbar-Route": "chat"}
    )

    assert response.status_code == 200
    assert response.headers["x-crossbar-host"] == "gpu1"
    assert completions(fake)[-1].path == "/v1/chat/completions"


def test_fifth_request_waits_and_ninth_is_refused_at_once(gateway, fake):
    fake.token_delay = 0.1  # each request takes 10 s, until the test lets them finish
    add_route("chat", [add_host("gpu1", fake.url, models={MODEL: (4, 4)})])
    gateway.sync()

    def slow(i: int) -> httpx.Response:
        body = chat(f"conversation {i}", stream=True, max_tokens=100)
        return httpx.post(f"{gateway.url}/chat/v1/chat/completions", json=body, timeout=60)

    with ThreadPoolExecutor(8) as pool:
        running = [pool.submit(slow, i) for i in range(8)]
        wait_until(lambda: fake.in_flight == 4, what="four requests running upstream")
        wait_for_gauge(gateway.url, "crossbar_queued", 4, host="gpu1", model=MODEL)
        refused = httpx.post(f"{gateway.url}/chat/v1/chat/completions", json=chat("ninth"))
        # At once: no slot had been freed when the refusal came back.
        unfinished = sum(not f.done() for f in running)
        fake.token_delay = 0
        answers = [f.result() for f in running]

    assert refused.status_code == 503
    assert refused.json()["error"]["message"].startswith("queue full: ")
    assert "gpu1 full (4/4 running, 4/4 queued)" in refused.json()["error"]["message"]
    assert refused.headers["retry-after"] == "1"
    assert unfinished == 8
    assert [a.status_code for a in answers] == [200] * 8
    waited = sorted(int(a.headers["x-crossbar-queued-ms"]) > 0 for a in answers)
    assert waited == [False] * 4 + [True] * 4
    assert fake.max_concurrent == 4


def test_turns_of_a_conversation_stay_on_their_host_while_new_ones_spread(gateway, fake, fake2):
    fake.token_delay = fake2.token_delay = 0.05
    add_route("chat", [add_host("gpu1", fake.url), add_host("gpu2", fake2.url)])
    gateway.sync()
    url = f"{gateway.url}/chat/v1/chat/completions"

    first = httpx.post(url, json=chat("tell me about ships", system="be brief"))
    history = first.json()["choices"][0]["message"]
    second = httpx.post(
        url,
        json={
            "model": MODEL,
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": "tell me about ships"},
                history,
                {"role": "user", "content": "and boats?"},
            ],
        },
    )
    # While a long request holds a slot on the first conversation's host, a new conversation
    # goes to the host with more free slots.
    with httpx.stream(
        "POST", url, json=chat("tell me about ships", system="be brief", stream=True, max_tokens=40)
    ) as held:
        assert held.headers["x-crossbar-lease"] == "reused"
        other = httpx.post(url, json=chat("a different question", system="be brief"))
        held.read()

    assert first.headers["x-crossbar-lease"] == "new"
    assert second.headers["x-crossbar-lease"] == "reused"
    assert second.headers["x-crossbar-host"] == first.headers["x-crossbar-host"]
    assert other.headers["x-crossbar-lease"] == "new"
    assert other.headers["x-crossbar-host"] != first.headers["x-crossbar-host"]


def test_tokens_arrive_as_the_host_produces_them(gateway, fake):
    fake.token_delay = 0.2
    add_route("chat", [add_host("gpu1", fake.url)])
    gateway.sync()

    arrivals = []
    body = chat(stream=True, max_tokens=6)
    with httpx.stream("POST", f"{gateway.url}/chat/v1/chat/completions", json=body) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                arrivals.append(time.monotonic())

    gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    assert len(arrivals) == 6
    # Buffering would deliver everything at the end; each token must come on its own.
    assert sum(1 for gap in gaps if gap > 0.1) >= 4


@pytest.fixture
def gateway_without_polls(django_db_setup, tmp_path):
    """A gateway whose health poller stays quiet during a test: only requests see failures."""
    with running_gateway(tmp_path, CROSSBAR_HEALTH_INTERVAL="600") as gw:
        yield gw


def test_a_host_that_refuses_is_marked_down_and_the_request_moves_to_another(
    gateway_without_polls, fake, fake2
):
    gateway = gateway_without_polls
    add_route("chat", [add_host("gpu1", fake.url), add_host("gpu2", fake2.url)])
    gateway.sync()
    fake.fail_mode = "refuse"
    url = f"{gateway.url}/chat/v1/chat/completions"

    moved = httpx.post(url, json=chat("first"))
    after = [httpx.post(url, json=chat(f"next {i}")) for i in range(3)]

    assert moved.status_code == 200
    assert moved.headers["x-crossbar-host"] == "gpu2"
    assert moved.headers["x-crossbar-lease"] == "moved"
    assert moved.headers["x-crossbar-placement"] == "moved"
    assert [r.status_code for r in after] == [200, 200, 200]
    assert {r.headers["x-crossbar-host"] for r in after} == {"gpu2"}
    assert [r.headers["x-crossbar-placement"] for r in after] == ["new"] * 3


@pytest.mark.django_db(transaction=True)
def test_a_strict_route_answers_pinned_host_down_when_its_host_refuses(
    gateway_without_polls, fake, fake2
):
    gateway = gateway_without_polls
    add_route("chat", [add_host("gpu1", fake.url), add_host("gpu2", fake2.url)], sticky="strict")
    gateway.sync()
    url = f"{gateway.url}/chat/v1/chat/completions"
    assert httpx.post(url, json=chat("pinned")).headers["x-crossbar-host"] == "gpu1"
    fake.fail_mode = "refuse"

    refused = httpx.post(url, json=chat("pinned"))

    assert refused.status_code == 503
    assert refused.json()["error"]["code"] == "pinned_host_down"
    assert completions(fake2) == []


def test_a_stale_connection_is_retried_once_on_a_fresh_one(gateway, fake):
    add_route("chat", [add_host("gpu1", fake.url)])
    gateway.sync()
    fake.fail_mode, fake.fail_count = "reset_before_headers", 1

    response = httpx.post(f"{gateway.url}/chat/v1/chat/completions", json=chat())

    assert response.status_code == 200
    assert len(completions(fake)) == 2


def test_a_host_that_resets_every_time_gives_502(gateway, fake):
    add_route("chat", [add_host("gpu1", fake.url)])
    gateway.sync()
    fake.fail_mode = "reset_before_headers"

    response = httpx.post(f"{gateway.url}/chat/v1/chat/completions", json=chat())

    assert response.status_code == 502
    assert response.json()["error"]["code"] == "upstream_unreachable"


def test_a_host_that_sends_no_head_in_time_gives_504(gateway, fake):
    add_route("chat", [add_host("gpu1", fake.url)])
    gateway.sync()
    fake.fail_mode = "hang"

    response = httpx.post(f"{gateway.url}/chat/v1/chat/completions", json=chat(), timeout=20)

    assert response.status_code == 504
    assert "gpu1" in response.json()["error"]["message"]


def test_a_client_leaving_mid_stream_frees_its_slot_and_the_host_sees_it(gateway, fake):
    fake.token_delay = 0.1
    add_route("chat", [add_host("gpu1", fake.url, models={MODEL: (1, 0)})])
    gateway.sync()
    url = f"{gateway.url}/chat/v1/chat/completions"

    with httpx.stream("POST", url, json=chat(stream=True, max_tokens=100)) as response:
        lines = response.iter_lines()
        next(lines)
        next(lines)
    wait_until(lambda: fake.disconnects == 1, what="the host to see the disconnect")
    after = httpx.post(url, json=chat("next"))

    assert after.status_code == 200  # parallel 1, queue 0: only a freed slot lets it in


def test_the_client_credential_stays_at_the_gateway_and_the_host_key_goes_up(gateway, fake):
    add_route(
        "chat",
        [add_host("gpu1", fake.url, api_key="host-key-123", upstream_names={MODEL: "llama-3-8b"})],
    )
    gateway.sync()

    response = httpx.post(
        f"{gateway.url}/chat/v1/chat/completions",
        json=chat(),
        headers={"Authorization": "Bearer client-secret", "Cookie": "sessionid=abc"},
    )

    seen = completions(fake)[-1]
    assert response.status_code == 200
    assert seen.headers["authorization"] == "Bearer host-key-123"
    assert "cookie" not in seen.headers
    assert seen.json["model"] == "llama-3-8b"


def test_a_body_naming_its_own_slot_goes_upstream_byte_for_byte(gateway, fake):
    add_route("chat", [add_host("gpu1", fake.url)])
    gateway.sync()
    raw = (
        b'{ "messages" : [{"role":"user","content":"hi \\u2028 there"}], "model":"test-model",'
        b' "id_slot": 3 }'
    )

    httpx.post(
        f"{gateway.url}/chat/v1/chat/completions",
        content=raw,
        headers={"Content-Type": "application/json"},
    )

    assert completions(fake)[-1].body == raw


def test_a_conversation_goes_upstream_as_sent_with_the_slot_it_keeps_named_first(gateway, fake):
    add_route("chat", [add_host("gpu1", fake.url)])
    gateway.sync()
    wait_for_health_poll(fake)  # its /props said its slots
    raw = b'{ "messages" : [{"role":"user","content":"hi \\u2028 there"}], "model":"test-model" }'

    httpx.post(
        f"{gateway.url}/chat/v1/chat/completions",
        content=raw,
        headers={"Content-Type": "application/json"},
    )

    assert completions(fake)[-1].body == b'{"id_slot":0,' + raw[1:]


def test_the_gateway_lists_the_models_of_a_route(gateway, fake, fake2):
    add_route(
        "chat",
        [
            add_host("gpu1", fake.url, models={"llama": (4, 0), "qwen": (2, 0)}),
            add_host("gpu2", fake2.url, models={"qwen": (2, 0), "mistral": (1, 0)}),
        ],
    )
    gateway.sync()

    listed = openai.OpenAI(base_url=f"{gateway.url}/chat/v1", api_key="x").models.list()

    assert [m.id for m in listed.data] == ["llama", "qwen", "mistral"]


def test_props_and_health_of_a_route_come_from_one_of_its_hosts(gateway, fake):
    add_route("chat", [add_host("gpu1", fake.url)])
    gateway.sync()

    props = httpx.get(f"{gateway.url}/chat/props")
    health = httpx.get(f"{gateway.url}/chat/health")

    assert props.status_code == 200 and props.json()["total_slots"] == 4
    assert health.status_code == 200 and health.headers["x-crossbar-host"] == "gpu1"


@pytest.mark.parametrize(
    ("path", "headers", "status", "code"),
    [
        ("/v1/chat/completions", {}, 400, "missing_route"),
        ("/nope/v1/chat/completions", {}, 404, "unknown_route"),
        ("/chat/v2/chat/completions", {}, 404, "not_found"),
        ("/chat/v1//chat/completions", {}, 404, "not_found"),
        ("/other/v1/chat/completions", {"X-Crossbar-Route": "chat"}, 404, "not_found"),
        ("/v1/chat/completions", {"X-Crossbar-Route": "ch@t"}, 404, "unknown_route"),
    ],
)
def test_requests_the_gateway_cannot_route_get_a_clear_error(
    gateway, fake, path, headers, status, code
):
    add_route("chat", [add_host("gpu1", fake.url)])
    gateway.sync()

    response = httpx.post(f"{gateway.url}{path}", json=chat(), headers=headers)

    assert response.status_code == status
    assert response.json()["error"]["code"] == code
    assert completions(fake) == []


def test_path_and_header_naming_different_routes_conflict(gateway, fake):
    gpu = add_host("gpu1", fake.url)
    add_route("chat", [gpu])
    add_route("code", [gpu])
    gateway.sync()

    response = httpx.post(
        f"{gateway.url}/code/v1/chat/completions", json=chat(), headers={"X-Crossbar-Route": "chat"}
    )

    assert response.status_code == 400
    assert response.json()["error"]["code"] == "conflicting_route"


@pytest.mark.parametrize(
    ("content", "status", "fragment"),
    [
        (b"{not json", 400, "not valid JSON"),
        (b"[1, 2]", 400, "JSON object"),
        (b'"a string"', 400, "JSON object"),
        (b'{"model": 5, "messages": []}', 400, "model must be a string"),
        (b'{"model": "' + b"m" * 300 + b'"}', 400, "longer than"),
        (b'{"model": "other-model", "messages": []}', 404, "not served"),
        (b"\xff\xfe{}", 400, "UTF-8"),
    ],
)
def test_bad_bodies_get_a_clear_error(gateway, fake, content, status, fragment):
    add_route("chat", [add_host("gpu1", fake.url)])
    gateway.sync()

    response = httpx.post(f"{gateway.url}/chat/v1/chat/completions", content=content)

    assert response.status_code == status
    assert fragment in response.json()["error"]["message"]
    assert completions(fake) == []


def test_a_body_over_16_mib_is_refused_with_413(gateway, fake):
    add_route("chat", [add_host("gpu1", fake.url)])
    gateway.sync()
    content = b'{"model": "test-model", "prompt": "' + b"x" * (16 * 1024 * 1024) + b'"}'

    response = httpx.post(f"{gateway.url}/chat/v1/completions", content=content, timeout=30)

    assert response.status_code == 413
    assert completions(fake) == []


def test_a_missing_model_uses_the_route_default(gateway, fake):
    add_route("chat", [add_host("gpu1", fake.url)], default_model=MODEL)
    gateway.sync()

    response = httpx.post(
        f"{gateway.url}/chat/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}]},
    )

    assert response.status_code == 200
    assert completions(fake)[-1].json["messages"][0]["content"] == "hi"


def test_no_healthy_host_gives_503(gateway, fake):
    add_route("chat", [add_host("gpu1", fake.url)])
    fake.health = "error"
    gateway.sync()
    wait_for_host_state(gateway.url, "gpu1", "down")

    response = httpx.post(f"{gateway.url}/chat/v1/chat/completions", json=chat())

    assert response.status_code == 503
    assert response.json()["error"]["message"].startswith("no healthy host: ")
    assert "gpu1 down since " in response.json()["error"]["message"]


def test_a_strict_route_answers_503_when_the_pinned_host_is_down(gateway, fake, fake2):
    add_route("chat", [add_host("gpu1", fake.url), add_host("gpu2", fake2.url)], sticky="strict")
    gateway.sync()
    url = f"{gateway.url}/chat/v1/chat/completions"
    first = httpx.post(url, json=chat("pinned"))
    pinned = {"gpu1": fake, "gpu2": fake2}[first.headers["x-crossbar-host"]]
    pinned.health = "error"
    wait_for_host_state(gateway.url, first.headers["x-crossbar-host"], "down")

    again = httpx.post(url, json=chat("pinned"))

    assert again.status_code == 503
    assert "pinned host down" in again.json()["error"]["message"]


def test_a_prefer_route_moves_a_conversation_off_a_draining_host(gateway, fake, fake2):
    gpu1 = add_host("gpu1", fake.url)
    add_route("chat", [gpu1, add_host("gpu2", fake2.url)])
    gateway.sync()
    url = f"{gateway.url}/chat/v1/chat/completions"
    first = httpx.post(url, json=chat("moving"))
    assert first.headers["x-crossbar-host"] == "gpu1"
    gpu1.draining = True
    gpu1.save()
    gateway.sync()

    again = httpx.post(url, json=chat("moving"))

    assert again.status_code == 200
    assert again.headers["x-crossbar-lease"] == "moved"
    assert again.headers["x-crossbar-host"] == "gpu2"


def test_the_host_never_sees_more_requests_than_its_slots(gateway, fake):
    fake.token_delay = 0.01
    add_route("chat", [add_host("gpu1", fake.url, models={MODEL: (2, 50)})])
    gateway.sync()
    errors: list[int] = []

    def one(i: int) -> None:
        body = chat(f"c{i}", stream=bool(i % 2), max_tokens=5)
        status = httpx.post(f"{gateway.url}/chat/v1/chat/completions", json=body, timeout=30)
        if status.status_code != 200:
            errors.append(status.status_code)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(24)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    assert errors == []
    assert fake.max_concurrent == 2


def test_error_bodies_are_json_in_openais_shape(gateway):
    response = httpx.get(f"{gateway.url}/nope/v1/models")

    assert response.headers["content-type"] == "application/json"
    assert set(json.loads(response.content)["error"]) == {"message", "type", "code"}
