"""A bounded soak: thousands of requests across four hosts while the hosts fail at random and
clients leave at random. Afterwards the gateway holds no slot, queue place or client
connection, wrote one row per request, and its memory and open files are where they started.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import threading
import time
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest

from tests.fakes.llama_server import FakeLlamaServer
from tests.helpers.fleet import MODEL, add_host, add_route, chat
from tests.helpers.gateway import running_gateway
from tests.helpers.invariants import Ledger, rss_mib, wait_until_free

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.soak]

LOAD_SECONDS = 8.0
CLIENTS = 32
HOSTS = 4
# (fail_mode, requests it applies to) and how often each is injected. "hang" costs a slot for
# the 3 s head timeout, so it is rare.
COUNTED_FAULTS = [("error_500", 3), ("reset_before_headers", 2), ("reset_mid_stream", 3)]
KINDS = ("hang", "refuse", "loading", *(mode for mode, _ in COUNTED_FAULTS))


@pytest.fixture(scope="module")
def soak_gateway(django_db_setup, django_db_blocker, tmp_path_factory):
    """A gateway of its own, so that its memory and open files are this test's alone."""
    with django_db_blocker.unblock():
        with running_gateway(tmp_path_factory.mktemp("soak")) as gw:
            yield gw


@pytest.fixture
def fakes() -> Iterator[list[FakeLlamaServer]]:
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(FakeLlamaServer(slots=4, token_delay=0.002)) for _ in range(4)]


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def fd_targets(pid: int) -> list[str]:
    """What the process's open files point at; a file closed while we look is skipped."""
    targets = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            targets.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except FileNotFoundError:
            pass
    return targets


def client_connections(pid: int, port: int) -> int:
    """The gateway's TCP connections on its listening port (its clients' connections)."""
    inodes = {target[8:-1] for target in fd_targets(pid) if target.startswith("socket:")}
    count = 0
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as lines:
            next(lines)
            for line in lines:
                fields = line.split()
                local_port, state, inode = int(fields[1].split(":")[1], 16), fields[3], fields[9]
                if inode in inodes and local_port == port and state != "0A":  # 0A: listening
                    count += 1
    return count


class Faults:
    """Injects faults into random hosts until stopped; counts what it injected."""

    def __init__(self, fakes: list[FakeLlamaServer], rng: random.Random) -> None:
        self.fakes = fakes
        self.rng = rng
        self.injected: Counter[str] = Counter()
        self.stop = threading.Event()

    def run(self) -> None:
        # Every kind once first, in a random order, so each is seen however slow the machine;
        # then kinds at random, a hang rarely (it costs a slot for the 3 s head timeout).
        first = list(KINDS)
        self.rng.shuffle(first)
        while not self.stop.wait(0.25):
            fake = self.rng.choice(self.fakes)
            if fake.fail_mode is not None or fake.health != "ok":
                continue
            self.inject(fake, first.pop() if first else self._random_kind())
        for fake in self.fakes:
            fake.fail_mode, fake.health = None, "ok"

    def _random_kind(self) -> str:
        roll = self.rng.random()
        if roll < 0.08:
            return "hang"
        if roll < 0.16:
            return "refuse"
        if roll < 0.24:
            return "loading"
        return self.rng.choice(COUNTED_FAULTS)[0]

    def inject(self, fake: FakeLlamaServer, kind: str) -> None:
        if kind == "refuse":
            self._for_a_while(fake, "fail_mode", "refuse", None)
        elif kind == "loading":
            self._for_a_while(fake, "health", "loading", "ok")
        else:
            count = dict(COUNTED_FAULTS).get(kind, 1)
            fake.fail_mode, fake.fail_count = kind, count
            self.injected[kind] += count

    def _for_a_while(self, fake: FakeLlamaServer, knob: str, value: str, back: object) -> None:
        setattr(fake, knob, value)
        self.injected[value] += 1
        if not self.stop.wait(self.rng.uniform(0.2, 0.6)):
            setattr(fake, knob, back)

    def total(self) -> int:
        return sum(self.injected.values())


