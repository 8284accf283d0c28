"""Which web pages may read a route's answers from a browser: only the origins the route lists
(with credentials), else pages on localhost (without), as llama-server does once its tools are
enabled; never just any page, whatever the host itself would allow. The same rule for the
preflight, the host's answers and the gateway's own errors, set in the admin or the file."""

from __future__ import annotations

import httpx
import pytest
from django.utils import timezone

from accounting.models import Request
from routing.config.toml import dump_config, parse_config
from routing.config.validation import config_problems
from tests.helpers.fleet import MODEL, add_host, add_route, chat
from tests.helpers.waits import wait_until

pytestmark = pytest.mark.django_db(transaction=True)

CHAT = "/chat/v1/chat/completions"
APP = "https://chat.example.com"
CORS = ("access-control-allow-origin", "access-control-allow-credentials")


def preflight(gateway, origin: str, **headers: str) -> httpx.Response:
    return httpx.options(
        gateway.url + CHAT,
        headers={"Origin": origin, "Access-Control-Request-Method": "POST", **headers},
    )


def cors(response: httpx.Response) -> dict[str, str]:
    """The CORS headers of an answer, as a browser reads them."""
    return {name: response.headers[name] for name in CORS if name in response.headers}


@pytest.fixture
def default_route(gateway, fake):
    add_route("chat", [add_host("gpu1", fake.url)], default_model=MODEL)
    gateway.sync()


@pytest.fixture
def listing_route(gateway, fake):
    add_route("chat", [add_host("gpu1", fake.url)], default_model=MODEL, cors_origins=APP)
    gateway.sync()


@pytest.mark.parametrize(
    "origin", ["http://evil.com", "http://localhost.evil.com", "http://notlocalhost"]
)
def test_a_preflight_from_another_site_names_no_origin_and_no_credentials(
    gateway, default_route, origin
):
    response = preflight(gateway, origin, **{"Access-Control-Request-Headers": "authorization"})

    assert response.status_code == 200
    assert not [name for name in response.headers if name.startswith("access-control-")]


@pytest.mark.parametrize(
    "origin", ["http://localhost:5173", "https://127.0.0.1:8443", "http://[::1]"]
)
def test_by_default_a_page_on_localhost_may_call_the_route_without_credentials(
    gateway, default_route, origin
):
    response = preflight(gateway, origin, **{"Access-Control-Request-Headers": "content-type"})

    assert cors(response) == {"access-control-allow-origin": origin}
    assert response.headers["access-control-allow-methods"] == "GET, POST, DELETE, OPTIONS"
    assert response.headers["access-control-allow-headers"] == "content-type"
    assert "origin" in response.headers["vary"].lower()


def test_an_origin_the_route_lists_is_named_with_credentials_and_nothing_is_asked_of_a_host(
    gateway, fake, listing_route
):
    before = timezone.now()

    response = preflight(gateway, APP, **{"Access-Control-Request-Headers": "authorization"})
    # A request after the preflight: its row lands after any row the preflight would write.
    httpx.post(gateway.url + CHAT, json=chat())

    assert cors(response) == {
        "access-control-allow-origin": APP,
        "access-control-allow-credentials": "true",
    }
    assert response.headers["access-control-allow-headers"] == "authorization"
    assert len(fake.requests_to("/v1/chat/completions")) == 1
    since = Request.objects.filter(started__gte=before)
    wait_until(lambda: since.filter(model=MODEL).exists(), what="the request's row")
    assert since.count() == 1


def test_a_route_that_lists_origins_no_longer_lets_localhost_in(gateway, listing_route):
    assert cors(preflight(gateway, "http://localhost:5173")) == {}


def test_a_star_lets_every_page_read_answers_but_never_with_credentials(gateway, fake):
    add_route("chat", [add_host("gpu1", fake.url)], cors_origins=f"{APP}, *")
    gateway.sync()

    assert cors(preflight(gateway, "https://other.example")) == {"access-control-allow-origin": "*"}
    assert cors(preflight(gateway, APP))["access-control-allow-credentials"] == "true"


def test_a_hosts_permissive_cors_does_not_reach_the_browser(gateway, fake, listing_route):
    # The fake, like llama-server, names whatever origin asks; the route's rule decides.
    evil = httpx.post(gateway.url + CHAT, json=chat(), headers={"Origin": "http://evil.com"})
    listed = httpx.post(gateway.url + CHAT, json=chat(), headers={"Origin": APP})

    assert evil.status_code == listed.status_code == 200
    assert [seen.headers["origin"] for seen in fake.requests_to("/v1/chat/completions")] == [
        "http://evil.com",
        APP,
    ]
    assert cors(evil) == {}
    assert cors(listed) == {
        "access-control-allow-origin": APP,
        "access-control-allow-credentials": "true",
    }


def test_the_gateways_own_errors_follow_the_routes_rule(gateway, listing_route):
    unknown = {**chat(), "model": "not-served"}

    evil = httpx.post(gateway.url + CHAT, json=unknown, headers={"Origin": "http://evil.com"})
    listed = httpx.post(gateway.url + CHAT, json=unknown, headers={"Origin": APP})
    no_route = httpx.post(
        gateway.url + "/nowhere/v1/chat/completions", json=chat(), headers={"Origin": APP}
    )

    assert evil.status_code == listed.status_code == 404
    assert cors(evil) == {}
    assert cors(listed) == {
        "access-control-allow-origin": APP,
        "access-control-allow-credentials": "true",
    }
    assert no_route.status_code == 404
    assert cors(no_route) == {}  # no route, no list: the default rule, and APP is not localhost


@pytest.mark.parametrize(
    "origins", ["https://chat.example.com/", "chat.example.com", "https://a.example/app", "null"]
)
def test_an_entry_that_is_not_an_origin_is_refused_by_the_checks(origins):
    hosts, routes, file_problems = parse_config(
        f'[[routes]]\nname = "chat"\ncors_origins = "https://ok.example {origins}"\n'
    )

    problems = [p for p in config_problems(hosts, routes) if p.key == "routes.chat.cors_origins"]

    assert file_problems == []
    assert [problem.code for problem in problems] == ["E001"]
    assert "is not an origin" in problems[0].message


def test_the_file_keeps_a_routes_origins():
    text = f'[[routes]]\nname = "chat"\ncors_origins = "{APP} http://localhost:5173"\n'

    _, routes, _ = parse_config(text)
    _, again, _ = parse_config(dump_config([], routes))

    assert again[0].cors_origins == routes[0].cors_origins == f"{APP} http://localhost:5173"
