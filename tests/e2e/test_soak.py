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
from collections import Counter
from collections.abc import Iterator

import pytest

from tests.fakes.llama_server import FakeLlamaServer
from tests.helpers.fleet import MODEL, add_host, add_route
from tests.helpers.gateway import running_gateway
from tests.helpers.invariants import Ledger, rss_mib, wait_until_free
from tests.helpers.soak import KINDS, Faults, load

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.soak]

LOAD_SECONDS = 8.0
HOSTS = 4


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
