from __future__ import annotations

import base64
import itertools
import json
import socket
import struct
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from routing.core.tee import Tee, Usage
from tests.fakes.llama_server import FakeLlamaServer
from tests.helpers.waits import wait_until


@pytest.fixture
def fake() -> Iterator[FakeLlamaServer]:
    with FakeLlamaServer(slots=2) as server:
        yield server


@pytest.fixture
def client(fake: FakeLlamaServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{fake.url}/v1", api_key="unused", max_retries=0)


def _chat(words: str, **extra: Any) -> dict[str, Any]:
    return {"model": "test-model", "messages": [{"role": "user", "content": words}], **extra}


def _raw_exchange(url: str, request: bytes) -> bytes:
    """Send raw bytes and read until the server closes the connection."""
    host, port = url.removeprefix("http://").split(":")
    received = bytearray()
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(request)
        while data := sock.recv(65536):
            received += data
    return bytes(received)


def test_openai_client_streams_the_requested_tokens_then_usage(client: openai.OpenAI):
    chunks = list(
        client.chat.completions.create(
            **_chat("one two three"),
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
        )
    )

    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "tok0 tok1 tok2 tok3 "
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.prompt_tokens == 4  # three words and the opening
    assert chunks[-1].usage.completion_tokens == 4


def test_last_content_chunk_carries_timings_and_finish_reason(fake: FakeLlamaServer):
    body = _chat("one two three", max_tokens=2, stream=True)
    with httpx.stream("POST", f"{fake.url}/v1/chat/completions", json=body) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line[6:7] == "{"]

    assert response.headers["content-type"] == "text/event-stream"
    assert response.headers["transfer-encoding"] == "chunked"
    assert [e["choices"][0]["finish_reason"] for e in events] == [None, "stop"]
    assert "usage" not in events[-1]
    assert events[-1]["timings"]["prompt_n"] == 4
    assert events[-1]["timings"]["cache_n"] == 0
    assert events[-1]["timings"]["predicted_n"] == 2


def test_openai_client_gets_a_whole_completion_with_usage(client: openai.OpenAI):
    completion = client.chat.completions.create(**_chat("a b c d e"))

    assert completion.choices[0].message.content == " ".join(f"tok{i}" for i in range(8)) + " "
    assert completion.usage is not None
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (6, 8)


def test_text_completions_are_served_streamed_and_whole(client: openai.OpenAI):
    whole = client.completions.create(model="test-model", prompt="x y", max_tokens=2)
    streamed = client.completions.create(
        model="test-model", prompt="x y", max_tokens=2, stream=True
    )

    assert whole.object == "text_completion"
    assert whole.choices[0].text == "tok0 tok1 "
    assert "".join(c.choices[0].text for c in streamed) == "tok0 tok1 "


def test_a_repeated_prompt_is_served_from_the_cache_but_its_last_token(fake: FakeLlamaServer):
    prompt = " ".join(f"w{i}" for i in range(67))
    url = f"{fake.url}/v1/chat/completions"

    httpx.post(url, json=_chat(prompt))
    repeat = httpx.post(url, json=_chat(prompt)).json()
    longer = httpx.post(url, json=_chat(prompt + " more words")).json()

    assert repeat["timings"]["prompt_n"] == 1
    assert repeat["timings"]["cache_n"] == 67
    assert repeat["usage"]["prompt_tokens"] == 68
    assert repeat["usage"]["prompt_tokens_details"]["cached_tokens"] == 67
    assert longer["timings"]["cache_n"] == 68
    assert longer["usage"]["prompt_tokens"] == 70


def test_a_prompt_after_the_cache_is_forgotten_finds_nothing_cached(fake: FakeLlamaServer):
    prompt = " ".join(f"w{i}" for i in range(40))
    url = f"{fake.url}/v1/chat/completions"
    httpx.post(url, json=_chat(prompt))

    fake.forget_cache()  # as a restart does
    again = httpx.post(url, json=_chat(prompt + " and more")).json()

    assert again["timings"]["cache_n"] == 0
    assert again["timings"]["prompt_n"] == 43


def test_the_connection_is_closed_after_a_stream_despite_keep_alive(fake: FakeLlamaServer):
    body = json.dumps(_chat("hi", max_tokens=2, stream=True)).encode()
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: fake\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%b" % (len(body), body)
    )

    received = _raw_exchange(fake.url, request)

    assert b"\r\nConnection: keep-alive\r\n" in received
    assert received.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")


def test_keep_alive_is_honoured_for_whole_responses(fake: FakeLlamaServer):
    body = json.dumps(_chat("hi", max_tokens=1)).encode()
    request = b"POST /v1/chat/completions HTTP/1.1\r\nHost: fake\r\nContent-Length: %d\r\n\r\n%b"
    closing = request.replace(b"Host: fake", b"Host: fake\r\nConnection: close")

    received = _raw_exchange(fake.url, request % (len(body), body) + closing % (len(body), body))

    assert received.count(b"HTTP/1.1 200 OK") == 2


def test_more_completions_than_slots_get_the_context_exceeded_error(fake: FakeLlamaServer):
    fake.token_delay = 0.05
    url = f"{fake.url}/v1/chat/completions"
    with httpx.Client(timeout=5) as http:
        with (
            http.stream("POST", url, json=_chat("a", stream=True)),
            http.stream("POST", url, json=_chat("b", stream=True)),
        ):
            third = http.post(url, json=_chat("c"))

    assert third.status_code == 500
    assert third.json() == {
        "error": {"code": 500, "message": "Context size has been exceeded.", "type": "server_error"}
    }
    assert fake.max_concurrent == 3


