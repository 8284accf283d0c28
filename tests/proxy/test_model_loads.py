"""Fleet model placement over real sockets: a request for a model loaded on no router-mode
host that loads none on demand waits while crossbar loads it on one (`POST /models/load`),
requests that follow join that load, a load that fails is answered with the host's words and
the next request tries another host, and a model nobody uses is unloaded after its idle time.
With CROSSBAR_TEST_SHARED=1 the gateway's one process holds the decider's lease in Redis."""

from __future__ import annotations

import re
import threading

import httpx
import pytest

from tests.fakes.llama_server import FakeLlamaServer
from tests.helpers.fleet import add_host, add_route
from tests.helpers.gateway import running_gateway
from tests.helpers.invariants import Ledger
from tests.helpers.observe import wait_for_health_poll
from tests.helpers.waits import wait_until

pytestmark = pytest.mark.django_db(transaction=True)

LOAD = "/models/load"
COMPLETIONS = "/v1/chat/completions"


def ask(ledger: Ledger, model: str, says: str = "hi") -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": says}], "max_tokens": 2}
    return ledger.client.post("/chat/v1/chat/completions", json=body)


def test_a_model_loaded_nowhere_is_loaded_once_and_the_request_served_after_the_load(
    gateway, ledger
):
    with FakeLlamaServer(router_models=("a", "b"), models_autoload=False) as router:
        add_route("chat", [add_host("gpu1", router.url, models={"a": (1, 4), "b": (1, 4)})])
        gateway.sync()
        wait_for_health_poll(router)
        answer = ask(ledger, "a")
        status = router.model_status("a")

    assert answer.status_code == 200
    assert answer.headers["x-crossbar-host"] == "gpu1"
    assert len(router.requests_to(LOAD)) == 1
    assert router.requests_to(LOAD)[0].json == {"model": "a"}
    assert status == "loaded"
    assert ledger.statuses() == [200]
    row = ledger.rows().get()
    assert (row.host, row.placement, row.code) == ("gpu1", "loaded", "")


