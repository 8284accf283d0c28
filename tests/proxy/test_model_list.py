"""`/<route>/v1/models`: the models the route serves, each as its host describes it."""

from __future__ import annotations

import httpx
import pytest

from routing.config.shape import HostConfig, ModelConfig
from routing.proxy.model_list import merge
from tests.fakes.llama_server import FakeLlamaServer
from tests.helpers.fleet import add_host, add_route
from tests.helpers.machine import free_port

pytestmark = pytest.mark.django_db(transaction=True)


def listed(gateway, path: str = "/chat/v1/models") -> list[dict]:
    response = httpx.get(f"{gateway.url}{path}", timeout=10)
    assert response.status_code == 200
    return response.json()["data"]


def test_each_model_is_listed_as_its_host_describes_it_under_the_routes_name(gateway):
    with FakeLlamaServer(models=("Llama-3-8B-Q4.gguf",)) as host:
        add_route(
            "chat",
            [add_host("gpu1", host.url, models={"llama3": (2, 0)},
                      upstream_names={"llama3": "Llama-3-8B-Q4.gguf"})],
        )  # fmt: skip
        gateway.sync()
        reported = httpx.get(f"{host.url}/v1/models").json()["data"][0]

        data = listed(gateway)

    assert data == [{**reported, "id": "llama3", "created": data[0]["created"]}]
    assert data[0]["aliases"] == ["Llama-3-8B-Q4.gguf"] and "meta" in data[0]


def test_a_router_hosts_list_shows_each_models_status_and_leaves_out_what_it_no_longer_has(
    gateway,
):
    with FakeLlamaServer(router_models=("a", "b"), load_on_startup=("a",)) as router:
        models = {name: (1, 0) for name in ("a", "b", "gone")}
        add_route("chat", [add_host("gpu1", router.url, models=models)])
        gateway.sync()

        data = listed(gateway, "/chat/models?reload=1")

        asked = [seen.path for seen in router.seen if seen.path.startswith("/models")]
    assert [(entry["id"], entry["status"]["value"]) for entry in data] == [
        ("a", "loaded"),
        ("b", "unloaded"),
    ]
    assert asked == ["/models?reload=1"]


def test_a_host_that_does_not_answer_has_its_models_listed_from_the_configuration(gateway):
    with FakeLlamaServer(models=("other",)) as up:
        add_route(
            "chat",
            [
                add_host("down", f"http://127.0.0.1:{free_port()}", models={"llama3": (1, 0)}),
                add_host("up", up.url, models={"qwen": (1, 0)}),
            ],
        )
        gateway.sync()

        data = listed(gateway)

    assert [entry["id"] for entry in data] == ["llama3", "qwen"]
    assert data[0] == {"id": "llama3", "object": "model", "created": 0, "owned_by": "crossbar"}


def test_a_model_the_route_knows_by_several_of_its_aliases_is_listed_once_as_the_host_lists_it():
    names = ("tinyllama-2", "code", "fim")  # what reading the host proposes: each alias
    host = HostConfig(
        name="gpu1", url="http://gpu1", weight=1.0, enabled=True, draining=False, api_key="",
        models={name: ModelConfig(name, "", 1, 0) for name in names},
    )  # fmt: skip
    reported: dict[str, object] = {"id": "code", "aliases": ["code", "fim", "tinyllama-2"]}

    assert merge([(host, [reported])]) == [reported]
