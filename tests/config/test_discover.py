"""`crossbar_config discover`: a host added by its URL alone gets its models and slots from
itself."""

from __future__ import annotations

import pytest
from django.core.management import CommandError, call_command

from routing.config.toml import parse_config
from tests.conftest import free_port
from tests.fakes.llama_server import FakeLlamaServer


def test_discover_prints_a_host_with_the_models_and_slots_it_says_it_has():
    with FakeLlamaServer(slots=3, models=("qwen-7b",)) as fake:
        text = call_command("crossbar_config", "discover", fake.url)

    hosts, routes, problems = parse_config(text)
    assert problems == [] and routes == []
    (host,) = hosts
    assert host.url == fake.url and host.name == f"127-0-0-1-{fake.port}"
    assert [(m.name, m.parallel, m.queue_max) for m in host.models] == [("qwen-7b", 3, 8)]
    assert "n_ctx" in host.notes


def test_discover_lists_every_model_a_router_mode_host_can_load():
    with FakeLlamaServer(router_models=("small", "large"), models_max=1) as router:
        text = call_command("crossbar_config", "discover", router.url)

    (host,), _, _ = parse_config(text)
    assert [(m.name, m.parallel) for m in host.models] == [("small", 4), ("large", 4)]
    assert "router mode" in host.notes


@pytest.mark.django_db
def test_what_discover_prints_loads_as_it_is(tmp_path):
    with FakeLlamaServer(slots=2) as fake:
        path = tmp_path / "crossbar.toml"
        path.write_text(call_command("crossbar_config", "discover", fake.url))

    assert "1 host added" in call_command("crossbar_config", "load", str(path))


def test_a_url_that_answers_nothing_is_a_clear_error():
    url = f"http://127.0.0.1:{free_port()}"

    with pytest.raises(CommandError, match=f"cannot discover {url}: .*ConnectError"):
        call_command("crossbar_config", "discover", url)
