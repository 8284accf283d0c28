"""`crossbar_config discover`: a host added by its URL alone gets its models and slots from
itself."""

from __future__ import annotations

import io

import pytest
from django.core.management import CommandError, call_command

from hosts.models import Host
from routing.config.toml import parse_config
from tests.fakes.llama_server import FakeLlamaServer
from tests.helpers.fleet import add_host
from tests.helpers.machine import free_port

# It looks in the database for a host it already knows at each URL.
pytestmark = pytest.mark.django_db


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


def test_what_discover_prints_loads_as_it_is(tmp_path):
    with FakeLlamaServer(slots=2) as fake:
        path = tmp_path / "crossbar.toml"
        path.write_text(call_command("crossbar_config", "discover", fake.url))

    assert "1 host added" in call_command("crossbar_config", "load", str(path))


def test_a_url_that_answers_nothing_is_a_clear_error():
    url = f"http://127.0.0.1:{free_port()}"

    with pytest.raises(CommandError, match=f"cannot discover {url}: .*ConnectError"):
        call_command("crossbar_config", "discover", url)


def test_an_unreachable_url_does_not_keep_discover_from_the_others():
    first, last = f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
    out = io.StringIO()
    with FakeLlamaServer(slots=2, models=("qwen-7b",)) as fake:
        with pytest.raises(CommandError) as refused:
            call_command("crossbar_config", "discover", first, fake.url, last, stdout=out)

    (host,), _, _ = parse_config(out.getvalue())
    assert host.url == fake.url
    said = str(refused.value).splitlines()
    assert said[0] == "2 of 3 URLs not discovered (the hosts above are the others):"
    assert said[1].startswith(f"  cannot discover {first}: {first}/props: ConnectError")
    assert said[2].startswith(f"  cannot discover {last}: {last}/props: ConnectError")


def test_a_url_ending_in_v1_gets_the_admins_hint():
    with FakeLlamaServer() as fake:
        with pytest.raises(CommandError) as refused:
            call_command("crossbar_config", "discover", f"{fake.url}/v1")

    assert str(refused.value) == (
        f"cannot discover {fake.url}/v1: Leave out the /v1: crossbar adds each endpoint's own "
        "path (/v1/chat/completions, /health), so this URL would send requests to "
        f"/v1/v1/... Use {fake.url}."
    )


def test_discover_says_it_wrote_the_hosts_itself():
    with FakeLlamaServer() as fake:
        text = call_command("crossbar_config", "discover", fake.url)

    assert text.splitlines()[0] == (
        "# crossbar hosts, as `manage.py crossbar_config discover` read them from the hosts."
    )
    assert "dump" not in text


def test_a_host_the_database_has_at_the_url_keeps_its_name_and_settings(tmp_path):
    with FakeLlamaServer(slots=3, models=("llama3",)) as fake:
        local = add_host("local", f"http://localhost:{fake.port}", models={"llama3": (4, 2)})
        Host.objects.filter(pk=local.pk).update(weight=2.0, notes="the box under the desk")
        text = call_command("crossbar_config", "discover", f"http://127.0.0.1:{fake.port}/")
        path = tmp_path / "crossbar.toml"
        path.write_text(text)
        planned = call_command("crossbar_config", "load", "--dry-run", str(path))

    (host,), _, _ = parse_config(text)
    assert (host.name, host.url, host.weight, host.notes) == (
        "local",
        f"http://localhost:{fake.port}",
        2.0,
        "the box under the desk",
    )
    assert [(m.name, m.parallel, m.queue_max) for m in host.models] == [("llama3", 3, 2)]
    assert planned.splitlines()[1:] == [
        "  change model local/llama3: parallel 4 -> 3",
        "summary: 1 model changed",
    ]


def test_a_host_the_given_file_has_at_the_url_keeps_its_name(tmp_path):
    with FakeLlamaServer(slots=2) as fake:
        path = tmp_path / "crossbar.toml"
        path.write_text(f'[[hosts]]\nname = "desk"\nurl = "{fake.url}"\n')
        text = call_command("crossbar_config", "discover", "--config", str(path), fake.url)

    (host,), _, _ = parse_config(text)
    assert host.name == "desk"


def test_discover_writes_the_other_names_a_host_lists_for_its_model_as_its_aliases():
    with FakeLlamaServer(slots=2, models=("qwen-7b",), aliases=("chat", "fast")) as fake:
        text = call_command("crossbar_config", "discover", fake.url)

    (host,), _, problems = parse_config(text)
    assert problems == []
    assert [(m.name, m.parallel, m.aliases) for m in host.models] == [
        ("qwen-7b", 2, ("chat", "fast"))
    ]
    assert '  aliases = ["chat", "fast"]' in text.splitlines()
