"""Every llama-server endpoint through a route: what takes a slot and a lease, what does not,
what the gateway answers itself, and what it refuses."""

from __future__ import annotations

import json
import time
from contextlib import closing
from datetime import datetime

import httpx
import pytest
from django.contrib.auth import get_user_model
from django.utils import timezone

from accounting.models import Request
from tests.fakes.llama_server import FakeLlamaServer
from tests.helpers.fleet import MODEL, add_host, add_route
from tests.helpers.gateway import signed_in
from tests.helpers.waits import wait_until

pytestmark = pytest.mark.django_db(transaction=True)

CHAT_ROUTE = {"default_model": MODEL}  # the `chat_route` fixture's route (tests/conftest.py)


def rows_since(before: datetime, count: int) -> list[Request]:
    """The rows of requests this test sent (an earlier test's may still be landing)."""
    mine = Request.objects.filter(started__gte=before).order_by("id")
    return wait_until(
        lambda: (rows := list(mine.all())) and len(rows) >= count and rows, what=f"{count} rows"
    )


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/completion", {"prompt": "Once upon a time", "n_predict": 4}),
        ("/completions", {"prompt": "Once upon a time", "max_tokens": 4}),
        ("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 4}),
        ("/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
        ("/infill", {"input_prefix": "def f(", "input_suffix": "):", "prompt": ""}),
        ("/v1/responses", {"input": "Hi", "instructions": "Be terse."}),
        ("/responses", {"input": "Hi"}),
        ("/v1/messages", {"max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}),
        ("/v1/embeddings", {"input": "hello"}),
        ("/embedding", {"content": "hello"}),
        ("/rerank", {"query": "q", "documents": ["a", "b"]}),
        ("/reranking", {"query": "q", "documents": ["a", "b"]}),
    ],
)
def test_endpoints_that_generate_take_a_slot_of_the_route_model(chat_route, fake, path, body):
    before = timezone.now()
    session = {"X-Crossbar-Session": f"{path} {time.monotonic()}"}  # a new conversation

    response = httpx.post(f"{chat_route}{path}", json=body, headers=session, timeout=30)

    assert response.status_code == 200, response.text
    assert response.headers["x-crossbar-host"] == "gpu1"
    assert response.headers["x-crossbar-placement"] == "new"
    assert [seen.route for seen in fake.seen if seen.method == "POST"] == [path]
    (row,) = rows_since(before, 1)
    assert (row.status, row.model, row.host, row.placement) == (200, MODEL, "gpu1", "new")


def test_a_native_completion_returns_to_its_host_on_the_next_turn(gateway, fake, fake2):
    add_route("chat", [add_host("gpu1", fake.url), add_host("gpu2", fake2.url)])
    gateway.sync()
    body = {"model": MODEL, "prompt": "A long shared story prefix", "n_predict": 2}

    first = httpx.post(f"{gateway.url}/chat/completion", json=body)
    second = httpx.post(f"{gateway.url}/chat/completion", json=body)

    assert first.headers["x-crossbar-placement"] == "new"
    assert second.headers["x-crossbar-placement"] == "home"
    assert second.headers["x-crossbar-host"] == first.headers["x-crossbar-host"]
    assert second.headers["x-crossbar-lease"] == "reused"


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/tokenize", {"content": "hello world"}),
        ("/detokenize", {"tokens": [1, 2, 3]}),
        ("/apply-template", {"messages": [{"role": "user", "content": "Hi"}]}),
        ("/v1/messages/count_tokens", {"messages": [{"role": "user", "content": "Hi"}]}),
    ],
)
def test_endpoints_that_only_read_the_model_take_no_slot(gateway, path, body):
    with FakeLlamaServer(slots=1, token_delay=0.2) as busy:
        add_route("chat", [add_host("gpu1", busy.url, models={MODEL: (1, 0)})], default_model=MODEL)
        gateway.sync()
        with httpx.Client(base_url=gateway.url, timeout=30) as client:
            with client.stream(
                "POST", "/chat/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "hold"}], "stream": True},
            ) as holding:  # fmt: skip
                assert holding.status_code == 200  # the only slot is held now

                response = client.post(f"/chat{path}", json=body)

    assert response.status_code == 200, response.text
    assert response.headers["x-crossbar-placement"] == "none"


@pytest.mark.parametrize("path", ["/health", "/props", "/slots", "/metrics", "/lora-adapters"])
def test_endpoints_about_the_host_pass_through_with_the_hosts_answer(gateway, fake, path):
    # Host controls (/slots, /metrics, /lora-adapters) are the operator's unless the route
    # opens them (tests/proxy/test_host_controls.py); this route does.
    add_route("chat", [add_host("gpu1", fake.url)], default_model=MODEL, open_host_controls=True)
    gateway.sync()

    response = httpx.get(f"{gateway.url}/chat{path}")

    assert response.status_code == 200
    assert response.headers["x-crossbar-host"] == "gpu1"
    assert fake.requests_to(path)[-1].method == "GET"


def test_the_model_list_is_the_gateways_with_and_without_v1(chat_route, fake):
    for path in ("/v1/models", "/models"):
        listed = httpx.get(f"{chat_route}{path}").json()

        assert [model["id"] for model in listed["data"]] == [MODEL]


