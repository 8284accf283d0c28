"""What a host is told about the client: never the headers the client meant for the gateway
alone (those its `Connection` header names), and the client's address as the gateway saw it,
not as the client claims it (a client's forwarding headers count only from a trusted proxy)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from routing.core.forwarding import forwarding_headers, trusted_networks
from tests.fakes.llama_server import FakeLlamaServer
from tests.helpers import wire
from tests.helpers.fleet import add_host, add_route, chat
from tests.helpers.gateway import Gateway, running_gateway

pytestmark = pytest.mark.django_db(transaction=True)

CHAT = "/chat/v1/chat/completions"
CLAIMS = {
    "X-Forwarded-For": "203.0.113.7",
    "X-Forwarded-Host": "bank.example",
    "X-Forwarded-Proto": "https",
    "Forwarded": "for=203.0.113.7;proto=https",
}


@pytest.fixture(scope="module")
def trusting_gateway(django_db_setup, django_db_blocker, tmp_path_factory) -> Iterator[Gateway]:
    """A second gateway that trusts its loopback peer as a reverse proxy, as one behind nginx
    on the same machine would be configured."""
    with django_db_blocker.unblock():
        log_dir = tmp_path_factory.mktemp("trusting-gateway")
        with running_gateway(log_dir, CROSSBAR_TRUSTED_PROXIES="127.0.0.0/8, ::1") as gateway:
            yield gateway


def the_generation(fake: FakeLlamaServer) -> dict[str, str]:
    """The headers of the one chat completion the host received."""
    (seen,) = fake.requests_to("/v1/chat/completions")
    return seen.headers


def test_headers_the_client_names_in_connection_never_reach_the_host(gateway, fake):
    add_route("chat", [add_host("gpu1", fake.url)])
    gateway.sync()

    answer = wire.exchange(
        gateway.url,
        b"POST",
        CHAT.encode(),
        json.dumps(chat()).encode(),
        headers={
            b"Connection": b"X-Secret-Hop, x-other-hop",  # a second Connection line
            b"X-Secret-Hop": b"for the gateway only",
            b"X-Other-Hop": b"this one too",
            b"Content-Type": b"application/json",
            b"X-Kept": b"end to end",
        },
    )

    assert answer.status == 200, answer.body
    seen = the_generation(fake)
    assert "x-secret-hop" not in seen
    assert "x-other-hop" not in seen
    assert seen["x-kept"] == "end to end"


def test_the_host_is_told_the_peer_address_not_the_clients_claim(gateway, fake):
    add_route("chat", [add_host("gpu1", fake.url)])
    gateway.sync()

    response = httpx.post(gateway.url + CHAT, json=chat(), headers=CLAIMS)

    assert response.status_code == 200
    seen = the_generation(fake)
    assert seen["x-forwarded-for"] == "127.0.0.1"
    assert seen["forwarded"] == "for=127.0.0.1"
    assert "x-forwarded-host" not in seen
    assert "x-forwarded-proto" not in seen


def test_without_forwarding_headers_the_host_still_learns_the_peer(gateway, fake):
    add_route("chat", [add_host("gpu1", fake.url)])
    gateway.sync()

    httpx.post(gateway.url + CHAT, json=chat())

    seen = the_generation(fake)
    assert (seen["x-forwarded-for"], seen["forwarded"]) == ("127.0.0.1", "for=127.0.0.1")


def test_behind_a_trusted_proxy_the_chain_is_kept_and_the_proxy_appended(trusting_gateway, fake):
    add_route("chat", [add_host("gpu1", fake.url)])
    trusting_gateway.sync()

    response = httpx.post(trusting_gateway.url + CHAT, json=chat(), headers=CLAIMS)

    assert response.status_code == 200
    seen = the_generation(fake)
    assert seen["x-forwarded-for"] == "203.0.113.7, 127.0.0.1"
    assert seen["forwarded"] == "for=203.0.113.7;proto=https, for=127.0.0.1"
    assert seen["x-forwarded-host"] == "bank.example"
    assert seen["x-forwarded-proto"] == "https"


@pytest.mark.parametrize(
    ("peer", "trusted", "expected"),
    [
        # RFC 7239 6: an IPv6 node is bracketed and quoted.
        (
            "2001:db8::7",
            "",
            [("X-Forwarded-For", "2001:db8::7"), ("Forwarded", 'for="[2001:db8::7]"')],
        ),
        # A dual-stack socket shows an IPv4 proxy as ::ffff:a.b.c.d: still that proxy.
        (
            "::ffff:10.0.0.5",
            "10.0.0.0/8",
            [("X-Forwarded-For", "198.51.100.1, 10.0.0.5"), ("Forwarded", "for=10.0.0.5")],
        ),
        # No address (a Unix socket): the node is `unknown`, and nothing is believed.
        ("", "0.0.0.0/0", [("X-Forwarded-For", "unknown"), ("Forwarded", "for=unknown")]),
    ],
)
def test_the_peer_is_written_as_the_forwarding_headers_spell_it(peer, trusted, expected):
    claims = {"X-Forwarded-For": "198.51.100.1"}

    written = forwarding_headers(
        peer, claims, trusted_networks(trusted.split(",") if trusted else [])
    )

    assert list(written) == expected
