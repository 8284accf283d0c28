"""Defaults that work: what a key left out means is the same in the docs, the file and the admin."""

from __future__ import annotations

import io
import re
from pathlib import Path

import httpx
import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.test import Client

from hosts.models import HostModel
from routing.config.shape import ModelConfig
from routing.config.toml import parse_config
from routing.config.validation import HostSpec, RouteSpec, single_values
from tests.helpers.fleet import chat

ROOT = Path(__file__).resolve().parent.parent.parent

# Keys the docs' format block fills with an example rather than the default.
EXAMPLE_VALUES = {"name", "url", "api_key_env", "default_model"}

MINIMAL = """
[[hosts]]
name = "gpu1"
url = "{url}"
  [[hosts.models]]
  name = "test-model"

[[routes]]
name = "chat"
hosts = ["gpu1"]
"""


def docs_format_block() -> str:
    text = (ROOT / "docs" / "config.md").read_text()
    return re.search(r"## Format\n\n```toml\n(.*?)```", text, re.S)[1]  # type: ignore[index]  # docs/config.md has the block


def load(tmp_path: Path, text: str) -> str:
    path = tmp_path / "crossbar.toml"
    path.write_text(text)
    return call_command("crossbar_config", "load", str(path), stdout=io.StringIO())


def test_every_default_the_docs_show_is_the_default_a_file_gets() -> None:
    [documented], [route], problems = parse_config(docs_format_block())
    bare_hosts, bare_routes, _ = parse_config(
        '[[hosts]]\nname = "a"\nurl = "http://a"\n[[hosts.models]]\nname = "m"\n'
        '[[routes]]\nname = "r"\n'
    )

    assert problems == []
    [bare_host], [bare_route] = bare_hosts, bare_routes
    pairs: list[tuple[HostSpec | ModelConfig | RouteSpec, object]] = [
        (documented, bare_host),
        (documented.models[0], bare_host.models[0]),
        (route, bare_route),
    ]
    for shown, bare in pairs:
        for key, value in single_values(shown, type(shown)).items():
            if key not in EXAMPLE_VALUES:
                assert (key, getattr(bare, key)) == (key, value)
    assert (bare_host.models[0].parallel, bare_host.models[0].queue_max) == (4, 8)


@pytest.mark.django_db
def test_a_model_loaded_without_parallel_or_queue_max_gets_4_slots_and_8_queue_places(
    tmp_path: Path,
) -> None:
    load(tmp_path, MINIMAL.format(url="http://10.0.0.5:8080"))

    model = HostModel.objects.get()
    assert (model.parallel, model.queue_max) == (4, 8)


@pytest.mark.django_db
def test_the_host_admin_offers_a_new_model_4_slots_and_8_queue_places() -> None:
    client = Client()
    client.force_login(get_user_model().objects.create_superuser("root", "", "pw"))

    page = client.get("/admin/hosts/host/add/").content.decode()

    assert re.search(r'name="models-0-parallel" value="4"', page)
    assert re.search(r'name="models-0-queue_max" value="8"', page)


@pytest.mark.django_db(transaction=True)
def test_a_second_concurrent_request_to_a_model_with_defaults_is_served(
    tmp_path: Path, gateway, fake
) -> None:
    fake.token_delay = 0.05
    load(tmp_path, MINIMAL.format(url=fake.url))
    gateway.sync()

    body = chat(stream=True, max_tokens=20)
    with httpx.Client(base_url=gateway.url, timeout=30) as client:
        with client.stream("POST", "/chat/v1/chat/completions", json=body) as first:
            # The first holds its slot until its body is read.
            second = client.post("/chat/v1/chat/completions", json=chat(max_tokens=2))
            assert first.status_code == 200
            first.read()

    assert second.status_code == 200, second.text
    assert second.json()["choices"][0]["message"]["content"]