def test_a_finished_response_has_already_given_its_slot_back():
    # A fresh connection each time: a pooled one may be the one the fake is closing after a
    # stream, exactly the stale-connection race the gateway must retry (see DESIGN.md).
    with FakeLlamaServer(slots=1) as fake:
        url = f"{fake.url}/v1/chat/completions"
        statuses = []
        for stream in (True, False) * 10:
            with httpx.stream("POST", url, json=_chat("hi", stream=stream)) as response:
                response.read()
                statuses.append(response.status_code)
                assert fake.in_flight == 0

    assert set(statuses) == {200}
    assert fake.max_concurrent == 1


def test_the_tee_reads_the_same_counts_from_a_stream_and_a_whole_response(fake: FakeLlamaServer):
    url = f"{fake.url}/v1/chat/completions"
    counts = []
    for body in (
        _chat("a b c", stream=True),
        _chat("a b c", stream=True, stream_options={"include_usage": True}),
        _chat("a b c"),
    ):
        with httpx.stream("POST", url, json=body) as response:
            tee = Tee(response.headers["content-type"])
            for chunk in response.iter_raw():
                tee.feed(chunk)
        counts.append(tee.usage())

    assert counts == [Usage(4, 0, 8), Usage(4, 3, 8), Usage(4, 3, 8)]


def test_health_reports_each_state(fake: FakeLlamaServer):
    answers = {}
    for state in ("ok", "loading", "error"):
        fake.health = state
        response = httpx.get(f"{fake.url}/health")
        answers[state] = (response.status_code, response.json())

    assert answers["ok"] == (200, {"status": "ok"})
    assert answers["loading"] == (
        503,
        {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}},
    )
    assert answers["error"][0] == 500


def test_completions_are_refused_while_the_model_loads(fake: FakeLlamaServer):
    fake.health = "loading"

    response = httpx.post(f"{fake.url}/v1/chat/completions", json=_chat("hi"))

    assert response.status_code == 503


def test_models_props_and_unknown_paths_answer_like_llama_server():
    with FakeLlamaServer(slots=3, models=("a", "b")) as fake:
        models = httpx.get(f"{fake.url}/v1/models").json()
        props = httpx.get(f"{fake.url}/props").json()
        missing = httpx.get(f"{fake.url}/nope")

    assert models["object"] == "list"
    assert [(m["id"], m["object"], m["owned_by"]) for m in models["data"]] == [
        ("a", "model", "llamacpp"),
        ("b", "model", "llamacpp"),
    ]
    assert props["total_slots"] == 3
    assert "default_generation_settings" in props
    assert missing.status_code == 404


def test_requests_are_recorded_with_lower_case_headers_and_parsed_json(fake: FakeLlamaServer):
    httpx.post(f"{fake.url}/v1/completions", json={"prompt": "hi"}, headers={"X-Trace": "7"})

    (seen,) = fake.seen
    assert (seen.method, seen.path) == ("POST", "/v1/completions")
    assert seen.headers["x-trace"] == "7"
    assert seen.json == {"prompt": "hi"}
    assert json.loads(seen.body) == {"prompt": "hi"}


def test_refuse_closes_the_port_and_none_listens_again_on_the_same_port(fake: FakeLlamaServer):
    url = fake.url

    fake.fail_mode = "refuse"
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/health")
    fake.fail_mode = None

    assert fake.url == url
    assert httpx.get(f"{url}/health").status_code == 200


def test_refuse_also_drops_idle_keep_alive_connections(fake: FakeLlamaServer):
    with httpx.Client() as http:
        assert http.get(f"{fake.url}/health").status_code == 200
        fake.fail_mode = "refuse"

        with pytest.raises(httpx.ConnectError):
            http.get(f"{fake.url}/health")


def test_reset_before_headers_resets_the_connection(client: openai.OpenAI, fake: FakeLlamaServer):
    fake.fail_mode = "reset_before_headers"

    with pytest.raises(httpx.ReadError):
        httpx.post(f"{fake.url}/v1/chat/completions", json=_chat("hi"))
    with pytest.raises(openai.APIConnectionError):
        client.chat.completions.create(**_chat("hi"))


def test_reset_mid_stream_cuts_the_stream_after_a_few_tokens(fake: FakeLlamaServer):
    fake.fail_mode = "reset_mid_stream"
    fake.token_delay = 0.05
    lines: list[str] = []

    with pytest.raises(httpx.ReadError):
        with httpx.stream(
            "POST", f"{fake.url}/v1/chat/completions", json=_chat("hi", stream=True)
        ) as response:
            lines.extend(line for line in response.iter_lines() if line)

    assert response.status_code == 200
    assert [json.loads(line[6:])["choices"][0]["delta"]["content"] for line in lines] == [
        "tok0 ",
        "tok1 ",
        "tok2 ",
    ]


def test_reset_mid_stream_cuts_a_whole_response_inside_its_body(fake: FakeLlamaServer):
    fake.fail_mode = "reset_mid_stream"

    with pytest.raises((httpx.ReadError, httpx.RemoteProtocolError)):
        httpx.post(f"{fake.url}/v1/chat/completions", json=_chat("hi"))


def test_error_500_answers_a_json_error(fake: FakeLlamaServer):
    fake.fail_mode = "error_500"

    response = httpx.post(f"{fake.url}/v1/chat/completions", json=_chat("hi"))

    assert response.status_code == 500
    assert response.json()["error"]["code"] == 500


def test_fail_count_limits_the_failure_to_that_many_requests(fake: FakeLlamaServer):
    fake.fail_mode = "error_500"
    fake.fail_count = 2
    url = f"{fake.url}/v1/chat/completions"

    statuses = [httpx.post(url, json=_chat("hi")).status_code for _ in range(3)]

    assert statuses == [500, 500, 200]
    assert (fake.fail_mode, fake.fail_count) == (None, None)


def test_fail_modes_leave_health_checks_alone(fake: FakeLlamaServer):
    fake.fail_mode = "error_500"
    fake.fail_count = 1

    assert httpx.get(f"{fake.url}/health").status_code == 200
    assert httpx.post(f"{fake.url}/v1/completions", json={"prompt": "x"}).status_code == 500


