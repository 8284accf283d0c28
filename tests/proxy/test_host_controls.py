"""Who may reach each class of endpoint: every class against every caller, on a real gateway and
the fake llama-server, by the status the caller sees and whether the host saw the request.

Classes (routing/core/endpoints.py): generate, inspect, host state and models are a client's
(with a valid key when keys are in use), the health check anyone's; host controls are an
operator's (the metrics token, or a signed-in staff session) unless the route opens them; one
named host's own endpoints are always an operator's.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from contextlib import closing
from typing import Any

import httpx
import pytest
from django.conf import settings
from django.contrib.auth import get_user_model
from django.test import Client

from accounting.models import ClientKey
from tests.fakes.llama_server import FakeLlamaServer
from tests.fakes.llama_wire import SeenRequest
from tests.helpers.fleet import MODEL, add_host, add_route, chat
from tests.helpers.gateway import Gateway, running_gateway, signed_in

pytestmark = pytest.mark.django_db(transaction=True)

TOKEN = "ops-secret-token"
MARK = "X-Test-Request"  # every request carries a number of its own, to find it at the host
_numbers = itertools.count()


@pytest.fixture(scope="module")
def guarded(django_db_setup, django_db_blocker, tmp_path_factory) -> Iterator[Gateway]:
    """A gateway with the operators' token set (CROSSBAR_METRICS_TOKEN)."""
    with django_db_blocker.unblock():
        log_dir = tmp_path_factory.mktemp("guarded")
        with running_gateway(log_dir, CROSSBAR_METRICS_TOKEN=TOKEN) as gateway:
            yield gateway


@pytest.fixture
def host() -> Iterator[FakeLlamaServer]:
    """A fake that serves every host control: `POST /props` and one LoRA adapter."""
    with FakeLlamaServer(props=True, lora_adapters=("style.gguf",)) as server:
        yield server


def issue(name: str = "team-a") -> str:
    row = ClientKey(name=name)
    key = row.issue_key()
    row.save()
    return key


def admin_user() -> None:
    get_user_model().objects.create_user("admin", password="password", is_staff=True)


def fleet(host: FakeLlamaServer) -> None:
    """Route `chat` opens nothing; `open` opens host controls; `managed` opens model loading."""
    gpu1 = add_host("gpu1", host.url)
    add_route("chat", [gpu1], default_model=MODEL)
    add_route("open", [gpu1], default_model=MODEL, open_host_controls=True)
    add_route("managed", [gpu1], default_model=MODEL, manage_models=True)


def ask(
    client: httpx.Client, method: str, target: str, body: Any = None, **headers: str
) -> tuple[httpx.Response, str]:
    """Send one request carrying its own mark; the mark finds it among what the host saw."""
    mark = str(next(_numbers))
    content = json.dumps(body).encode() if body is not None else None
    sent = {MARK: mark, **({"Content-Type": "application/json"} if content else {}), **headers}
    return client.request(method, target, content=content, headers=sent, timeout=30), mark


def arrived(host: FakeLlamaServer, mark: str) -> list[SeenRequest]:
    """The request with this mark, as the host saw it (empty when it never got there)."""
    return [request for request in host.seen if request.headers.get(MARK.lower()) == mark]


def outcome(host: FakeLlamaServer, answer: tuple[httpx.Response, str]) -> str:
    """What the caller got: `passes` (the host saw it and its answer came back), `gateway`
    (the gateway answered it itself, as it does the model list), or the refusal's code."""
    response, mark = answer
    if arrived(host, mark):
        assert response.headers["x-crossbar-host"] == "gpu1"
        return "passes"
    if response.status_code < 400:
        return "gateway"
    return str(response.json()["error"]["code"])


