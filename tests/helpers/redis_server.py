"""A real redis-server for the shared-state tests: Debian's binary, on a free port, in a tmp dir.

Never a system service: each test starts its own server (a few milliseconds) with nothing
persisted (`--save "" --appendonly no`), so a restart comes back empty, as a crashed Redis
without persistence does. Tests skip, saying why, when the binary is missing; `.ci/run`
installs it.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.helpers.machine import ROOT, free_port
from tests.helpers.waits import LONG


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
