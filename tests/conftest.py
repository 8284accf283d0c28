"""Shared fixtures: the fake llama-server, and the gateway as a real server
(tests/helpers/gateway.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

from tests.fakes.llama_server import FakeLlamaServer
from tests.helpers.browser import chromium
from tests.helpers.fleet import add_host, add_route
from tests.helpers.gateway import (
    Gateway,
    running_gateway_on_the_tests_backing,
    server_under_test,
)
from tests.helpers.invariants import Ledger

# No per-example deadline: the properties are about outcomes, and on a busy machine (CI runs two
# configurations at once) an example of the relay's took 268 ms against Hypothesis' 200.
settings.register_profile("crossbar", deadline=None)
settings.load_profile("crossbar")


@pytest.fixture(scope="session")
def gateway(django_db_setup, django_db_blocker, tmp_path_factory) -> Iterator[Gateway]:
    """One gateway for the whole session; each test's fleet reaches it through `sync()`.

    With CROSSBAR_TEST_SHARED=1 in the environment it keeps its state in a redis-server of its
    own (`CROSSBAR_REDIS_URL`), so the same tests check the shared state's behaviour.
    """
    with django_db_blocker.unblock():
        log_dir = tmp_path_factory.mktemp("gateway")
        with running_gateway_on_the_tests_backing(log_dir) as gw:
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
def chat_route(request, gateway, fake) -> str:
    """Route `chat` over one host `gpu1` (the fake), loaded by the gateway; returns the route's
    URL. A test module shapes them with `CHAT_HOST` (more of `add_host`'s options: its models'
    limits, upstream names) and `CHAT_ROUTE` (more of `add_route`'s fields)."""
    host = add_host("gpu1", fake.url, **getattr(request.module, "CHAT_HOST", {}))
    add_route("chat", [host], **getattr(request.module, "CHAT_ROUTE", {}))
    gateway.sync()
    return f"{gateway.url}/chat"


@pytest.fixture
def page(monkeypatch) -> Iterator[object]:
    """A chromium tab of a common laptop's screen (tests/helpers/browser.py)."""
    with chromium(monkeypatch) as browser:
        tab = browser.new_page(viewport={"width": 1366, "height": 768})
        tab.set_default_timeout(15_000)
        yield tab


@pytest.fixture
def ledger(request, gateway):
    """Counts the test's requests to `gateway`; when the test passes, checks that the gateway
    holds no slot or queue place and wrote exactly one row per request
    (tests/helpers/invariants.py)."""
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