def test_three_requests_for_a_model_loaded_nowhere_cause_one_load(gateway, ledger):
    with FakeLlamaServer(router_models=("a",), models_autoload=False, load_delay=1.0) as router:
        add_route("chat", [add_host("gpu1", router.url, models={"a": (4, 4)})])
        gateway.sync()
        wait_for_health_poll(router)
        answers: list[httpx.Response] = []
        threads = [
            threading.Thread(target=lambda n=n: answers.append(ask(ledger, "a", f"chat {n}")))
            for n in range(3)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    assert [a.status_code for a in answers] == [200, 200, 200]
    assert len(router.requests_to(LOAD)) == 1
    assert ledger.statuses() == [200, 200, 200]
    rows = ledger.rows()
    assert {row.placement for row in rows} == {"loaded"}
    assert min(row.queued_ms for row in rows) > 0  # the load's wait is in its queued time


def test_a_request_for_a_model_loaded_on_neither_of_two_routers_loads_it_on_one_only(
    gateway, ledger
):
    """The request waiting for the load still counts as waiting when the load ends: it is
    no line the first copy cannot serve, so no second copy is loaded for it."""
    first = FakeLlamaServer(router_models=("a",), models_autoload=False, load_delay=0.5)
    second = FakeLlamaServer(router_models=("a",), models_autoload=False, load_delay=0.5)
    with first, second:
        add_route("chat", [add_host("gpu1", first.url, models={"a": (1, 4)}),
                           add_host("gpu2", second.url, models={"a": (1, 4)})])  # fmt: skip
        gateway.sync()
        wait_for_health_poll(first)
        wait_for_health_poll(second)
        answer = ask(ledger, "a")
        wait_for_health_poll(first)  # a decision the load's end set off has been carried out
        wait_for_health_poll(second)
        loads = len(first.requests_to(LOAD)) + len(second.requests_to(LOAD))
        statuses = {first.model_status("a"), second.model_status("a")}

    assert answer.status_code == 200
    assert loads == 1
    assert statuses == {"loaded", "unloaded"}
    assert ledger.statuses() == [200]


def test_a_request_for_a_model_an_operator_is_loading_joins_that_load(gateway, ledger):
    with FakeLlamaServer(router_models=("a",), models_autoload=False, load_delay=1.0) as router:
        add_route("chat", [add_host("gpu1", router.url, models={"a": (1, 4)})])
        gateway.sync()
        assert httpx.post(f"{router.url}/models/load", json={"model": "a"}).status_code == 200
        wait_for_health_poll(router)
        answer = ask(ledger, "a")

    assert answer.status_code == 200
    assert len(router.requests_to(LOAD)) == 1  # the operator's: crossbar started none
    assert ledger.statuses() == [200]
    assert ledger.rows().get().placement == "loaded"


def test_a_failed_load_is_answered_with_the_hosts_word_and_the_next_request_tries_another_host(
    gateway, ledger
):
    failing = FakeLlamaServer(router_models=("a",), models_autoload=False,
                              failing_models=frozenset({"a"}))  # fmt: skip
    other = FakeLlamaServer(router_models=("a",), models_autoload=False)
    with failing, other:
        # gpu1 first: the decision's tie-break is the host's name.
        add_route("chat", [add_host("gpu1", failing.url, models={"a": (1, 4)}),
                           add_host("gpu2", other.url, models={"a": (1, 4)})])  # fmt: skip
        gateway.sync()
        wait_for_health_poll(failing)
        wait_for_health_poll(other)
        refused = ask(ledger, "a")
        served = ask(ledger, "a", "another")

    assert refused.status_code == 503
    error = refused.json()["error"]
    assert error["code"] == "model_not_loaded"
    assert "failed to load on gpu1" in error["message"]
    assert "its /models: failed" in error["message"]
    assert served.status_code == 200
    assert served.headers["x-crossbar-host"] == "gpu2"
    assert len(failing.requests_to(LOAD)) == 1
    assert len(other.requests_to(LOAD)) == 1
    assert failing.requests_to(COMPLETIONS) == []
    assert ledger.statuses() == [200, 503]
    row = ledger.rows().get(status=503)
    assert (row.host, row.code, row.placement) == ("gpu1", "model_not_loaded", "loaded")


def test_the_loads_show_in_the_metrics(gateway, ledger):
    with FakeLlamaServer(router_models=("m7",), models_autoload=False) as router:
        add_route("chat", [add_host("box7", router.url, models={"m7": (1, 4)})])
        gateway.sync()
        wait_for_health_poll(router)
        assert ask(ledger, "m7").status_code == 200
        wait_for_health_poll(router)
        text = httpx.get(f"{gateway.url}/metrics", timeout=5).text

    assert 'crossbar_model_loads_total{host="box7",model="m7",reason="demand"} 1.0' in text
    assert 'crossbar_model_loaded{host="box7",model="m7"} 1.0' in text
    counted = re.search(r"^crossbar_model_load_seconds_count (\S+)$", text, re.MULTILINE)
    assert counted is not None and float(counted.group(1)) >= 1  # the gateway's other tests too
    assert ledger.statuses() == [200]


def test_a_model_nobody_uses_is_unloaded_after_its_idle_time(tmp_path):
    with (
        FakeLlamaServer(router_models=("a",), models_autoload=False) as router,
        running_gateway(tmp_path, CROSSBAR_MODEL_IDLE_UNLOAD="1") as gateway,
    ):
        add_route("chat", [add_host("gpu1", router.url, models={"a": (1, 4)})])
        gateway.sync()
        wait_for_health_poll(router)
        body = {"model": "a", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        answer = httpx.post(f"{gateway.url}/chat/v1/chat/completions", json=body, timeout=30)
        assert answer.status_code == 200
        wait_until(lambda: router.model_status("a") == "unloaded", 20, what="a unloaded")
        log = gateway.log()

    assert len(router.requests_to("/models/unload")) == 1
    assert "model unload: host=gpu1 model=a reason=idle" in log
    assert "model load: host=gpu1 model=a reason=demand" in log


def test_a_stream_waiting_for_crossbars_load_of_its_model_hears_loading_then_running(
    gateway, ledger
):
    """A host and model of their own: the gateway's actor remembers the failed loads of
    this module's other tests."""
    with FakeLlamaServer(router_models=("m3",), models_autoload=False, load_delay=1.0) as router:
        add_route("chat", [add_host("box3", router.url, models={"m3": (1, 4)})],
                  wait_status=True)  # fmt: skip
        gateway.sync()
        wait_for_health_poll(router)
        body = {"model": "m3", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        with ledger.client.stream("POST", "/chat/v1/chat/completions", json=body) as response:
            lines = [line for line in response.iter_lines() if line]

    assert response.status_code == 200
    assert lines[:2] == [": crossbar-status: loading", ": crossbar-status: running"]
    assert lines[-1] == "data: [DONE]"
    assert len(router.requests_to(LOAD)) == 1
    assert ledger.statuses() == [200]
    row = ledger.rows().get()
    assert (row.host, row.placement, row.streamed) == ("box3", "loaded", True)
