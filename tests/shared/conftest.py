"""A real redis-server for the shared-state tests: Debian's binary, on a free port, in a tmp dir.

Never a system service: each test starts its own server (a few milliseconds) with nothing
persisted (`--save "" --appendonly no`), so a restart comes back empty, as a crashed Redis
without persistence does. Tests skip, saying why, when the binary is missing; `.ci/run`
installs it.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from tests.conftest import ROOT, free_port

LONG = 30.0  # seconds a test waits for something that must happen (a busy machine is slow)


class RedisServer:
    """One redis-server process that a test can stop and start again on the same port."""

    def __init__(self, binary: str, directory: Path) -> None:
        self.binary = binary
        self.directory = directory
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 20.0) -> None:
        """Start the server and return once it answers PING."""
        assert self.process is None, "already running"
        self.process = subprocess.Popen(
            [
                self.binary,
                "--port", str(self.port),
                "--bind", "127.0.0.1",
                "--save", "",
                "--appendonly", "no",
                "--dir", str(self.directory),
                "--logfile", str(self.directory / "redis.log"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        deadline = time.monotonic() + timeout
        while not self.answers():
            if self.process.poll() is not None:
                log = (self.directory / "redis.log").read_text(errors="replace")
                pytest.fail(f"redis-server exited at start:\n{log}")
            if time.monotonic() > deadline:
                pytest.fail(f"redis-server did not answer PING within {timeout} s")
            time.sleep(0.02)

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL) and wait until it is gone."""
        if self.process is None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)
        self.process = None

    def answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(64).startswith(b"+PONG")
        except OSError:
            return False


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A running redis-server of this test's own; `.stop()` and `.start()` restart it empty."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed (Debian: apt-get install redis-server)")
    server = RedisServer(binary, tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """The URL of this test's own redis-server."""
    return redis_server.url


async def eventually(predicate, what: str):
    """Await until `predicate()` (an async function) is truthy and return it; fail after LONG."""
    try:
        async with asyncio.timeout(LONG):
            while True:
                if value := await predicate():
                    return value
                await asyncio.sleep(0.05)
    except TimeoutError:
        pytest.fail(f"timed out after {LONG} s waiting for {what}")


@contextlib.asynccontextmanager
async def holding_process(url: str, *what: str) -> AsyncIterator[asyncio.subprocess.Process]:
    """A real second OS process (tests/shared/holder.py, liveness expiry 1 s) that holds what
    `what` says in Redis; yields once it holds it. Killed (SIGKILL) when the block ends, if the
    test did not kill it first."""
    holder = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.shared.holder", url, "1.0", *what,
        cwd=ROOT,
        stdout=subprocess.PIPE,
    )  # fmt: skip
    try:
        said = await asyncio.wait_for(holder.stdout.readline(), LONG)  # type: ignore[union-attr]  # stdout=PIPE
        assert said.strip() == b"held", said
        yield holder
    finally:
        if holder.returncode is None:
            holder.send_signal(signal.SIGKILL)
            await holder.wait()