def test_hang_never_answers_and_counts_the_client_leaving(fake: FakeLlamaServer):
    fake.fail_mode = "hang"

    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{fake.url}/v1/chat/completions", json=_chat("hi"), timeout=0.3)

    wait_until(lambda: fake.disconnects == 1 and fake.in_flight == 0, what="the slot back")


def test_stop_ends_a_hanging_request():
    fake = FakeLlamaServer().start()
    fake.fail_mode = "hang"
    errors: list[Exception] = []

    def post() -> None:
        try:
            httpx.post(f"{fake.url}/v1/chat/completions", json=_chat("hi"), timeout=10)
        except httpx.HTTPError as exc:
            errors.append(exc)

    caller = threading.Thread(target=post)
    caller.start()
    wait_until(lambda: fake.in_flight == 1, what="the slot taken")
    fake.stop()
    caller.join(timeout=5)

    assert not caller.is_alive()
    assert len(errors) == 1


def test_a_client_leaving_mid_stream_is_counted_and_generation_stops(fake: FakeLlamaServer):
    fake.token_delay = 0.02
    body = _chat("hi", max_tokens=1000, stream=True)

    with httpx.stream("POST", f"{fake.url}/v1/chat/completions", json=body) as response:
        next(response.iter_lines())

    wait_until(lambda: fake.disconnects == 1 and fake.in_flight == 0, 2, what="the slot back")


def test_reset_stats_forgets_observations(fake: FakeLlamaServer):
    httpx.post(f"{fake.url}/v1/chat/completions", json=_chat("hi"))

    fake.reset_stats()

    assert (fake.seen, fake.max_concurrent, fake.disconnects, fake.in_flight) == ([], 0, 0, 0)


def test_unknown_knob_values_are_rejected(fake: FakeLlamaServer):
    with pytest.raises(ValueError):
        fake.fail_mode = "explode"
    with pytest.raises(ValueError):
        fake.health = "fine"


# Every llama-server endpoint.


def _events(response: httpx.Response) -> list[tuple[str, dict[str, Any]]]:
    """The (event name, data) pairs of an SSE body; unnamed events are named ""."""
    events = []
    for block in response.text.split("\n\n"):
        name, data = "", None
        for line in block.splitlines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: ") and line != "data: [DONE]":
                data = json.loads(line[6:])
        if data is not None:
            events.append((name, data))
    return events


def _first_line(response: httpx.Response) -> Iterator[str]:
    """Wait for a stream's first line; keep the iterator, or httpx closes the connection."""
    lines = response.iter_lines()
    next(lines)
    return lines


def _still_streaming(lines: Iterator[str]) -> bool:
    return any(line.startswith("data: ") for line in itertools.islice(lines, 2))


def _stream(url: str, body: dict[str, object]) -> httpx.Response:
    with httpx.stream("POST", url, json=body, timeout=10) as response:
        response.read()
    return response


def test_openai_paths_answer_with_and_without_v1(fake: FakeLlamaServer):
    chat = _chat("a b", max_tokens=2)
    rerank = {"query": "a", "documents": ["a", "b"]}
    pairs = [
        ("POST", "/chat/completions", chat),
        ("POST", "/responses", {"input": "a b", "max_output_tokens": 2}),
        ("POST", "/rerank", rerank),
        ("GET", "/models", None),
    ]

    for method, path, body in pairs:
        bare = httpx.request(method, f"{fake.url}{path}", json=body).json()
        versioned = httpx.request(method, f"{fake.url}/v1{path}", json=body).json()
        for document in (bare, versioned):
            # What differs between two calls: ids, clocks, and the cache the first one warmed.
            for volatile in ("id", "created", "created_at", "completed_at", "timings", "usage"):
                document.pop(volatile, None)
            for item in document.get("output", []):
                item.pop("id")
            for model in document.get("data", []):
                model.pop("created")  # the clock, read once per call: may cross a second
        assert bare == versioned, path
    assert httpx.post(f"{fake.url}/v1/reranking", json=rerank).status_code == 200


def test_without_v1_completions_and_embeddings_are_llama_servers_own(fake: FakeLlamaServer):
    text = {"prompt": "a b", "max_tokens": 2}
    oai_text = httpx.post(f"{fake.url}/v1/completions", json=text).json()
    native_text = httpx.post(f"{fake.url}/completions", json=text).json()
    oai_vectors = httpx.post(f"{fake.url}/v1/embeddings", json={"input": "a b"}).json()
    native_vectors = httpx.post(f"{fake.url}/embeddings", json={"input": "a b"}).json()

    assert oai_text["object"] == "text_completion"
    assert (native_text["content"], native_text["stop"]) == ("tok0 tok1 ", True)
    assert oai_vectors["object"] == "list"
    assert oai_vectors["data"][0]["embedding"] == native_vectors[0]["embedding"][0]


def test_openai_client_reads_a_responses_answer_whole_and_streamed(client: openai.OpenAI):
    whole = client.responses.create(model="test-model", input="one two", max_output_tokens=3)
    events = list(
        client.responses.create(
            model="test-model", instructions="be brief", input="one two", stream=True
        )
    )

    assert whole.output_text == "tok0 tok1 tok2 "
    assert whole.usage is not None
    assert (whole.usage.input_tokens, whole.usage.output_tokens) == (3, 3)
    assert events[0].type == "response.created"
    assert events[-1].type == "response.completed"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == " ".join(f"tok{i}" for i in range(8)) + " "
    completed = events[-1].response
    assert completed.usage is not None
    assert (completed.usage.input_tokens, completed.usage.output_tokens) == (5, 8)


