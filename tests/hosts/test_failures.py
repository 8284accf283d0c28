"""A failed connection to a host reads the same plain words through every client crossbar uses:
httpx on httpcore, httpx on aiohttp (the proxy's two transports), the poller's `/health` client
and aiohttp (the poller's other reads)."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Awaitable, Callable, Iterator

import aiohttp
import httpx
import pytest

from hosts.failures import failure
from hosts.health_client import HealthClient
from routing.upstream_aiohttp import aiohttp_transport
from tests.helpers.machine import free_port

Get = Callable[[str], Awaitable[object]]


async def _httpcore(url: str) -> object:
    async with httpx.AsyncClient(timeout=5) as client:
        return await client.get(url)


async def _httpx_aiohttp(url: str) -> object:
    async with httpx.AsyncClient(timeout=5, transport=aiohttp_transport()) as client:
        return await client.get(url)


async def _aiohttp(url: str) -> object:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        async with session.get(url) as response:
            return response.status


async def _health(url: str) -> object:
    client = HealthClient(timeout=5)
    try:
        return await client.status(url, {})
    finally:
        await client.aclose()


CLIENTS = {
    "httpcore": _httpcore,
    "httpx-aiohttp": _httpx_aiohttp,
    "health": _health,
    "aiohttp": _aiohttp,
}


async def failing(get: Get, url: str) -> str:
    with pytest.raises(Exception) as caught:
        await get(url)
    return failure(caught.value)


@pytest.fixture(scope="module")
def plain_http() -> Iterator[int]:
    """A plain-HTTP server's port (it answers a TLS handshake with an HTTP error)."""
    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()


@pytest.mark.parametrize("client", CLIENTS)
async def test_a_refused_connect_says_connection_refused_and_nothing_of_tls(client):
    said = await failing(CLIENTS[client], f"http://127.0.0.1:{free_port()}/health")

    assert said == "connection refused (nothing listens at the host's address and port)"


@pytest.mark.parametrize("client", CLIENTS)
async def test_a_name_that_does_not_resolve_says_so(client):
    said = await failing(CLIENTS[client], "http://no-such-host.invalid/health")

    assert said == "the host's name does not resolve (DNS)"


@pytest.mark.parametrize("client", CLIENTS)
async def test_https_to_a_plain_http_host_says_to_use_http(client, plain_http):
    said = await failing(CLIENTS[client], f"https://127.0.0.1:{plain_http}/health")

    assert said.startswith("TLS handshake failed (")
    assert said.endswith("the host speaks plain HTTP (use http://)")


def test_an_error_with_no_known_cause_keeps_its_own_words():
    assert failure(ValueError("odd answer")) == "ValueError: odd answer"
    assert failure(TimeoutError()) == "no answer in time"