async def load(url: str, ledger: Ledger, seconds: float, rng: random.Random) -> Counter[str]:
    """CLIENTS clients, each sending chats one after another for `seconds`; outcomes by kind.

    A client that leaves does so only after its whole request went out (and was counted): a
    request cut while it is being written never reaches the gateway, so it has no row.
    """
    outcomes: Counter[str] = Counter()

    async def one(client: httpx.AsyncClient) -> None:
        stream = rng.random() < 0.6
        body = chat(
            f"conversation {rng.randrange(300)}", stream=stream, max_tokens=rng.randint(1, 12)
        )
        headers = {"X-Crossbar-Wait-Status": "on"} if stream and rng.random() < 0.2 else {}
        leave_after = rng.uniform(0.0, 0.08) if rng.random() < 0.15 else None
        out = asyncio.Event()

        async def trace(name: str, info: dict) -> None:
            if name == "http11.send_request_body.complete":
                ledger.sent()
                out.set()

        async def ask() -> str:
            request = client.build_request(
                "POST", "/chat/v1/chat/completions", json=body, headers=headers,
                extensions={"trace": trace},
            )  # fmt: skip
            try:
                response = await client.send(request, stream=True)
                try:
                    await response.aread()
                finally:
                    await response.aclose()
            except httpx.TransportError:
                return "broken"  # a whole answer its host cut short
            return str(response.status_code)

        asking = asyncio.ensure_future(ask())
        if leave_after is not None:
            sending = asyncio.ensure_future(out.wait())
            await asyncio.wait((asking, sending), return_when=asyncio.FIRST_COMPLETED)
            sending.cancel()
            await asyncio.wait((asking,), timeout=leave_after)
            if not asking.done():
                asking.cancel()
                outcomes["left"] += 1
                await asyncio.wait((asking,))
                return
        outcomes[await asking] += 1

    async def client_loop(deadline: float) -> None:
        limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
        async with httpx.AsyncClient(base_url=url, timeout=30, limits=limits) as client:
            while time.monotonic() < deadline:
                await one(client)

    deadline = time.monotonic() + seconds
    await asyncio.gather(*(client_loop(deadline) for _ in range(CLIENTS)))
    return outcomes


def test_a_soak_of_random_faults_and_departures_leaks_nothing(soak_gateway, fakes):
    gateway = soak_gateway
    hosts = [add_host(f"gpu{i}", fake.url, models={MODEL: (4, 8)}) for i, fake in enumerate(fakes)]
    add_route("chat", hosts)
    gateway.sync()
    pid, port = gateway.process.pid, int(gateway.url.rsplit(":", 1)[1])
    rng = random.Random(9)
    with Ledger(gateway) as ledger:
        asyncio.run(load(gateway.url, ledger, 2.0, rng))  # warm up: pools, leases, caches
        wait_until_free(gateway.url)
        fds_before, rss_before = open_fds(pid), rss_mib(pid)

        faults = Faults(fakes, rng)
        injector = threading.Thread(target=faults.run)
        injector.start()
        try:
            outcomes = asyncio.run(load(gateway.url, ledger, LOAD_SECONDS, rng))
        finally:
            faults.stop.set()
            injector.join()

        statuses = Counter(ledger.statuses(timeout=30))
        wait_until_free(gateway.url)  # every slot and queue place back: none leaked
        ledger.settle(timeout=30)  # and exactly one row per request
        fds_after, rss_after = open_fds(pid), rss_mib(pid)
        clients_after = client_connections(pid, port)

    print(
        f"\nsoak: {ledger.count} requests ({sum(outcomes.values())} in the timed part), "
        f"{faults.total()} faults injected {dict(faults.injected)}, "
        f"{sum(statuses.values())} rows {dict(sorted(statuses.items()))}, "
        f"client outcomes {dict(outcomes)}, 0 slots leaked, "
        f"fds {fds_before} -> {fds_after}, RSS {rss_before:.0f} -> {rss_after:.0f} MiB"
    )
    # A fixed time, not a number of requests: a busy machine sends fewer, and that is fine.
    assert set(faults.injected) == set(KINDS)
    assert outcomes["left"] >= 1
    assert {"200", "499", "500", "502"} <= {str(status) for status in statuses}
    assert clients_after == 0
    # Pooled connections to the hosts may come and go; nothing else may pile up.
    assert fds_after <= fds_before + 2 * HOSTS * 4
    assert rss_after - rss_before < 40