def test_a_responses_stream_is_named_events_without_done(fake: FakeLlamaServer):
    response = _stream(f"{fake.url}/v1/responses", {"input": "hi", "stream": True})

    assert response.headers["content-type"] == "text/event-stream"
    assert b"[DONE]" not in response.content
    names = [name for name, _ in _events(response)]
    assert names[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert names[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert all(data["type"] == name for name, data in _events(response))


def test_anthropic_messages_stream_from_message_start_to_message_stop(fake: FakeLlamaServer):
    body = {
        "model": "claude-ish",
        "max_tokens": 3,
        "system": "be brief",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hello there"}]}],
        "stream": True,
    }

    events = _events(_stream(f"{fake.url}/v1/messages", body))

    assert [name for name, _ in events] == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    start, delta = events[0][1], events[-2][1]
    assert start["message"]["usage"] == {"input_tokens": 5, "output_tokens": 0}
    assert start["message"]["model"] == "claude-ish"
    assert delta["usage"] == {"output_tokens": 3}
    assert delta["delta"]["stop_reason"] == "end_turn"
    text = "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta")
    assert text == "tok0 tok1 tok2 "


def test_anthropic_messages_whole_answer_counts_input_and_output_tokens(fake: FakeLlamaServer):
    body = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "a b c"}]}

    message = httpx.post(f"{fake.url}/v1/messages", json=body).json()
    missing = httpx.post(f"{fake.url}/v1/messages", json={"model": "m"})

    assert message["type"] == "message"
    assert message["content"] == [{"type": "text", "text": "tok0 tok1 "}]
    assert message["usage"] == {"input_tokens": 4, "output_tokens": 2}
    assert missing.status_code == 500
    assert missing.json()["error"]["message"] == "'messages' is required"


def test_token_counting_endpoints_count_the_prompt_without_a_slot(fake: FakeLlamaServer):
    messages = [{"role": "user", "content": "one two three"}]
    fake.fail_mode = "error_500"  # would hit any request taking a slot

    anthropic = httpx.post(f"{fake.url}/v1/messages/count_tokens", json={"messages": messages})
    chat = httpx.post(f"{fake.url}/v1/chat/completions/input_tokens", json={"messages": messages})
    responses = httpx.post(f"{fake.url}/v1/responses/input_tokens", json={"input": "one two"})

    assert anthropic.json() == {"input_tokens": 3}
    assert chat.json() == {"input_tokens": 3, "object": "response.input_tokens"}
    assert responses.json() == {"input_tokens": 2, "object": "response.input_tokens"}
    assert fake.max_concurrent == 0


def test_native_completion_streams_tokens_then_a_final_event_with_timings(fake: FakeLlamaServer):
    body = {"prompt": "one two three", "n_predict": 2, "stream": True}

    response = _stream(f"{fake.url}/completion", body)
    whole = httpx.post(f"{fake.url}/completion", json={"prompt": "one two", "n_predict": 3})

    events = [data for _, data in _events(response)]
    assert b"[DONE]" not in response.content
    assert [(e["content"], e["stop"]) for e in events] == [
        ("tok0 ", False),
        ("tok1 ", False),
        ("", True),
    ]
    assert events[-1]["timings"]["prompt_n"] == 4
    assert events[-1]["tokens_evaluated"] == 4
    document = whole.json()
    assert document["content"] == "tok0 tok1 tok2 "
    assert (document["tokens_predicted"], document["stop_type"]) == (3, "eos")
    assert document["timings"]["predicted_n"] == 3
    # The opening and "one two" began the first prompt; its last token is evaluated again, as
    # llama-server does.
    assert document["tokens_cached"] == 2


def test_infill_needs_a_prefix_and_a_suffix_and_answers_natively(fake: FakeLlamaServer):
    url = f"{fake.url}/infill"

    done = httpx.post(url, json={"input_prefix": "def f(", "input_suffix": "):", "n_predict": 1})
    missing = httpx.post(url, json={"input_prefix": "def f("})

    assert done.json()["content"] == "tok0 "
    assert missing.status_code == 400
    assert missing.json()["error"]["message"] == '"input_suffix" is required'


def test_tokenize_and_detokenize_give_the_text_back(fake: FakeLlamaServer):
    text = "Hello  wide wörld "

    plain = httpx.post(f"{fake.url}/tokenize", json={"content": text}).json()
    pieces = httpx.post(
        f"{fake.url}/tokenize", json={"content": text, "with_pieces": True, "add_special": True}
    ).json()
    again = httpx.post(f"{fake.url}/tokenize", json={"content": text}).json()
    back = httpx.post(f"{fake.url}/detokenize", json={"tokens": plain["tokens"]}).json()

    assert [t["piece"] for t in pieces["tokens"]] == ["<s>", "Hello", "  wide", " wörld", " "]
    assert [t["id"] for t in pieces["tokens"]][1:] == plain["tokens"]
    assert again == plain
    assert back == {"content": text}


def test_apply_template_returns_the_chatml_prompt(fake: FakeLlamaServer):
    messages = [{"role": "system", "content": "be kind"}, {"role": "user", "content": "hi"}]

    answer = httpx.post(f"{fake.url}/apply-template", json={"messages": messages}).json()

    assert answer == {
        "prompt": "<|im_start|>system\nbe kind<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\n"
    }


def test_embeddings_are_the_same_vector_for_the_same_text(client: openai.OpenAI):
    first = client.embeddings.create(model="test-model", input=["a b", "c"])
    second = client.embeddings.create(model="test-model", input="a b")
    packed = client.embeddings.create(model="test-model", input="a b", encoding_format="base64")

    vector = first.data[0].embedding
    assert second.data[0].embedding == vector
    assert first.data[1].embedding != vector
    # Euclidean-normalized, as by default (the client asks for base64 float32 by itself).
    assert sum(x * x for x in vector) == pytest.approx(1, abs=1e-6)
    raw = base64.b64decode(str(packed.data[0].embedding))
    assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == pytest.approx(vector, abs=1e-6)
    assert first.usage.prompt_tokens == 3


