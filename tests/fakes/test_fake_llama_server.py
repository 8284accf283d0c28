from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import openai
import pytest

from routing.core.tee import Tee, Usage
from tests.fakes.llama_server import FakeLlamaServer


@pytest.fixture
def fake() -> Iterator[FakeLlamaServer]:
    with FakeLlamaServer(slots=2) as server:
        yield server


@pytest.fixture
def client(fake: FakeLlamaServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{fake.url}/v1", api_key="unused", max_retries=0)


def _chat(words: str, **extra: object) -> dict[str, object]:
    return {"model": "test-model", "messages": [{"role": "user", "content": words}], **extra}


def _eventually(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


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
    assert chunks[-1].usage.prompt_tokens == 3
    assert chunks[-1].usage.completion_tokens == 4


def test_last_content_chunk_carries_timings_and_finish_reason(fake: FakeLlamaServer):
    body = _chat("one two three", max_tokens=2, stream=True)
    with httpx.stream("POST", f"{fake.url}/v1/chat/completions", json=body) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line[6:7] == "{"]

    assert response.headers["content-type"] == "text/event-stream"
    assert response.headers["transfer-encoding"] == "chunked"
    assert [e["choices"][0]["finish_reason"] for e in events] == [None, "stop"]
    assert "usage" not in events[-1]
    assert events[-1]["timings"]["prompt_n"] == 3
    assert events[-1]["timings"]["cache_n"] == 0
    assert events[-1]["timings"]["predicted_n"] == 2


def test_openai_client_gets_a_whole_completion_with_usage(client: openai.OpenAI):
    completion = client.chat.completions.create(**_chat("a b c d e"))

    assert completion.choices[0].message.content == " ".join(f"tok{i}" for i in range(8)) + " "
    assert completion.usage is not None
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (5, 8)


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
    assert repeat["timings"]["cache_n"] == 66
    assert repeat["usage"]["prompt_tokens"] == 67
    assert repeat["usage"]["prompt_tokens_details"]["cached_tokens"] == 66
    assert longer["timings"]["cache_n"] == 67
    assert longer["usage"]["prompt_tokens"] == 69


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

    assert counts == [Usage(3, 0, 8), Usage(3, 2, 8), Usage(3, 2, 8)]


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
    lines = []

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

    _eventually(lambda: fake.disconnects == 1 and fake.in_flight == 0)


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
    _eventually(lambda: fake.in_flight == 1)
    fake.stop()
    caller.join(timeout=5)

    assert not caller.is_alive()
    assert len(errors) == 1


def test_a_client_leaving_mid_stream_is_counted_and_generation_stops(fake: FakeLlamaServer):
    fake.token_delay = 0.02
    body = _chat("hi", max_tokens=1000, stream=True)

    with httpx.stream("POST", f"{fake.url}/v1/chat/completions", json=body) as response:
        next(response.iter_lines())

    _eventually(lambda: fake.disconnects == 1 and fake.in_flight == 0, timeout=2)


def test_reset_stats_forgets_observations(fake: FakeLlamaServer):
    httpx.post(f"{fake.url}/v1/chat/completions", json=_chat("hi"))

    fake.reset_stats()

    assert (fake.seen, fake.max_concurrent, fake.disconnects, fake.in_flight) == ([], 0, 0, 0)


def test_unknown_knob_values_are_rejected(fake: FakeLlamaServer):
    with pytest.raises(ValueError):
        fake.fail_mode = "explode"
    with pytest.raises(ValueError):
        fake.health = "fine"