# The cells: what each caller gets, per endpoint. Refusals are by code; on the guarded gateway
# every one is a 401, since a client key or the operators' token would get in.
OK, GW = "passes", "gateway"  # reached the host / answered by the gateway itself
NK, BK = "missing_api_key", "invalid_api_key"
OP, MM = "operator_only", "model_management_not_allowed"
CALLERS = ("nobody", "client key", "operator token", "admin session", "opened", "opened + key")
LORA = [{"id": 0, "scale": 0.25}]
LOAD = {"model": MODEL}
TEXT = {"content": "hi"}
PROPS = {"n_ctx": 64}
SAVE = {"filename": "slot0.bin"}
LOOKUP = {"conversation_ids": ["c"]}
CELLS = [
    # class         method  path                         body    nobody key token admin opened +key
    ("generate",     "POST", "/v1/chat/completions",      chat(), (NK, OK, BK, NK, NK, OK)),
    ("inspect",      "POST", "/tokenize",                 TEXT,   (NK, OK, BK, NK, NK, OK)),
    ("health",       "GET",  "/health",                   None,   (OK, OK, OK, OK, OK, OK)),
    ("health",       "GET",  "/v1/health",                None,   (OK, OK, OK, OK, OK, OK)),
    ("host state",   "GET",  "/props",                    None,   (NK, OK, BK, NK, NK, OK)),
    ("host state",   "GET",  "/models/sse",               None,   (NK, OK, BK, NK, NK, OK)),
    ("models",       "GET",  "/v1/models",                None,   (NK, GW, BK, NK, NK, GW)),
    ("host control", "GET",  "/slots",                    None,   (OP, OP, OK, OK, NK, OK)),
    ("host control", "POST", "/slots/0?action=save",      SAVE,   (OP, OP, OK, OK, NK, OK)),
    ("host control", "GET",  "/metrics",                  None,   (OP, OP, OK, OK, NK, OK)),
    ("host control", "POST", "/props",                    PROPS,  (OP, OP, OK, OK, NK, OK)),
    ("host control", "GET",  "/lora-adapters",            None,   (OP, OP, OK, OK, NK, OK)),
    ("host control", "POST", "/lora-adapters",            LORA,   (OP, OP, OK, OK, NK, OK)),
    ("host control", "GET",  "/cors-proxy?url=http://x",  None,   (OP, OP, OK, OK, NK, OK)),
    ("host control", "GET",  "/v1/stream?conv_id=c&from=0", None, (OP, OP, OK, OK, NK, OK)),
    ("host control", "DELETE", "/v1/stream?conv_id=c",    None,   (OP, OP, OK, OK, NK, OK)),
    ("host control", "POST", "/v1/streams/lookup",        LOOKUP, (OP, OP, OK, OK, NK, OK)),
    ("host control", "POST", "/models/load",              LOAD,   (MM, MM, OK, OK, NK, OK)),
    ("host control", "POST", "/models/unload",            LOAD,   (MM, MM, OK, OK, NK, OK)),
    ("host control", "POST", "/models",                   LOAD,   (MM, MM, OK, OK, NK, OK)),
    ("host control", "DELETE", "/models?model=x",         None,   (MM, MM, OK, OK, NK, OK)),
    ("one host",     "GET",  "/hosts/gpu1/props",         None,   (OP, OP, OK, OK, OP, OP)),
    ("one host",     "GET",  "/hosts/gpu1/slots",         None,   (OP, OP, OK, OK, OP, OP)),
    ("one host",     "POST", "/hosts/gpu1/lora-adapters", LORA,   (OP, OP, OK, OK, OP, OP)),
    ("one host",     "POST", "/hosts/gpu1/slots/1?action=erase", None, (OP, OP, OK, OK, OP, OP)),
]  # fmt: skip


