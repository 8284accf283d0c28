"""crossbar as users run it (`manage.py crossbar_serve`), on a real server and the test
database, for the tests that ask it over the network."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from django.db import connection

from tests.helpers.machine import ROOT, free_port
from tests.helpers.redis_server import RedisServer
from tests.helpers.waits import wait_until, wait_until_healthy


def _database_url() -> str:
    """The URL of the test database, for the gateway process to use."""
    conf = connection.settings_dict
    if conf["ENGINE"] == "django.db.backends.sqlite3":
        return f"sqlite:///{conf['NAME']}"
    user = conf.get("USER") or ""
    password = f":{conf['PASSWORD']}" if conf.get("PASSWORD") else ""
    auth = f"{user}{password}@" if user else ""
    host = conf.get("HOST") or "127.0.0.1"
    return f"postgres://{auth}{host}:{conf.get('PORT') or 5432}/{conf['NAME']}"


@dataclass
class Gateway:
    url: str
    process: subprocess.Popen[bytes]
    log_path: Path

    def sync(self, timeout: float = 10.0) -> None:
        """Wait until the gateway has loaded the configuration the test just committed."""
        from routing.models import ConfigRevision

        want = ConfigRevision.current()

        def loaded() -> bool:
            try:
                return httpx.get(f"{self.url}/health", timeout=2).json().get("revision") == want
            except (httpx.HTTPError, ValueError):
                return False

        wait_until(loaded, timeout, what=f"the gateway to load config revision {want}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def server_under_test() -> str:
    """The server the tests' gateways run on: CROSSBAR_TEST_SERVER (daphne or uvicorn), as
    `CROSSBAR_SERVER` picks it for `make run`."""
    server = os.environ.get("CROSSBAR_TEST_SERVER", "daphne")
    assert server in ("daphne", "uvicorn"), f"CROSSBAR_TEST_SERVER is daphne or uvicorn: {server!r}"
    return server


@contextlib.contextmanager
def running_gateway(log_dir: Path, **settings: str) -> Iterator[Gateway]:
    """crossbar as users run it (`manage.py crossbar_serve`) on a free port and the test database,
    on the server CROSSBAR_TEST_SERVER names.

    `settings` override the environment (e.g. CROSSBAR_HEALTH_INTERVAL="60"), which the gateway
    otherwise inherits.
    """
    port = free_port()
    log_path = log_dir / f"gateway-{port}.log"
    env = {
        **os.environ,
        "CROSSBAR_SERVER": server_under_test(),
        "DATABASE_URL": _database_url(),
        "DEBUG": "false",
        "CROSSBAR_CONFIG_POLL": "0.05",
        "CROSSBAR_HEALTH_INTERVAL": "0.2",
        "CROSSBAR_HEALTH_TIMEOUT": "1",
        "CROSSBAR_HEADERS_TIMEOUT": "3",
        "CROSSBAR_STREAM_IDLE_TIMEOUT": "3",
        "CROSSBAR_LOG_LEVEL": "INFO",
        "PYTHONUNBUFFERED": "1",
        **settings,
    }
    with log_path.open("wb") as log_file:
        process = subprocess.Popen(
            [sys.executable, "manage.py", "crossbar_serve", "--bind", "127.0.0.1", "--port",
             str(port)],
            cwd=ROOT,
            env=env,
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        url = f"http://127.0.0.1:{port}"

        try:
            wait_until_healthy(
                process,
                url,
                lambda: f"the gateway exited at start:\n{log_path.read_text()}",
                "the gateway to start",
            )
            yield Gateway(url=url, process=process, log_path=log_path)
        finally:
            process.terminate()
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()


@contextlib.contextmanager
def two_gateways(
    log_dir: Path, redis_url: str, **settings: str
) -> Iterator[tuple[Gateway, Gateway]]:
    """Two gateway processes sharing the Redis at `redis_url` (and the test database), a dead
    process's slots outliving it 1 s (`CROSSBAR_REDIS_HOLD_TTL`; 5 s by default)."""
    env = {"CROSSBAR_REDIS_URL": redis_url, "CROSSBAR_REDIS_HOLD_TTL": "1", **settings}
    with running_gateway(log_dir, **env) as first, running_gateway(log_dir, **env) as second:
        first.sync()
        second.sync()
        yield first, second


@contextlib.contextmanager
def running_gateway_on_the_tests_backing(log_dir: Path, **settings: str) -> Iterator[Gateway]:
    """`running_gateway`, with CROSSBAR_TEST_SHARED=1 keeping its state in a redis-server of
    its own (`CROSSBAR_REDIS_URL`), as the session's `gateway` does: a test that needs other
    settings still checks the shared state's behaviour too."""
    with contextlib.ExitStack() as stack:
        if os.environ.get("CROSSBAR_TEST_SHARED") == "1":
            binary = shutil.which("redis-server")
            if binary is None:
                pytest.fail(
                    "CROSSBAR_TEST_SHARED=1 needs redis-server (apt-get install redis-server)"
                )
            (log_dir / "redis").mkdir(exist_ok=True)
            redis = RedisServer(binary, log_dir / "redis")
            redis.start()
            stack.callback(redis.stop)
            settings = {"CROSSBAR_REDIS_URL": redis.url, **settings}
        yield stack.enter_context(running_gateway(log_dir, **settings))


def signed_in(
    gateway: Gateway, username: str = "admin", password: str = "password"
) -> httpx.Client:
    """An httpx client signed in to the admin of the real server (the user must exist)."""
    # The login hashes the password (PBKDF2, a million rounds): seconds on a busy machine,
    # past httpx's default 5 s once (in the host-control matrix).
    client = httpx.Client(base_url=gateway.url, headers={"Origin": gateway.url}, timeout=30)
    token = client.get("/admin/login/").cookies["csrftoken"]
    response = client.post(
        "/admin/login/",
        data={"username": username, "password": password, "csrfmiddlewaretoken": token},
    )
    assert response.status_code == 302, "the admin login failed"
    return client