def test_a_body_the_gateway_must_read_is_refused_clearly_on_every_endpoint(chat_route, fake):
    before = timezone.now()
    for path in ("/completion", "/v1/messages", "/tokenize", "/v1/responses"):
        response = httpx.post(f"{chat_route}{path}", content=b"{not json")

        assert response.status_code == 400, path
        assert response.json()["error"]["code"] == "invalid_body"
    assert len(rows_since(before, 4)) == 4
    assert [seen for seen in fake.seen if seen.method == "POST"] == []


def test_a_body_the_gateway_need_not_read_passes_untouched(gateway, fake):
    add_route("chat", [add_host("gpu1", fake.url)], open_host_controls=True)  # POST /props
    gateway.sync()
    raw = b'{"n_ctx":  4096 , "weird":true}'

    httpx.post(
        f"{gateway.url}/chat/props", content=raw, headers={"content-type": "application/json"}
    )

    # The client's POST (the health poller's GETs of /props may come before or after it).
    (posted,) = [seen for seen in fake.requests_to("/props") if seen.method == "POST"]
    assert posted.body == raw


@pytest.mark.parametrize("path", ["/v2/chat", "/admin", "/completion/x", "/v1/completion", "/"])
def test_paths_llama_server_does_not_serve_are_refused(chat_route, path):
    response = httpx.post(f"{chat_route}{path}", json={})

    assert response.status_code == 404


def test_the_response_head_arrives_when_the_hosts_head_does(gateway):
    with FakeLlamaServer(slots=2, first_token_delay=30) as slow:
        add_route("chat", [add_host("gpu1", slow.url)], default_model=MODEL)
        gateway.sync()
        body = {"messages": [{"role": "user", "content": "Hi"}], "stream": True}
        timeout = httpx.Timeout(10, read=10)
        with httpx.stream(
            "POST", f"{gateway.url}/chat/v1/chat/completions", json=body, timeout=timeout
        ) as response:
            # The first event is 30 s away; the head must not wait for it.
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")


def test_client_credentials_in_any_header_never_reach_the_host(chat_route, fake):
    headers = {"Authorization": "Bearer client-secret", "X-Api-Key": "client-secret"}

    httpx.post(f"{chat_route}/v1/messages", json={"max_tokens": 2, "messages": []}, headers=headers)

    (seen,) = [seen for seen in fake.seen if seen.method == "POST"]
    sent = json.dumps(seen.header_lines).lower()
    assert "client-secret" not in sent
    assert "x-api-key" not in sent


def test_a_host_that_comes_back_serves_at_once_not_after_the_next_poll(tmp_path, fake):
    from tests.helpers.gateway import running_gateway

    add_route("chat", [add_host("gpu1", fake.url)], default_model=MODEL)
    with running_gateway(tmp_path, CROSSBAR_HEALTH_INTERVAL="3600") as gateway:
        gateway.sync()
        body = {"messages": [{"role": "user", "content": "Hi"}]}
        assert httpx.post(f"{gateway.url}/chat/v1/chat/completions", json=body).status_code == 200
        fake.fail_mode = "refuse"
        down = httpx.post(f"{gateway.url}/chat/v1/chat/completions", json=body)
        fake.fail_mode = None

        back = httpx.post(f"{gateway.url}/chat/v1/chat/completions", json=body)

    assert down.status_code == 502
    assert back.status_code == 200


def test_an_operator_reaches_one_named_host_of_the_route(gateway, fake, fake2):
    add_route("chat", [add_host("gpu1", fake.url), add_host("gpu2", fake2.url)])
    get_user_model().objects.create_user("admin", password="password", is_staff=True)
    gateway.sync()

    with closing(signed_in(gateway)) as operator:  # no token set: staff sessions are operators
        slots = operator.get("/chat/hosts/gpu2/slots")
        metrics = operator.get("/chat/hosts/gpu2/metrics")
        unknown = operator.get("/chat/hosts/gpu9/slots")
        not_about_the_host = operator.post("/chat/hosts/gpu2/completion", json={})

    assert (slots.status_code, slots.headers["x-crossbar-host"]) == (200, "gpu2")
    assert metrics.status_code == 200 and "llamacpp:" in metrics.text
    assert fake2.requests_to("/slots") and not fake.requests_to("/slots")
    assert (unknown.status_code, not_about_the_host.status_code) == (404, 404)


def test_one_hosts_own_state_needs_the_operator_token_when_one_is_set(tmp_path, fake):
    from tests.helpers.gateway import running_gateway

    add_route("chat", [add_host("gpu1", fake.url)])
    with running_gateway(tmp_path, CROSSBAR_METRICS_TOKEN="ops-secret") as gateway:
        gateway.sync()
        url = f"{gateway.url}/chat/hosts/gpu1/slots"

        without = httpx.get(url)
        wrong = httpx.get(url, headers={"Authorization": "Bearer nope"})
        right = httpx.get(url, headers={"Authorization": "Bearer ops-secret"})

    assert (without.status_code, wrong.status_code, right.status_code) == (401, 401, 200)
    assert "ops-secret" not in without.text + wrong.text
    assert "authorization" not in fake.requests_to("/slots")[-1].headers