def test_bad_embedding_requests_get_llama_servers_messages(fake: FakeLlamaServer):
    url = f"{fake.url}/v1/embeddings"

    answers = [
        httpx.post(url, json={"model": "m"}),
        httpx.post(url, json={"input": ""}),
        httpx.post(url, json={"input": "a", "encoding_format": "hex"}),
    ]

    assert [a.status_code for a in answers] == [400, 400, 400]
    assert [a.json()["error"]["message"] for a in answers] == [
        '"input" or "content" must be provided',
        "Input content cannot be empty",
        "The format to return the embeddings in. Can be either float or base64",
    ]


def test_reranking_orders_documents_by_the_query_words_they_contain(fake: FakeLlamaServer):
    documents = ["a red fox", "nothing here", "the red fox jumps"]
    body = {"model": "m", "query": "red fox jumps", "documents": documents, "top_n": 2}

    jina = httpx.post(f"{fake.url}/reranking", json=body).json()
    tei = httpx.post(
        f"{fake.url}/rerank", json={"query": "red fox jumps", "texts": documents}
    ).json()
    empty = httpx.post(f"{fake.url}/rerank", json={"query": "x", "documents": []})

    assert [(r["index"], r["relevance_score"]) for r in jina["results"]] == [
        (2, 1.0),
        (0, pytest.approx(2 / 3)),
    ]
    assert jina["object"] == "list"
    assert [r["index"] for r in tei] == [2, 0, 1]
    assert "score" in tei[0]
    assert empty.status_code == 400


def test_disabled_endpoints_answer_not_supported():
    with FakeLlamaServer(metrics=False, slots_endpoint=False, embeddings=False) as fake:
        answers = {
            "metrics": httpx.get(f"{fake.url}/metrics"),
            "slots": httpx.get(f"{fake.url}/slots"),
            "embeddings": httpx.post(f"{fake.url}/v1/embeddings", json={"input": "a"}),
            "props": httpx.post(f"{fake.url}/props", json={}),
            "slot save": httpx.post(f"{fake.url}/slots/0?action=save", json={"filename": "x"}),
        }

    assert {name: a.status_code for name, a in answers.items()} == dict.fromkeys(answers, 501)
    assert answers["metrics"].json() == {
        "error": {
            "code": 501,
            "message": "This server does not support metrics endpoint. Start it with `--metrics`",
            "type": "not_supported_error",
        }
    }


def test_props_describe_the_server_and_change_only_with_props_enabled():
    with FakeLlamaServer(slots=3, models=("llama3",), props=True) as fake:
        props = httpx.get(f"{fake.url}/props").json()
        changed = httpx.post(f"{fake.url}/props", json={})

    assert props["total_slots"] == 3
    assert props["default_generation_settings"]["n_ctx"] == 4096
    assert (props["model_alias"], props["model_path"]) == ("llama3", "/models/llama3.gguf")
    assert props["endpoint_props"] is True
    assert changed.json() == {"success": True}


def test_slots_show_which_slot_is_processing(fake: FakeLlamaServer):
    fake.token_delay = 0.05
    url = f"{fake.url}/v1/chat/completions"

    with httpx.Client(timeout=10) as http:
        idle = http.get(f"{fake.url}/slots").json()
        with http.stream("POST", url, json=_chat("a", max_tokens=200, stream=True)) as one:
            one_lines = _first_line(one)
            busy = http.get(f"{fake.url}/slots").json()
            with http.stream("POST", url, json=_chat("b", max_tokens=200, stream=True)) as two:
                two_lines = _first_line(two)
                full = http.get(f"{fake.url}/slots?fail_on_no_slot=1")
                assert _still_streaming(one_lines) and _still_streaming(two_lines)

    assert [(s["id"], s["is_processing"]) for s in idle] == [(0, False), (1, False)]
    assert [s["is_processing"] for s in busy] == [True, False]
    assert busy[0]["next_token"]["n_decoded"] >= 1
    assert full.status_code == 503
    assert full.json()["error"]["message"] == "no slot available"


def test_metrics_are_prometheus_text_with_llamacpp_names(fake: FakeLlamaServer):
    from prometheus_client.parser import text_string_to_metric_families

    httpx.post(f"{fake.url}/v1/chat/completions", json=_chat("one two three", max_tokens=4))
    response = httpx.get(f"{fake.url}/metrics")

    assert response.headers["content-type"] == "text/plain; version=0.0.4"
    assert int(response.headers["process-start-time-unix"]) > 0
    families = {f.name: f.type for f in text_string_to_metric_families(response.text)}
    values = {
        name: float(value)
        for name, value in (
            line.rsplit(" ", 1) for line in response.text.splitlines() if line[:1] != "#"
        )
    }
    assert values["llamacpp:prompt_tokens_total"] == 4
    assert values["llamacpp:tokens_predicted_total"] == 4
    assert values["llamacpp:requests_processing"] == 0
    assert len(families) == len(values) == 11
    assert {name for name in values if families.get(name) == "gauge"} == {
        "llamacpp:n_busy_slots_per_decode",
        "llamacpp:prompt_tokens_seconds",
        "llamacpp:predicted_tokens_seconds",
        "llamacpp:requests_processing",
        "llamacpp:requests_deferred",
    }


def test_lora_adapters_are_listed_and_their_scales_set():
    with FakeLlamaServer(lora_adapters=("a.gguf", "b.gguf")) as fake:
        before = httpx.get(f"{fake.url}/lora-adapters").json()
        changed = httpx.post(f"{fake.url}/lora-adapters", json=[{"id": 1, "scale": 0.5}])
        after = httpx.get(f"{fake.url}/lora-adapters").json()
        refused = httpx.post(f"{fake.url}/lora-adapters", json={"id": 1})

    assert [(a["id"], a["path"], a["scale"]) for a in before] == [
        (0, "a.gguf", 1.0),
        (1, "b.gguf", 1.0),
    ]
    assert changed.json() == {"success": True}
    assert [a["scale"] for a in after] == [1.0, 0.5]
    assert refused.status_code == 400


