"""A model's aliases: the names llama-server also answers to for it (`--alias`), served as one
model with one pool of slots, and listed as the host lists them."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from django.utils import timezone

from accounting.models import Request
from hosts.models import HostModel
from tests.fakes.llama_server import FakeLlamaServer
from tests.helpers.fleet import POLLS, add_host, add_route
from tests.helpers.machine import free_port
from tests.helpers.observe import wait_for_gauge
from tests.helpers.waits import wait_until

pytestmark = pytest.mark.django_db(transaction=True)


def with_aliases(host, model: str, *aliases: str) -> None:
    HostModel.objects.filter(host=host, name=model).update(aliases=list(aliases))


def ask(gateway, model: str, content: str) -> httpx.Response:
    messages = [{"role": "user", "content": content}]
    body = {"model": model, "messages": messages, "stream": True, "max_tokens": 100}
    return httpx.post(f"{gateway.url}/chat/v1/chat/completions", json=body, timeout=60)


def test_two_aliases_of_a_model_with_one_slot_share_it_one_runs_while_the_other_waits(gateway):
    began = timezone.now()  # the gateway is the session's: rows of earlier tests may come late
    with FakeLlamaServer(slots=1, models=("qwen",), aliases=("chat", "fast")) as fake:
        fake.token_delay = 0.1  # each takes 10 s, until the test lets them finish
        host = add_host("gpu1", fake.url, models={"qwen": (1, 1)})
        with_aliases(host, "qwen", "chat", "fast")
        add_route("chat", [host])
        gateway.sync()

        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(ask, gateway, "chat", "first")
            wait_until(lambda: fake.in_flight == 1, what="the first request running upstream")
            second = pool.submit(ask, gateway, "fast", "second")
            wait_for_gauge(gateway.url, "crossbar_queued", 1, host="gpu1", model="qwen")
            running_while_queued = fake.in_flight
            fake.token_delay = 0
            answers = [first.result(), second.result()]
        sent = [json.loads(seen.body)["model"] for seen in fake.seen if seen.path not in POLLS]

    assert [a.status_code for a in answers] == [200, 200]
    assert running_while_queued == 1 and fake.max_concurrent == 1
    assert [int(a.headers["x-crossbar-queued-ms"]) > 0 for a in answers] == [False, True]
    assert sent == ["chat", "fast"]  # the bodies went as the clients sent them
    rows = Request.objects.filter(started__gte=began)
    wait_until(lambda: rows.count() == 2, what="both rows")
    assert sorted(rows.values_list("model", flat=True)) == ["qwen", "qwen"]


def test_the_model_list_shows_a_models_aliases_as_the_host_lists_them(gateway):
    with FakeLlamaServer(models=("qwen",), aliases=("chat", "fast")) as fake:
        up = add_host("up", fake.url, models={"qwen": (1, 0)})
        down = add_host("down", f"http://127.0.0.1:{free_port()}", models={"llama3": (1, 0)})
        with_aliases(up, "qwen", "chat", "fast")
        with_aliases(down, "llama3", "small")
        add_route("chat", [up, down])
        gateway.sync()
        reported = httpx.get(f"{fake.url}/v1/models").json()["data"][0]

        data = httpx.get(f"{gateway.url}/chat/v1/models", timeout=10).json()["data"]

    assert [(entry["id"], entry.get("aliases")) for entry in data] == [
        ("qwen", ["qwen", "chat", "fast"]),
        ("llama3", ["llama3", "small"]),  # its host did not answer: from the configuration
    ]
    assert data[0] == {**reported, "created": data[0]["created"]}


def test_a_router_routes_model_list_says_what_the_router_can_load_now(gateway):
    with FakeLlamaServer(router_models=("a", "b"), load_on_startup=("a",)) as router:
        add_route("chat", [add_host("gpu1", router.url, models={"a": (1, 0)})])
        gateway.sync()

        data = httpx.get(f"{gateway.url}/chat/models?reload=1", timeout=10).json()["data"]

    assert [(entry["id"], entry["status"]["value"]) for entry in data] == [
        ("a", "loaded"),
        ("b", "unloaded"),
    ]
