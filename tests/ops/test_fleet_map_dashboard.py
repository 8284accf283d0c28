"""The dashboard's fleet map and decision log over real sockets: a signed-in operator sees where
the model actor loaded a model and why, the last decisions newest first, a model's name as
text whatever it holds, and one line when no actor places models."""

from __future__ import annotations

import os
from urllib.parse import urlsplit

import httpx
import pytest

from tests.fakes.llama_server import FakeLlamaServer
from tests.helpers.browser import NEEDS_CHROMIUM
from tests.helpers.fleet import add_host, add_route
from tests.helpers.gateway import signed_in
from tests.helpers.invariants import Ledger
from tests.helpers.observe import dashboard, state_where, wait_for_health_poll

pytestmark = [pytest.mark.django_db(transaction=True)]

ACTOR_IN_PROCESS = pytest.mark.skipif(
    os.environ.get("CROSSBAR_TEST_SHARED") == "1",
    reason="with CROSSBAR_REDIS_URL no process loads models yet (docs/operating.md)",
)
SCRIPT = "<script>window.ran = 1</script>"


def ask(ledger: Ledger, model: str) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    return ledger.client.post("/chat/v1/chat/completions", json=body)


def has_hosts(model: str):
    def wanted(message: dict) -> bool:
        rows = [r for r in message["models"]["map"] if r["model"] == model]
        return bool(rows and rows[0]["hosts"] and rows[0]["hosts"][0]["status"] == "loaded")

    return wanted


@ACTOR_IN_PROCESS
def test_after_a_request_loads_a_model_the_map_shows_it_there_for_demand_and_the_log_says_so(
    gateway, ledger, admin_user
):
    with FakeLlamaServer(router_models=("a", "b"), models_autoload=False) as router:
        add_route("chat", [add_host("fleet1", router.url, models={"a": (1, 4), "b": (1, 4)})])
        gateway.sync()
        wait_for_health_poll(router)
        with dashboard(gateway) as socket:
            before = state_where(socket, lambda m: len(m["models"]["map"]) == 2)
            answer = ask(ledger, "a")
            after = state_where(socket, has_hosts("a"))

    assert answer.status_code == 200
    assert before["models"]["note"] == ""
    assert [(r["model"], r["hosts"]) for r in before["models"]["map"]] == [("a", []), ("b", [])]
    a, b = after["models"]["map"]
    [placed] = a["hosts"]
    assert (placed["host"], placed["status"], placed["why"]) == ("fleet1", "loaded", "demand")
    assert placed["reason"].startswith("demand: 1 waiting")
    assert placed["since"] and placed["idle_since"]
    assert b["hosts"] == []
    log = after["models"]["log"]
    assert [(e["kind"], e["host"], e["model"]) for e in log[:2]] == [
        ("loaded", "fleet1", "a"),
        ("load", "fleet1", "a"),
    ]
    assert log[1]["reason"].startswith("demand")
    assert log[0]["at"] >= log[1]["at"]


def test_a_fleet_without_a_router_host_that_loads_on_request_says_no_model_is_placed(
    gateway, admin_user, fake
):
    add_route("chat", [add_host("gpu1", fake.url)])
    gateway.sync()
    wait_for_health_poll(fake)
    with dashboard(gateway) as socket:
        message = state_where(socket, lambda m: "models" in m)

    assert message["models"]["map"] == []
    assert message["models"]["note"].startswith("No model placement:")


@NEEDS_CHROMIUM
@ACTOR_IN_PROCESS
def test_the_page_shows_the_fleet_map_and_the_log_with_a_models_name_as_text(
    gateway, ledger, admin_user, page
):
    from playwright.sync_api import expect

    with FakeLlamaServer(router_models=("a", "b"), models_autoload=False) as router:
        models = {"a": (1, 4), SCRIPT: (1, 4)}
        host = add_host("fleet2", router.url, models=models, upstream_names={SCRIPT: "b"})
        add_route("chat", [host])
        gateway.sync()
        wait_for_health_poll(router)
        assert ask(ledger, SCRIPT).status_code == 200
        session = signed_in(gateway).cookies["sessionid"]
        where = urlsplit(gateway.url).hostname
        page.context.add_cookies([{"name": "sessionid", "value": session, "domain": where,
                                   "path": "/"}])  # fmt: skip
        page.goto(f"{gateway.url}/dashboard/")
        placed = page.locator("#fleet-map tbody tr", has_text="fleet2")
        expect(placed).to_contain_text(SCRIPT)
        expect(placed).to_contain_text("demand")
        nowhere = page.locator("#fleet-map tbody tr", has_text="loaded nowhere")
        expect(nowhere).to_contain_text("a")
        expect(page.locator("#model-log tbody tr").first).to_contain_text(SCRIPT)
        ran = page.evaluate("window.ran")

    assert ran is None
