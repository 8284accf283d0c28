"""Every refusal says what, where and what to do, and is counted where it happens.

Through the real gateway and fake llama-servers: the answer (status, the OpenAI-shaped body
with its stable `code` and its facts, `Retry-After` only where waiting helps), the row, the
metrics, and the dashboard's host cards and running table as a signed-in operator's socket
receives them. `CROSSBAR_TEST_SHARED=1` runs the same tests on the Redis-shared state.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import pytest
from django.core.management import call_command

from accounting.models import Request
from tests.helpers.fleet import MODEL, add_host, add_route, chat
from tests.helpers.gateway import Gateway
from tests.helpers.machine import free_port
from tests.helpers.observe import (
    dashboard,
    series,
    state_where,
    wait_for_gauge,
    wait_for_host_state,
)
from tests.helpers.waits import wait_until

pytestmark = pytest.mark.django_db(transaction=True)

CHAT = "/chat/v1/chat/completions"


def row_of(ledger, **match: object) -> Request:
    """The one row of this test matching `match`, once the recorder has written it."""
    rows = ledger.rows().filter(**match)
    wait_until(lambda: rows.count() >= 1, what=f"a row with {match}")
    (row,) = rows
    return row


@contextmanager
def held(gateway: Gateway, ledger, fakes, count: int) -> Iterator[list[Future]]:
    """`count` slow streams sent at once (each a conversation of its own), held until the
    block ends; then the fakes answer at full speed and every stream is read to its end."""
    for fake in fakes:
        # 60 s per stream until the block ends: a loaded machine's setup (the gauges, the
        # dashboard) must not outlast them, or the refusal the test waits for never comes.
        fake.token_delay = 0.1

    def slow(i: int) -> int:
        body = chat(f"conversation {i}", stream=True, max_tokens=600)
        url = f"{gateway.url}{CHAT}"
        return httpx.post(url, json=body, timeout=120).status_code

    ledger.sent(count)
    with ThreadPoolExecutor(count) as pool:
        futures = [pool.submit(slow, i) for i in range(count)]
        try:
            yield futures
        finally:
            for fake in fakes:
                fake.token_delay = 0
            assert [f.result() for f in futures] == [200] * count


def counters(gateway: Gateway, name: str) -> dict[str, float]:
    return series(gateway.url, (name,))


def grew(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """The series that moved from `before` to `after`, by how much."""
    return {key: n - before.get(key, 0.0) for key, n in after.items() if n != before.get(key, 0.0)}


def key(name: str, **labels: str) -> str:
    """A series as `tests.helpers.observe.series` names it."""
    return f"{name}{sorted(labels.items())}"


# -- queue_full ---------------------------------------------------------------------------------


def test_a_full_route_refuses_naming_each_full_host_and_counts_the_refusal_on_the_route(
    gateway, fake, fake2, admin_user, ledger
):
    hosts = {"gpu1": fake, "gpu2": fake2}
    add_route("chat", [add_host(name, f.url, models={MODEL: (1, 1)}) for name, f in hosts.items()])
    gateway.sync()
    refusals_before = counters(gateway, "crossbar_refusals_total")
    requests_before = counters(gateway, "crossbar_requests_total")

    with held(gateway, ledger, hosts.values(), 4), dashboard(gateway) as socket:
        wait_until(lambda: fake.in_flight == fake2.in_flight == 1, what="a stream on each host")
        for name in hosts:
            wait_for_gauge(gateway.url, "crossbar_queued", 1, host=name, model=MODEL)
        before = state_where(socket, lambda m: len(m["running"]) == 4)
        running = before["running"]
        # The session's gateway keeps 5 minutes of each host's figures: an earlier test's
        # refusals on hosts of these names may be among them.
        earlier = {h: before["cards"].get(h, {}) for h in hosts}
        route_before = before["route_refusals"].get("chat", {}).get("refused", 0)
        refused = ledger.client.post(CHAT, json=chat("one too many"))
        assert refused.status_code == 503, refused.text
        after = state_where(
            socket,
            lambda m: all(
                m["cards"].get(h, {}).get("refused", 0) == earlier[h].get("refused", 0) + 1
                for h in hosts
            ),
        )
        cards = after["cards"]

    error = refused.json()["error"]
    assert refused.status_code == 503 and error["code"] == "queue_full"
    assert refused.headers["retry-after"] == "1"
    assert (error["route"], error["model"]) == ("chat", MODEL)
    counts = {
        h["name"]: (h["state"], h["running"], h["parallel"], h["queued"], h["queue_max"])
        for h in error["hosts"]
    }
    assert counts == {"gpu1": ("full", 1, 1, 1, 1), "gpu2": ("full", 1, 1, 1, 1)}
    for name in hosts:
        assert f"{name} full (1/1 running, 1/1 queued)" in error["message"]
    assert "route “chat”" in error["message"] and f"model “{MODEL}”" in error["message"]
    assert "parallel" in error["message"] and "queue_max" in error["message"]  # what to do
    # "Running now": each queued request names the host whose line it is in, and its place.
    waiting = sorted((r["line"], r["place"]) for r in running if not r["host"])
    assert waiting == [("gpu1", 1), ("gpu2", 1)]
    # Counted where it happened: the refusal is the route's, so its row names no host and
    # lists the full ones; no host's card counts it among its errors, the route's line does;
    # each full host's card and metric say it was full; one request in the request counter,
    # with no host.
    row = row_of(ledger, code="queue_full")
    assert (row.status, row.route, row.model, row.host) == (503, "chat", MODEL, "")
    assert set(row.refused_by.split()) == set(hosts)
    assert row.error == error["message"]
    for name in hosts:
        assert cards[name]["codes"] == earlier[name].get("codes", {})
        assert cards[name]["outcomes"]["5xx"] == earlier[name].get("outcomes", {}).get("5xx", 0)
    assert after["route_refusals"]["chat"]["refused"] == route_before + 1
    refusals = grew(refusals_before, counters(gateway, "crossbar_refusals_total"))
    assert refusals == {
        key("crossbar_refusals_total", route="chat", host=name, model=MODEL, code="queue_full"): 1
        for name in hosts
    }
    queue_full = {
        key: n
        for key, n in grew(requests_before, counters(gateway, "crossbar_requests_total")).items()
        if "'queue_full'" in key
    }
    assert queue_full == {
        key(
            "crossbar_requests_total",
            route="chat",
            host="",
            model=MODEL,
            status="503",
            code="queue_full",
        ): 1
    }
    # requests_report --by host: the refusal under no host, none of the full hosts' 5xx.
    wait_until(lambda: ledger.rows().count() == 5, what="the rows of the five requests")
    report = json.loads(call_command("requests_report", "--by", "host", "--format", "json"))
    by_host = {entry["host"]: entry for entry in report}
    assert by_host[""]["5xx"] >= 1 and all(by_host[name]["5xx"] == 0 for name in hosts)


# -- no_healthy_host and pinned_host_down -------------------------------------------------------


def test_draining_the_only_host_says_it_drains_and_how_to_serve_again_without_retry_after(
    gateway, fake, ledger
):
    add_route("chat", [add_host("gpu1", fake.url, draining=True)])
    gateway.sync()
    wait_for_host_state(gateway.url, "gpu1", "up")

    refused = ledger.client.post(CHAT, json=chat())

    error = refused.json()["error"]
    assert refused.status_code == 503 and error["code"] == "no_healthy_host"
    assert "retry-after" not in refused.headers  # waiting alone does not end a drain
    assert "gpu1 draining (health up" in error["message"]
    assert "Stop draining" in error["message"]
    assert [(h["name"], h["state"], h["health"]) for h in error["hosts"]] == [
        ("gpu1", "draining", "up")
    ]
    row = row_of(ledger, code="no_healthy_host")
    assert (row.status, row.route, row.error) == (503, "chat", error["message"])


def test_a_host_that_refuses_connections_is_named_with_since_when_and_why_in_plain_words(
    gateway, fake, ledger
):
    nothing_listens = f"http://127.0.0.1:{free_port()}"
    add_route("chat", [add_host("gpu1", fake.url), add_host("gpu2", nothing_listens)])
    gateway.sync()
    wait_for_host_state(gateway.url, "gpu2", "down")
    fake.health = "error"
    wait_for_host_state(gateway.url, "gpu1", "down")

    refused = ledger.client.post(CHAT, json=chat())

    error = refused.json()["error"]
    assert refused.status_code == 503 and error["code"] == "no_healthy_host"
    assert refused.headers["retry-after"] == "2"
    gpu1, gpu2 = error["hosts"]
    assert (gpu1["state"], gpu1["reason"]) == ("down", "/health answered 500")
    assert gpu2["state"] == "down"
    assert gpu2["reason"].startswith("/health: connection refused")
    assert "ssl:default" not in error["message"] and "Cannot connect" not in error["message"]
    assert "gpu2 down since " in error["message"]
    assert " UTC (/health: connection refused" in error["message"]
    assert gpu2["since"].endswith("+00:00")


def test_a_strict_routes_conversation_whose_host_is_down_says_which_and_what_to_do(
    gateway, fake, fake2, ledger
):
    add_route("chat", [add_host("gpu1", fake.url), add_host("gpu2", fake2.url)], sticky="strict")
    gateway.sync()
    first = ledger.client.post(CHAT, json=chat("pinned"))
    home = first.headers["x-crossbar-host"]
    {"gpu1": fake, "gpu2": fake2}[home].health = "error"
    wait_for_host_state(gateway.url, home, "down")

    again = ledger.client.post(CHAT, json=chat("pinned"))

    error = again.json()["error"]
    assert again.status_code == 503 and error["code"] == "pinned_host_down"
    assert again.headers["retry-after"] == "2"
    assert f"{home} down since" in error["message"] and "X-Crossbar-Session" in error["message"]
    assert [h["name"] for h in error["hosts"]] == [home]


# -- model_not_found and unknown_route ----------------------------------------------------------


def test_an_unknown_model_is_answered_with_the_models_the_route_serves(gateway, fake, ledger):
    add_route(
        "chat",
        [add_host("gpu1", fake.url, models={MODEL: (4, 4), "qwen": (2, 2)})],
    )
    gateway.sync()

    refused = ledger.client.post(CHAT, json={**chat(), "model": "gpt-5"})

    error = refused.json()["error"]
    assert refused.status_code == 404 and error["code"] == "model_not_found"
    assert error["models"] == ["qwen", MODEL] and error["param"] == "model"
    assert f"it serves qwen, {MODEL}" in error["message"]
    assert "retry-after" not in refused.headers
    row = row_of(ledger, code="model_not_found")
    assert (row.route, row.model, row.status) == ("chat", "gpt-5", 404)


def test_an_api_request_to_an_unknown_route_gets_a_row_and_a_metric_and_a_stray_path_none(
    gateway, fake, ledger
):
    add_route("chat", [add_host("gpu1", fake.url)])
    gateway.sync()
    before = counters(gateway, "crossbar_requests_total")

    refused = ledger.client.post("/no-such-route/v1/chat/completions", json=chat())
    stray = httpx.get(f"{gateway.url}/no-such-route/robots.txt")  # not an API path: no row

    error = refused.json()["error"]
    assert refused.status_code == 404 and error["code"] == "unknown_route"
    assert "“no-such-route”" in error["message"] and "/<route>/v1/" in error["message"]
    assert stray.status_code == 404
    row = row_of(ledger, code="unknown_route")
    assert (row.route, row.status, row.host) == ("no-such-route", 404, "")
    counted = grew(before, counters(gateway, "crossbar_requests_total"))
    # The route label stays empty: the name is the client's, and labels stay bounded.
    labels = {"route": "", "host": "", "model": "", "status": "404", "code": "unknown_route"}
    assert counted == {key("crossbar_requests_total", **labels): 1}


# -- GET / ----------------------------------------------------------------------------------------


def test_the_gateways_address_points_a_person_to_the_dashboard_and_admin_without_a_row(
    gateway, ledger
):
    page = httpx.get(f"{gateway.url}/")
    posted = ledger.client.post("/", json=chat())  # a client's request still gets JSON

    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert 'href="/dashboard/"' in page.text and 'href="/admin/"' in page.text
    assert "/&lt;route&gt;/v1/" in page.text
    assert posted.status_code == 400 and posted.json()["error"]["code"] == "missing_route"
    assert row_of(ledger, code="missing_route").status == 400  # the POST's; the page has none