@pytest.mark.parametrize(
    ("kind", "method", "path", "body", "expected"),
    CELLS,
    ids=[f"{kind}: {method} {path.partition('?')[0]}" for kind, method, path, *_ in CELLS],
)
def test_each_endpoint_is_reached_by_exactly_the_callers_its_class_admits(
    guarded, host, kind, method, path, body, expected
):
    fleet(host)
    key = issue()
    admin_user()
    guarded.sync()
    # Model load, unload, download and removal are opened by the route's manage_models, the
    # rest by open_host_controls.
    opened = "/managed" if path.startswith("/models") else "/open"

    with (
        httpx.Client(base_url=guarded.url) as anyone,
        closing(signed_in(guarded)) as admin,
    ):
        csrf = {"X-CSRFToken": admin.cookies["csrftoken"]}
        answers = {
            "nobody": ask(anyone, method, f"/chat{path}", body),
            "client key": ask(anyone, method, f"/chat{path}", body, Authorization=f"Bearer {key}"),
            "operator token": ask(
                anyone, method, f"/chat{path}", body, Authorization=f"Bearer {TOKEN}"
            ),
            "admin session": ask(admin, method, f"/chat{path}", body, **csrf),
            "opened": ask(anyone, method, f"{opened}{path}", body),
            "opened + key": ask(
                anyone, method, f"{opened}{path}", body, Authorization=f"Bearer {key}"
            ),
        }

    got = {caller: outcome(host, answer) for caller, answer in answers.items()}
    assert got == dict(zip(CALLERS, expected, strict=True))
    for caller, (response, _) in answers.items():
        if got[caller] not in (OK, GW):
            assert response.status_code == 401, (caller, response.text)
            assert TOKEN not in response.text and key not in response.text


def test_an_operator_token_never_reaches_the_host_even_where_the_route_passes_credentials(
    guarded, host
):
    add_route("chat", [add_host("gpu1", host.url)], pass_credentials=True)
    guarded.sync()

    with httpx.Client(base_url=guarded.url) as client:
        response, mark = ask(client, "GET", "/chat/slots", Authorization=f"Bearer {TOKEN}")

    assert response.status_code == 200
    (sent,) = arrived(host, mark)
    assert "authorization" not in sent.headers


# -- the default: no operators' token set ----------------------------------------------------


@pytest.fixture
def keyed_fleet(gateway, host) -> str:
    """The faults as seen: client keys in use, no operators' token (the session gateway)."""
    fleet(host)
    key = issue()
    gateway.sync()
    return key


def test_one_hosts_slots_are_refused_to_a_request_without_a_key(gateway, host, keyed_fleet):
    with httpx.Client(base_url=gateway.url) as client:
        response, mark = ask(client, "GET", "/chat/hosts/gpu1/slots")

    assert response.status_code == 403
    assert response.json()["error"]["code"] == "operator_only"
    assert not arrived(host, mark)


def test_one_hosts_adapter_scales_cannot_be_changed_without_a_key(gateway, host, keyed_fleet):
    with httpx.Client(base_url=gateway.url) as client:
        response, mark = ask(client, "POST", "/chat/hosts/gpu1/lora-adapters", LORA)

    assert response.status_code == 403
    assert not arrived(host, mark)
    assert httpx.get(f"{host.url}/lora-adapters").json()[0]["scale"] == 1.0


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [("GET", "/slots", None), ("POST", "/lora-adapters", LORA), ("POST", "/props", {"n": 1})],
)
def test_a_client_key_does_not_reach_a_routes_host_controls(
    gateway, host, keyed_fleet, method, path, body
):
    with httpx.Client(base_url=gateway.url) as client:
        response, mark = ask(
            client, method, f"/chat{path}", body, Authorization=f"Bearer {keyed_fleet}"
        )

    assert response.status_code == 403
    assert response.json()["error"]["code"] == "operator_only"
    assert not arrived(host, mark)