def test_health_answers_on_v1_too_and_head_gets_no_body(fake: FakeLlamaServer):
    health = httpx.get(f"{fake.url}/v1/health")
    head = httpx.head(f"{fake.url}/health")

    assert (health.status_code, health.json()) == (200, {"status": "ok"})
    assert head.status_code == 200
    assert head.content == b""
    assert head.headers["content-length"] == str(len(b'{"status":"ok"}'))


def test_generating_requests_take_a_slot_and_the_others_do_not():
    with FakeLlamaServer(slots=1, token_delay=0.05) as fake, httpx.Client(timeout=10) as http:
        body = {"prompt": "a", "n_predict": 200, "stream": True}
        with http.stream("POST", f"{fake.url}/completion", json=body) as running:
            running_lines = _first_line(running)
            free = [
                http.post(f"{fake.url}/tokenize", json={"content": "a b"}),
                http.post(f"{fake.url}/apply-template", json={"messages": []}),
                http.get(f"{fake.url}/props"),
                http.get(f"{fake.url}/v1/models"),
                http.post(f"{fake.url}/v1/messages/count_tokens", json={"messages": []}),
            ]
            in_flight = fake.in_flight
            refused = [
                http.post(f"{fake.url}/v1/messages", json={"messages": [], "max_tokens": 1}),
                http.post(f"{fake.url}/v1/responses", json={"input": "x"}),
                http.post(f"{fake.url}/infill", json={"input_prefix": "", "input_suffix": ""}),
                http.post(f"{fake.url}/v1/embeddings", json={"input": "a"}),
                http.post(f"{fake.url}/v1/rerank", json={"query": "a", "documents": ["a"]}),
            ]
            assert _still_streaming(running_lines)

    assert [r.status_code for r in free] == [200] * 5
    assert in_flight == 1
    assert [r.status_code for r in refused] == [500] * 5
    assert {r.json()["error"]["message"] for r in refused} == {"Context size has been exceeded."}
    assert fake.max_concurrent == 2


def test_an_unknown_path_or_method_is_file_not_found(fake: FakeLlamaServer):
    answers = [httpx.get(f"{fake.url}/v1/chat/completions"), httpx.post(f"{fake.url}/nope")]

    assert [a.status_code for a in answers] == [404, 404]
    assert answers[0].json() == {
        "error": {"code": 404, "message": "File Not Found", "type": "not_found_error"}
    }


# CORS and the API key.


def test_a_preflight_is_answered_before_the_api_key_is_checked():
    with FakeLlamaServer(api_key="sekrit") as fake:
        preflight = httpx.options(
            f"{fake.url}/v1/chat/completions",
            headers={"Origin": "http://app.test", "Access-Control-Request-Method": "POST"},
        )

    assert preflight.status_code == 200
    assert preflight.content == b""
    assert preflight.headers["access-control-allow-origin"] == "http://app.test"
    assert preflight.headers["access-control-allow-credentials"] == "true"
    assert preflight.headers["access-control-allow-methods"] == "GET, POST, DELETE, OPTIONS"
    assert preflight.headers["access-control-allow-headers"] == "*"


def test_every_answer_echoes_the_origin_it_was_asked_from(fake: FakeLlamaServer):
    origin = {"Origin": "http://app.test"}

    answers = [
        httpx.get(f"{fake.url}/health", headers=origin),
        httpx.get(f"{fake.url}/nope", headers=origin),
        _stream_with_headers(f"{fake.url}/v1/chat/completions", _chat("x", stream=True), origin),
    ]
    without = httpx.get(f"{fake.url}/health")

    assert [a.headers["access-control-allow-origin"] for a in answers] == ["http://app.test"] * 3
    assert without.headers["access-control-allow-origin"] == ""


def _stream_with_headers(url: str, body: dict[str, object], headers: dict[str, str]):
    with httpx.stream("POST", url, json=body, headers=headers, timeout=10) as response:
        response.read()
    return response


def test_with_an_api_key_only_health_and_models_answer_without_it():
    with FakeLlamaServer(api_key="k1,k2") as fake:
        public = [httpx.get(f"{fake.url}{path}") for path in ("/health", "/v1/models", "/models")]
        refused = [
            httpx.post(f"{fake.url}/v1/chat/completions", json=_chat("x")),
            httpx.get(f"{fake.url}/props"),
            httpx.get(f"{fake.url}/metrics"),
            httpx.post(f"{fake.url}/tokenize", json={"content": "x"}),
            httpx.get(f"{fake.url}/nope"),  # the key is checked before the route
        ]

    assert [a.status_code for a in public] == [200, 200, 200]
    assert [a.status_code for a in refused] == [401] * 5
    assert refused[0].json() == {
        "error": {"code": 401, "message": "Invalid API Key", "type": "authentication_error"}
    }


def test_the_key_is_taken_from_authorization_else_x_api_key():
    with FakeLlamaServer(api_key="k1,k2") as fake:
        url = f"{fake.url}/props"
        statuses = {
            name: httpx.get(url, headers=headers).status_code
            for name, headers in {
                "bearer": {"Authorization": "Bearer k1"},
                "bare": {"Authorization": "k2"},
                "x-api-key": {"X-Api-Key": "k2"},
                "wrong": {"Authorization": "Bearer nope"},
                # A wrong Authorization is not rescued by a right X-Api-Key.
                "both": {"Authorization": "Bearer nope", "X-Api-Key": "k1"},
            }.items()
        }

    assert statuses == {"bearer": 200, "bare": 200, "x-api-key": 200, "wrong": 401, "both": 401}


