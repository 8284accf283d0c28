"""A route's options for llama-server fleets: credentials passed through, unknown model names
mapped to the default, model management open to clients, and the host's own answers kept."""

from __future__ import annotations

import httpx
import pytest

from accounting.models import Request
from tests.fakes.llama_server import FakeLlamaServer
from tests.helpers.fleet import MODEL, add_host, add_route, chat
from tests.helpers.waits import wait_until

pytestmark = pytest.mark.django_db(transaction=True)

CHAT = "/chat/v1/chat/completions"


def test_a_route_passing_credentials_lets_the_host_check_the_clients_key(gateway):
    with FakeLlamaServer(api_key="client-key") as keyed:
        add_route("chat", [add_host("gpu1", keyed.url, api_key="host-key")], pass_credentials=True)
        gateway.sync()

        bearer = httpx.post(
            gateway.url + CHAT, json=chat(), headers={"Authorization": "Bearer client-key"}
        )
        api_key = httpx.post(gateway.url + CHAT, json=chat(), headers={"X-Api-Key": "client-key"})
        missing = httpx.post(gateway.url + CHAT, json=chat())

    assert (bearer.status_code, api_key.status_code) == (200, 200)
    assert missing.status_code == 401  # the host's own answer, passed through unchanged
    assert missing.headers["x-crossbar-host"] == "gpu1"
    # The host's key goes with the gateway's own polls, never with a client's request.
    posts = [seen for seen in keyed.seen if seen.method == "POST"]
    assert len(posts) == 3
    assert not any("host-key" in str(seen.header_lines) for seen in posts)
    row = wait_until(lambda: Request.objects.filter(status=401).first(), what="the 401 row")
    assert row.host == "gpu1"


def test_without_passing_credentials_the_host_gets_its_own_key_only(gateway):
    with FakeLlamaServer(api_key="host-key") as keyed:
        add_route("chat", [add_host("gpu1", keyed.url, api_key="host-key")])
        gateway.sync()

        response = httpx.post(gateway.url + CHAT, json=chat(), headers={"X-Api-Key": "client-key"})

    assert response.status_code == 200
    (seen,) = [seen for seen in keyed.seen if seen.method == "POST"]
    assert seen.headers["authorization"] == "Bearer host-key"
    assert "x-api-key" not in seen.headers


def test_a_route_that_maps_unknown_models_serves_fixed_names_with_its_default(gateway, fake):
    add_route("chat", [add_host("gpu1", fake.url)], default_model=MODEL, map_unknown_models=True)
    gateway.sync()

    response = httpx.post(gateway.url + CHAT, json={**chat(), "model": "gpt-3.5-turbo"})

    assert response.status_code == 200
    assert [seen.json["model"] for seen in fake.seen if seen.method == "POST"] == [MODEL]
    row = wait_until(lambda: Request.objects.first(), what="the row")
    assert row.model == MODEL


def test_a_route_that_maps_unknown_models_keeps_a_model_it_serves_by_its_own_name(gateway, fake):
    host = add_host("gpu1", fake.url, models={MODEL: (4, 4), "coder": (4, 4)})
    add_route("chat", [host], default_model=MODEL, map_unknown_models=True)
    gateway.sync()

    response = httpx.post(gateway.url + CHAT, json={**chat(), "model": "coder"})

    assert response.status_code == 200
    assert [seen.json["model"] for seen in fake.seen if seen.method == "POST"] == ["coder"]
    # Asked by its model: the row of the test before may land after this one's tables were
    # emptied (the gateway writes rows a batch at a time), and be the first.
    wait_until(lambda: Request.objects.filter(model="coder").exists(), what="the row")


def test_without_mapping_an_unknown_model_is_refused(gateway, fake):
    add_route("chat", [add_host("gpu1", fake.url)], default_model=MODEL)
    gateway.sync()

    response = httpx.post(gateway.url + CHAT, json={**chat(), "model": "gpt-3.5-turbo"})

    assert response.status_code == 404
    assert response.json()["error"]["code"] == "model_not_found"


def test_clients_may_load_models_only_where_the_route_allows_it(gateway):
    with FakeLlamaServer(router_models=("small", "large"), models_max=1) as router:
        host = add_host("gpu1", router.url, models={"small": (1, 0), "large": (1, 0)})
        add_route("closed", [host])
        add_route("open", [host], manage_models=True)
        gateway.sync()

        refused = httpx.post(f"{gateway.url}/closed/models/load", json={"model": "large"})
        loaded = httpx.post(f"{gateway.url}/open/models/load", json={"model": "large"})

    assert refused.status_code == 403
    assert refused.json()["error"]["code"] == "model_management_not_allowed"
    assert loaded.status_code == 200
    assert [seen.route for seen in router.seen if seen.method == "POST"] == ["/models/load"]