def test_the_refusal_says_how_an_operator_gets_in(gateway, host, keyed_fleet):
    with httpx.Client(base_url=gateway.url) as client:
        at_route = ask(client, "GET", "/chat/slots")[0].json()["error"]["message"]
        one_host = ask(client, "GET", "/chat/hosts/gpu1/slots")[0].json()["error"]["message"]
        loading = ask(client, "POST", "/chat/models/load", {"model": MODEL})[0]

    assert "set CROSSBAR_METRICS_TOKEN on the gateway" in at_route
    assert "sign in at /admin/" in at_route
    assert "set open_host_controls on route “chat”" in at_route
    assert "other users' requests" in at_route
    assert "CROSSBAR_METRICS_TOKEN" in one_host and "/admin/" in one_host
    assert "open_host_controls" not in one_host  # no route setting opens one host's own
    assert loading.status_code == 403
    assert "set manage_models on route “chat”" in loading.json()["error"]["message"]


def test_the_cors_proxy_is_refused_saying_the_host_would_fetch_any_url(gateway, host):
    add_route("chat", [add_host("gpu1", host.url)])
    gateway.sync()

    with httpx.Client(base_url=gateway.url) as client:
        response, mark = ask(client, "GET", "/chat/cors-proxy?url=http://169.254.169.254/")

    assert response.status_code == 403
    assert "make the host fetch any URL" in response.json()["error"]["message"]
    assert not arrived(host, mark)


def test_a_route_that_opens_host_controls_forwards_the_cors_proxy_with_its_query(gateway, host):
    add_route("open", [add_host("gpu1", host.url)], open_host_controls=True)
    gateway.sync()

    with httpx.Client(base_url=gateway.url) as client:
        response, mark = ask(client, "GET", "/open/cors-proxy?url=http://x.test/")

    assert response.headers["x-crossbar-host"] == "gpu1"
    (sent,) = arrived(host, mark)
    assert sent.path == "/cors-proxy?url=http://x.test/"


def test_without_keys_anyone_generates_but_host_controls_stay_the_operators(gateway, host):
    fleet(host)
    gateway.sync()

    with httpx.Client(base_url=gateway.url) as client:
        generated = ask(client, "POST", "/chat/v1/chat/completions", chat())
        slots = ask(client, "GET", "/chat/slots")
        opened = ask(client, "GET", "/open/slots")
        opened_one_host = ask(client, "GET", "/open/hosts/gpu1/slots")

    assert [outcome(host, a) for a in (generated, slots, opened, opened_one_host)] == [
        "passes", "operator_only", "passes", "operator_only",
    ]  # fmt: skip
    assert slots[0].status_code == 403


def test_a_signed_in_admin_reaches_one_host_without_any_token(gateway, host, keyed_fleet):
    admin_user()

    with closing(signed_in(gateway)) as admin:
        slots = ask(admin, "GET", "/chat/hosts/gpu1/slots")
        changed = ask(
            admin, "POST", "/chat/hosts/gpu1/lora-adapters", LORA,
            **{"X-CSRFToken": admin.cookies["csrftoken"]},
        )  # fmt: skip

    assert [outcome(host, a) for a in (slots, changed)] == ["passes", "passes"]
    assert httpx.get(f"{host.url}/lora-adapters").json()[0]["scale"] == 0.25


def test_an_admins_change_without_the_csrf_token_is_refused(gateway, host, keyed_fleet):
    admin_user()

    with closing(signed_in(gateway)) as admin:
        response, mark = ask(admin, "POST", "/chat/lora-adapters", LORA)

    assert response.status_code == 403
    assert "CSRF" in response.json()["error"]["message"]
    assert not arrived(host, mark)


def test_a_signed_in_user_who_is_not_staff_is_no_operator(gateway, host, keyed_fleet):
    viewer = get_user_model().objects.create_user("viewer", password="password")
    browser = Client()
    browser.force_login(viewer)  # a live session in the database the gateway reads
    cookie = f"{settings.SESSION_COOKIE_NAME}={browser.cookies[settings.SESSION_COOKIE_NAME].value}"

    with httpx.Client(base_url=gateway.url) as client:
        response, mark = ask(client, "GET", "/chat/hosts/gpu1/slots", Cookie=cookie)

    assert response.status_code == 403
    assert not arrived(host, mark)
