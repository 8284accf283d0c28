"""Shared fixtures: the fake llama-server, and the gateway as a real daphne server."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from django.db import connection
from hypothesis import settings

from tests.fakes.llama_server import FakeLlamaServer

ROOT = Path(__file__).resolve().parent.parent

# No per-example deadline: the properties are about outcomes, and on a busy machine (CI runs two
# configurations at once) an example of the relay's took 268 ms against Hypothesis' 200.
settings.register_profile("crossbar", deadline=None)
settings.load_profile("crossbar")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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

        def up() -> bool:
            if process.poll() is not None:
                pytest.fail(f"the gateway exited at start:\n{log_path.read_text()}")
            try:
                return httpx.get(f"{url}/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        try:
            wait_until(up, timeout=30, what="the gateway to start")
            yield Gateway(url=url, process=process, log_path=log_path)
        finally:
            process.terminate()
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()


@pytest.fixture(scope="session")
def gateway(django_db_setup, django_db_blocker, tmp_path_factory) -> Iterator[Gateway]:
    """One gateway for the whole session; each test's fleet reaches it through `sync()`.

    With CROSSBAR_TEST_SHARED=1 in the environment it keeps its state in a redis-server of its
    own (`CROSSBAR_REDIS_URL`), so the same tests check the shared state's behaviour.
    """
    with django_db_blocker.unblock(), contextlib.ExitStack() as stack:
        log_dir = tmp_path_factory.mktemp("gateway")
        settings: dict[str, str] = {}
        if os.environ.get("CROSSBAR_TEST_SHARED") == "1":
            from tests.shared.conftest import RedisServer

            binary = shutil.which("redis-server")
            if binary is None:
                pytest.fail(
                    "CROSSBAR_TEST_SHARED=1 needs redis-server (apt-get install redis-server)"
                )
            redis = RedisServer(binary, tmp_path_factory.mktemp("redis"))
            redis.start()
            stack.callback(redis.stop)
            settings["CROSSBAR_REDIS_URL"] = redis.url
        gw = stack.enter_context(running_gateway(log_dir, **settings))
        yield gw


@pytest.fixture
def fake() -> Iterator[FakeLlamaServer]:
    """One fake llama-server with 4 slots, over real sockets."""
    with FakeLlamaServer(slots=4) as server:
        yield server


@pytest.fixture
def fake2() -> Iterator[FakeLlamaServer]:
    with FakeLlamaServer(slots=4) as server:
        yield server


@pytest.fixture
def ledger(request, gateway):
    """Counts the test's requests to `gateway`; when the test passes, checks that the gateway
    holds no slot or queue place and wrote exactly one row per request (tests/invariants.py)."""
    from tests.invariants import Ledger

    with Ledger(gateway) as book:
        yield book
        report = getattr(request.node, "rep_call", None)
        if report is not None and report.passed:
            book.settle()


@pytest.fixture(autouse=True)
def _gateway_log_on_failure(request):
    yield
    report = getattr(request.node, "rep_call", None)
    if report is not None and report.failed and "gateway" in request.fixturenames:
        gw = request.getfixturevalue("gateway")
        print("---- gateway log (tail) ----\n" + "\n".join(gw.log().splitlines()[-40:]))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark as `e2e` every test that starts a real server: it uses the `gateway` fixture, or
    its module starts gateways of its own (`running_gateway`), or it lives in tests/e2e. Run the
    tests that restart PostgreSQL last: a connection they kill may live on in another context
    (Playwright's greenlets keep their own), where no test can close it."""
    items.sort(key=lambda item: item.get_closest_marker("restarts_database") is not None)
    server = server_under_test()
    for item in items:
        for mark in item.iter_markers("not_on"):
            if mark.args[0] == server:
                why = f"not on {server}, for any ASGI application (docs/operating.md): "
                why += str(mark.args[1])
                item.add_marker(pytest.mark.skip(reason=why))
        module = getattr(item, "module", None)
        if (
            "gateway" in getattr(item, "fixturenames", ())
            or (module is not None and "running_gateway" in vars(module))
            or "/e2e/" in str(item.path)
        ):
            item.add_marker(pytest.mark.e2e)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report


def _flush_retrying_a_deadlock() -> None:
    """Let a test's closing flush retry when PostgreSQL broke a deadlock by cancelling it.

    A gateway under test keeps reading the configuration (a join over several tables) while a
    `transaction=True` test ends by truncating every table, and TRUNCATE takes its locks table
    by table: the two can deadlock, and PostgreSQL cancels one of them. When it cancels the
    gateway's read, the gateway logs it and reads again; when it cancels the flush, the flush
    must simply run again, or the next test starts with this one's rows.
    """
    from django.test import TransactionTestCase

    teardown = TransactionTestCase._fixture_teardown  # type: ignore[attr-defined]  # private in django-stubs

    def retrying(self: TransactionTestCase) -> None:
        for attempt in range(3):
            try:
                return teardown(self)
            except Exception as exc:
                chain: list[str] = []
                cause: BaseException | None = exc
                while cause is not None:
                    chain.append(str(cause))
                    cause = cause.__cause__ or cause.__context__
                if attempt == 2 or not any("deadlock detected" in text for text in chain):
                    raise

    TransactionTestCase._fixture_teardown = retrying  # type: ignore[attr-defined]  # private in django-stubs


_flush_retrying_a_deadlock()


def pytest_sessionfinish(session, exitstatus):
    """Remove the SQLite test database's WAL files, which Django's teardown leaves behind."""
    from django.conf import settings

    name = settings.DATABASES["default"].get("TEST", {}).get("NAME")
    if name:
        for suffix in ("-wal", "-shm", "-journal"):
            Path(f"{name}{suffix}").unlink(missing_ok=True)


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
