"""Waiting for a condition rather than for a time: each wait is bounded, and fails the test
saying what it waited for."""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import Callable

import httpx
import pytest

LONG = 30.0  # seconds a test waits for something that must happen (a busy machine is slow)


def wait_until(predicate, timeout: float = 10.0, interval: float = 0.05, what: str = "condition"):
    """Poll until `predicate()` is truthy and return it; fail the test after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


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


def wait_until_healthy(process: subprocess.Popen[bytes], url: str, exited: Callable[[], str],
                       what: str) -> None:  # fmt: skip
    """Wait (30 s at most) until the server `process` started answers `url`/health with 200;
    fail the test with `exited()` when the process ends first."""

    def up() -> bool:
        if process.poll() is not None:
            pytest.fail(exited())
        try:
            return httpx.get(f"{url}/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(up, timeout=30, what=what)