def test_each_request_is_recorded_with_its_credentials_and_bytes(fake: FakeLlamaServer):
    body = b'{"content": "a b"}'

    httpx.post(
        f"{fake.url}/tokenize?trace=1",
        content=body,
        headers={"X-Api-Key": "from-client", "Authorization": "Bearer host-key"},
    )

    (seen,) = fake.requests_to("/tokenize")
    assert (seen.method, seen.path, seen.route, seen.query) == (
        "POST",
        "/tokenize?trace=1",
        "/tokenize",
        {"trace": "1"},
    )
    assert seen.body == body
    assert seen.headers["x-api-key"] == "from-client"
    assert ("Authorization", "Bearer host-key") in seen.header_lines


# A slow first token.


def _read_head(sock: socket.socket) -> bytes:
    received = b""
    while b"\r\n\r\n" not in received:
        data = sock.recv(65536)
        assert data, "the connection closed before the head"
        received += data
    return received


def test_with_a_first_token_delay_the_head_goes_out_before_any_event():
    with FakeLlamaServer(first_token_delay=60) as fake:
        body = json.dumps(_chat("hi", stream=True)).encode()
        with socket.create_connection(("127.0.0.1", fake.port), timeout=10) as sock:
            sock.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: fake\r\n"
                b"Content-Length: %d\r\n\r\n%b" % (len(body), body)
            )
            received = _read_head(sock)
            sock.settimeout(0.5)
            with pytest.raises(TimeoutError):
                received += sock.recv(65536)  # the first event is a minute away
        # A client leaving during the wait is noticed; its slot is given back.
        wait_until(lambda: fake.disconnects == 1 and fake.in_flight == 0, what="the slot back")

    assert received.startswith(b"HTTP/1.1 200 OK\r\n")
    assert received.endswith(b"\r\n\r\n")
    assert b"Content-Type: text/event-stream" in received


def test_a_first_token_delay_leaves_the_stream_whole(fake: FakeLlamaServer):
    fake.first_token_delay = 0.2

    response = _stream(f"{fake.url}/v1/chat/completions", _chat("a", max_tokens=3, stream=True))

    assert response.text.endswith("data: [DONE]\n\n")
    text = "".join(d["choices"][0]["delta"]["content"] for _, d in _events(response))
    assert text == "tok0 tok1 tok2 "


# Router mode.


def _statuses(fake: FakeLlamaServer) -> dict[str, str]:
    listing = httpx.get(f"{fake.url}/v1/models").json()
    return {entry["id"]: entry["status"]["value"] for entry in listing["data"]}


def _ask(fake: FakeLlamaServer, model: str, **query: str) -> httpx.Response:
    return httpx.post(
        f"{fake.url}/v1/chat/completions",
        params=query,
        json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
        timeout=10,
    )


def test_a_router_lists_every_model_it_can_load_with_its_status():
    with FakeLlamaServer(
        router_models=("a", "b", "c"), load_on_startup=("a",), failing_models=frozenset({"c"})
    ) as fake:
        _ask(fake, "c")
        listing = httpx.get(f"{fake.url}/models").json()

    assert listing["object"] == "list"
    entries = {entry["id"]: entry for entry in listing["data"]}
    assert {name: e["status"]["value"] for name, e in entries.items()} == {
        "a": "loaded",
        "b": "unloaded",
        "c": "unloaded",
    }
    assert entries["c"]["status"]["failed"] is True
    assert entries["c"]["status"]["exit_code"] == 1
    assert "failed" not in entries["b"]["status"]
    assert {e["owned_by"] for e in entries.values()} == {"llamacpp"}


def test_a_router_loads_the_model_a_request_names_before_answering():
    # The load takes long enough to be seen "loading" even on a busy machine.
    with FakeLlamaServer(router_models=("a", "b"), load_delay=2) as fake:
        answers: list[httpx.Response] = []
        caller = threading.Thread(target=lambda: answers.append(_ask(fake, "b")))
        caller.start()
        wait_until(lambda: fake.model_status("b") == "loading", what="the load to start")
        during = _statuses(fake)
        caller.join(timeout=10)
        after = _statuses(fake)

    assert during == {"a": "unloaded", "b": "loading"}
    assert answers[0].status_code == 200
    assert answers[0].json()["choices"][0]["message"]["content"] == "tok0 "
    assert after == {"a": "unloaded", "b": "loaded"}


def test_a_router_unloads_the_least_recently_used_model_at_models_max():
    with FakeLlamaServer(router_models=("a", "b", "c"), models_max=2) as fake:
        for model in ("a", "b", "a", "c"):
            assert _ask(fake, model).status_code == 200
        statuses = _statuses(fake)

    assert statuses == {"a": "loaded", "b": "unloaded", "c": "loaded"}


def test_a_router_loads_and_unloads_models_on_request():
    with FakeLlamaServer(router_models=("a",), load_delay=0.2) as fake:
        load, unload = f"{fake.url}/models/load", f"{fake.url}/models/unload"
        answers = {
            "load": httpx.post(load, json={"model": "a"}),
            "load again": httpx.post(load, json={"model": "a"}),
        }
        wait_until(lambda: fake.model_status("a") == "loaded", what="the load to end")
        answers |= {
            "unload": httpx.post(unload, json={"model": "a"}),
            "unload again": httpx.post(unload, json={"model": "a"}),
            "load unknown": httpx.post(load, json={"model": "zz"}),
            "unload unknown": httpx.post(unload, json={"model": "zz"}),
        }
        after = fake.model_status("a")

    assert {name: a.status_code for name, a in answers.items()} == {
        "load": 200,
        "load again": 400,
        "unload": 200,
        "unload again": 400,
        "load unknown": 404,
        "unload unknown": 400,
    }
    assert answers["load"].json() == {"success": True}
    assert answers["load again"].json()["error"]["message"] == "model is already running"
    assert answers["unload again"].json()["error"]["message"] == "model is not running"
    assert after == "unloaded"


