"""Fixtures for the shared-state tests: a real redis-server of each test's own
(tests/helpers/redis_server.py)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.redis_server import RedisServer


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
