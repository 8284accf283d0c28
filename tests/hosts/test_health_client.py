"""The poller's `/health` client over real sockets: a host that keeps its connection is asked
on it round after round; one that closes it between polls, answers slowly or in garbage, or
refuses, is seen as llama-server's operator would put it (the health table's reason)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import pytest

from hosts.health import HealthTable, HostState
from hosts.health_client import HealthClient
from hosts.poller import Poller, Probe
from tests.fakes.llama_server import FakeLlamaServer
from tests.helpers.machine import free_port

OK = b'HTTP/1.1 200 OK\r\nContent-Length: 15\r\n\r\n{"status":"ok"}'

Answer = Callable[[int], bytes | None]  # the n-th request on a connection -> what to send


class Host:
    """A host on a free port whose answer to the n-th request of a connection is `answer(n)`
    (None: it closes the connection instead); counts connections and requests, and can close
    every connection once it has answered (`close_after`)."""

    def __init__(self, answer: Answer = lambda n: OK, *, close_after: bool = False) -> None:
        self.answer = answer
        self.close_after = close_after
        self.connections = 0
        self.closed = asyncio.Event()  # set once it closed a connection
        self.requests: list[bytes] = []
        self._server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def __aenter__(self) -> Host:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            for n in range(1_000):
                self.requests.append(await reader.readuntil(b"\r\n\r\n"))
                reply = self.answer(n)
                if reply is None:
                    break
                writer.write(reply)
                await writer.drain()
                if self.close_after:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()
            self.closed.set()


@pytest.fixture
async def client() -> AsyncIterator[HealthClient]:
    client = HealthClient(timeout=1.0)
    yield client
    await client.aclose()


async def poll_reason(host_url: str) -> tuple[HostState, str]:
    """One poll of a host through the poller: its state and reason in the health table."""
    poller = Poller(HealthTable(), interval=5.0, poll_timeout=0.5)
    poller.table.track({"gpu1": host_url})
    try:
        await poller.poll(Probe("gpu1", host_url))
    finally:
        await poller.aclose()
    health = poller.table.get("gpu1")
    return health.state, health.reason


async def test_a_host_that_keeps_its_connection_is_asked_on_it_every_time(client) -> None:
    async with Host() as host:
        statuses = [await client.status(f"{host.url}/health", {}) for _ in range(5)]

    assert statuses == [200] * 5
    assert host.connections == 1
    assert len(host.requests) == 5
    assert host.requests[0].startswith(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1:")


async def test_a_host_that_closes_the_connection_after_each_answer_is_asked_on_a_new_one(
    client,
) -> None:
    async with Host(close_after=True) as host:
        first = await client.status(f"{host.url}/health", {})
        await asyncio.wait_for(host.closed.wait(), 10)  # its close arrives while it is idle
        second = await client.status(f"{host.url}/health", {})

    assert (first, second) == (200, 200)
    assert host.connections == 2


async def test_a_kept_connection_the_host_closes_as_the_request_arrives_is_retried_once(
    client,
) -> None:
    # Each connection answers its first request and closes on its second, unanswered: as
    # llama-server does when its keep-alive timeout crosses the next poll.
    async with Host(lambda n: OK if n == 0 else None) as host:
        statuses = [await client.status(f"{host.url}/health", {}) for _ in range(3)]

    assert statuses == [200, 200, 200]
    assert host.connections == 3
    assert len(host.requests) == 5  # 1 + (1 closed, 1 answered) x 2


async def test_a_new_connection_closed_without_an_answer_marks_the_host_down() -> None:
    async with Host(lambda n: None) as host:
        state, reason = await poll_reason(host.url)

    assert state is HostState.DOWN
    assert reason == "/health: the host closed the connection without answering"
    assert host.connections == 1  # a new connection is not tried twice


async def test_the_key_goes_with_each_poll_and_a_503_means_loading() -> None:
    with FakeLlamaServer(api_key="s3cret") as fake:
        fake.health = "loading"
        poller = Poller(HealthTable(), interval=5.0, poll_timeout=2.0)
        poller.table.track({"gpu1": fake.url})
        try:
            await poller.poll(Probe("gpu1", fake.url, api_key="s3cret"))
        finally:
            await poller.aclose()

    assert poller.table.get("gpu1").state is HostState.LOADING
    assert [seen.headers.get("authorization") for seen in fake.seen] == ["Bearer s3cret"]


async def test_a_host_that_answers_too_slowly_is_down_for_no_answer_in_time() -> None:
    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(OK[:20])  # the head begins, and nothing more comes
        await asyncio.sleep(5)
        writer.close()

    server = await asyncio.start_server(slow, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        state, reason = await poll_reason(f"http://127.0.0.1:{port}")
    finally:
        server.close()

    assert (state, reason) == (HostState.DOWN, "/health: no answer in time")


async def test_a_garbled_answer_marks_the_host_down_saying_what_came() -> None:
    async with Host(lambda n: b"SSH-2.0-OpenSSH_9.2\r\n\r\n") as host:
        state, reason = await poll_reason(host.url)

    assert state is HostState.DOWN
    assert reason == "/health: Garbled: not an HTTP answer: b'SSH-2.0-OpenSSH_9.2'"


async def test_an_answer_cut_short_in_its_body_marks_the_host_down() -> None:
    async with Host(lambda n: OK[:-5], close_after=True) as host:
        state, reason = await poll_reason(host.url)

    assert state is HostState.DOWN
    assert reason == "/health: the connection ended before the whole response arrived"


async def test_a_refused_connection_marks_the_host_down_as_refused() -> None:
    state, reason = await poll_reason(f"http://127.0.0.1:{free_port()}")

    assert state is HostState.DOWN
    assert reason == "/health: connection refused (nothing listens at the host's address and port)"


async def test_an_answer_without_a_length_gives_its_status_and_its_connection_is_not_kept(
    client,
) -> None:
    chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n"
    async with Host(lambda n: chunked) as host:
        statuses = [await client.status(f"{host.url}/health", {}) for _ in range(2)]

    assert statuses == [200, 200]
    assert host.connections == 2


async def test_an_error_status_is_given_as_it_is_and_the_connection_kept(client) -> None:
    error = b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 4\r\n\r\noops"
    async with Host(lambda n: error) as host:
        statuses = [await client.status(f"{host.url}/v1/health", {}) for _ in range(2)]

    assert statuses == [500, 500]
    assert host.connections == 1
    assert host.requests[0].startswith(b"GET /v1/health HTTP/1.1\r\n")


def test_on_uvloop_as_uvicorn_serves_a_kept_connection_is_asked_again_and_a_refusal_is_down() -> (
    None
):
    # uvicorn runs the gateway, and so the poller, on uvloop, whose transports are not
    # asyncio's classes.
    import uvloop

    async def rounds() -> tuple[list[int], int, tuple[HostState, str]]:
        client = HealthClient(timeout=1.0)
        try:
            async with Host() as host:
                statuses = [await client.status(f"{host.url}/health", {}) for _ in range(3)]
        finally:
            await client.aclose()
        return statuses, host.connections, await poll_reason(f"http://127.0.0.1:{free_port()}")

    statuses, connections, (state, reason) = uvloop.run(rounds())

    assert statuses == [200, 200, 200]
    assert connections == 1
    assert state is HostState.DOWN
    assert reason.startswith("/health: connection refused")