def test_a_router_refuses_requests_it_cannot_route():
    with FakeLlamaServer(router_models=("a", "bad"), failing_models=frozenset({"bad"})) as fake:
        answers = [
            httpx.post(f"{fake.url}/v1/chat/completions", json=_chat("x") | {"model": ""}),
            _ask(fake, "nope"),
            _ask(fake, "bad"),
            httpx.get(f"{fake.url}/metrics"),
        ]

    assert [a.status_code for a in answers] == [400, 400, 500, 400]
    assert [a.json()["error"]["message"] for a in answers] == [
        "model name is missing from the request",
        "model 'nope' not found",
        "model name=bad failed to load",
        "model name is missing from the request",
    ]


def test_a_router_without_autoload_loads_only_when_asked():
    with FakeLlamaServer(router_models=("a",), models_autoload=False) as fake:
        refused = _ask(fake, "a")
        loaded = _ask(fake, "a", autoload="true")

    assert refused.status_code == 400
    assert refused.json()["error"]["message"] == "model is not loaded"
    assert loaded.status_code == 200


def test_a_router_answers_health_and_props_itself_and_per_model():
    with FakeLlamaServer(router_models=("a", "b"), models_max=1) as fake:
        health = httpx.get(f"{fake.url}/health")
        own = httpx.get(f"{fake.url}/props").json()
        model = httpx.get(f"{fake.url}/props", params={"model": "b"}).json()
        metrics = httpx.get(f"{fake.url}/metrics", params={"model": "b"})

    assert (health.status_code, health.json()) == (200, {"status": "ok"})
    assert (own["role"], own["max_instances"], own["models_autoload"]) == ("router", 1, True)
    assert model["model_alias"] == "b"
    assert metrics.status_code == 200
    assert "llamacpp:prompt_tokens_total 0" in metrics.text


def test_each_router_model_has_its_own_slots():
    with FakeLlamaServer(router_models=("a", "b"), slots=1, token_delay=0.05) as fake:
        body = {"model": "a", "prompt": "x", "n_predict": 200, "stream": True}
        with httpx.Client(timeout=10) as http:
            with http.stream("POST", f"{fake.url}/completion", json=body) as running:
                running_lines = _first_line(running)
                other = _ask(fake, "b")
                same = _ask(fake, "a")
                assert _still_streaming(running_lines)

    assert other.status_code == 200
    assert same.status_code == 500


# Options and the command line.


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"slots": 0}, "slots must be at least 1"),
        ({"first_token_delay": -1}, "first_token_delay must not be negative"),
        ({"router_models": ("a",), "load_on_startup": ("b",)}, "not in router_models: b"),
        (
            {"router_models": ("a", "b"), "load_on_startup": ("a", "b"), "models_max": 1},
            "exceeds models_max",
        ),
    ],
)
def test_bad_options_are_refused_with_a_clear_message(options: dict[str, Any], message: str):
    with pytest.raises(ValueError, match=message):
        FakeLlamaServer(**options)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_the_command_line_serves_a_router_with_a_key(tmp_path):
    import signal
    import subprocess
    import sys

    (tmp_path / "small.gguf").write_bytes(b"")
    (tmp_path / "big").mkdir()
    port = _free_port()
    command = [
        sys.executable, "-m", "tests.fakes.llama_server", "--port", str(port),
        "--models-dir", str(tmp_path), "--models-max", "1", "--api-key", "k",
        "--first-token-delay", "0", "--token-delay", "0",
    ]  # fmt: skip
    # Ctrl-C as a terminal delivers it: a runner started in the background (`cmd &`) ignores
    # SIGINT, its children inherit that, and Python then never raises KeyboardInterrupt.
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:

        def up() -> bool:
            assert process.poll() is None, process.stderr.read() if process.stderr else ""
            try:
                return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(up, 30, what="the fake to start")
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()
        keyless = httpx.post(f"http://127.0.0.1:{port}/models/load", json={"model": "big"})
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            _, err = process.communicate(timeout=10)
            pytest.fail(f"the fake did not stop on Ctrl-C within 30 s; its stderr:\n{err!r}")

    assert [m["id"] for m in models["data"]] == ["big", "small"]
    assert keyless.status_code == 401
    assert process.returncode == 0


def test_the_command_line_refuses_bad_options_with_a_message():
    import subprocess
    import sys

    command = [
        sys.executable, "-m", "tests.fakes.llama_server", "--port", "0",
        "--router-model", "a", "--load-on-startup", "b",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)

    assert done.returncode == 2
    assert "not in router_models: b" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_conversation_among_more_than_its_slots_finds_its_history_in_the_prompt_cache(
    fake: FakeLlamaServer,
):
    url = f"{fake.url}/v1/chat/completions"
    first = " ".join(f"w{i}" for i in range(20))
    httpx.post(url, json=_chat(first))
    for other in range(2 * fake.slots):  # more conversations than slots came in between
        httpx.post(url, json=_chat(f"other{other} conversation"))

    again = httpx.post(url, json=_chat(first + " and more")).json()

    assert again["timings"]["cache_n"] == 21  # the opening and its 20 words, as --cache-ram


def test_a_new_prompt_finds_the_opening_every_prompt_shares_once_anything_is_cached(
    fake: FakeLlamaServer,
):
    url = f"{fake.url}/v1/chat/completions"
    alone = httpx.post(url, json=_chat("nothing before this")).json()
    other = httpx.post(url, json=_chat("something else entirely")).json()

    assert alone["timings"]["cache_n"] == 0
    assert other["timings"]["cache_n"] == 1  # a chat template's opening, or a BOS


def test_with_no_prompt_cache_a_host_keeps_only_what_its_slots_hold() -> None:
    with FakeLlamaServer(slots=2, cache_ram=0) as fake:
        url = f"{fake.url}/v1/chat/completions"
        first = " ".join(f"w{i}" for i in range(20))
        httpx.post(url, json=_chat(first))
        for other in range(2):
            httpx.post(url, json=_chat(f"other{other} conversation"))

        again = httpx.post(url, json=_chat(first + " and more")).json()

    assert again["timings"]["cache_n"] == 1  # the opening alone
