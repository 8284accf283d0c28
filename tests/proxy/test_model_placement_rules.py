"""The operator's placement rules over real sockets, on router-mode hosts that load no model on
demand: min_loaded loads a model nobody asked for, max_loaded keeps a long line on the hosts
it has, the allowed hosts keep a model off the others, a host's swap budget refuses a load
more in the minute (the request is answered when its route's queue_timeout ends), and a model
loaded by hand stays loaded past its idle_unload. In-process state only, as the loads are.

Host names are this file's own: the session's gateway keeps each host's recent loads."""

from __future__ import annotations

import os
import threading

import httpx
import pytest

from hosts.actions import manage_models
from hosts.models import HostModel, PlacedModel
from tests.fakes.llama_server import FakeLlamaServer
from tests.helpers.fleet import add_host, add_route
from tests.helpers.invariants import Ledger
from tests.helpers.observe import wait_for_health_poll
from tests.helpers.waits import wait_until

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(
        os.environ.get("CROSSBAR_TEST_SHARED") == "1",
        reason="with CROSSBAR_REDIS_URL no process loads models yet (docs/operating.md)",
    ),
]

LOAD = "/models/load"


def ask(ledger: Ledger, model: str, says: str = "hi", tokens: int = 2) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": says}], "max_tokens": tokens}
    return ledger.client.post("/chat/v1/chat/completions", json=body)


def loads(router: FakeLlamaServer) -> list[object]:
    return [request.json for request in router.requests_to(LOAD)]


def test_min_loaded_loads_a_model_nobody_asked_for(gateway, ledger):
    with FakeLlamaServer(router_models=("ma", "mb"), models_autoload=False) as router:
        add_route("chat", [add_host("min1", router.url, models={"ma": (1, 4), "mb": (1, 4)})])
        PlacedModel.objects.create(name="ma", min_loaded=1)
        gateway.sync()
        wait_until(lambda: router.model_status("ma") == "loaded", 20, what="ma loaded")
        wait_for_health_poll(router)  # a decision after the load has been carried out
        others = router.model_status("mb")

    assert loads(router) == [{"model": "ma"}]
    assert others == "unloaded"
    assert "model load: host=min1 model=ma reason=min_loaded 1" in gateway.log()
    assert ledger.statuses() == []


def test_max_loaded_keeps_a_long_line_on_the_host_it_has(gateway, ledger):
    first = FakeLlamaServer(router_models=("xa",), models_autoload=False, token_delay=0.1)
    second = FakeLlamaServer(router_models=("xa",), models_autoload=False, token_delay=0.1)
    with first, second:
        add_route("chat", [add_host("max1", first.url, models={"xa": (1, 8)}),
                           add_host("max2", second.url, models={"xa": (1, 8)})])  # fmt: skip
        PlacedModel.objects.create(name="xa", max_loaded=1)
        gateway.sync()
        wait_for_health_poll(first)
        wait_for_health_poll(second)
        assert ask(ledger, "xa", "first").status_code == 200  # loaded on max1
        answers: list[httpx.Response] = []
        # Each arrival that finds a line sets off a decision: without max_loaded, a line
        # priced longer than a load takes max2 too.
        threads = [
            threading.Thread(target=lambda n=n: answers.append(ask(ledger, "xa", f"c{n}", 10)))
            for n in range(4)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        wait_for_health_poll(second)

    assert [a.status_code for a in answers] == [200] * 4
    assert {a.headers["x-crossbar-host"] for a in answers} == {"max1"}
    assert loads(first) == [{"model": "xa"}]
    assert loads(second) == []
    assert second.model_status("xa") == "unloaded"
    assert ledger.statuses() == [200] * 5


def test_a_model_is_loaded_only_on_its_allowed_hosts(gateway, ledger):
    first = FakeLlamaServer(router_models=("aa",), models_autoload=False)
    second = FakeLlamaServer(router_models=("aa",), models_autoload=False)
    with first, second:
        # al1 first: without the rule, the decision's tie-break (the name) would choose it.
        al1 = add_host("al1", first.url, models={"aa": (1, 4)})
        al2 = add_host("al2", second.url, models={"aa": (1, 4)})
        add_route("chat", [al1, al2])
        PlacedModel.objects.create(name="aa").hosts.set([al2])
        gateway.sync()
        wait_for_health_poll(first)
        wait_for_health_poll(second)
        answer = ask(ledger, "aa")

    assert answer.status_code == 200
    assert answer.headers["x-crossbar-host"] == "al2"
    assert loads(first) == []
    assert loads(second) == [{"model": "aa"}]
    assert ledger.statuses() == [200]
    assert ledger.rows().get().host == "al2"


def test_a_host_whose_swap_budget_is_spent_loads_nothing_more_and_the_request_is_answered(
    gateway, ledger
):
    with FakeLlamaServer(router_models=("sa", "sb"), models_autoload=False) as router:
        host = add_host("swap1", router.url, models={"sa": (1, 4), "sb": (1, 4)}, swap_budget=1)
        add_route("chat", [host], queue_timeout=2)
        gateway.sync()
        wait_for_health_poll(router)
        served = ask(ledger, "sa")
        refused = ask(ledger, "sb")
        status = router.model_status("sb")

    assert served.status_code == 200
    assert refused.status_code == 503
    error = refused.json()["error"]
    assert error["code"] == "queue_timeout"
    assert "model “sb” was not loaded within route chat's queue_timeout of 2 s" in error["message"]
    assert loads(router) == [{"model": "sa"}]
    assert status == "unloaded"
    log = gateway.log()
    assert "model unplaced: model=sb reason=no host: swap1 swap budget of 1 loads a minute" in log
    assert ledger.statuses() == [200, 503]
    row = ledger.rows().get(status=503)
    assert (row.code, row.placement) == ("queue_timeout", "loaded")


def test_a_model_loaded_by_hand_stays_loaded_past_its_idle_unload(gateway, ledger):
    with FakeLlamaServer(router_models=("pa", "pb"), models_autoload=False) as router:
        host = add_host("pin1", router.url, models={"pa": (1, 4), "pb": (1, 4)}, min_residency=0)
        add_route("chat", [host])
        for name in ("pa", "pb"):
            PlacedModel.objects.create(name=name, idle_unload=1)
        said = manage_models(host, "load")  # what the admin's action does: both pinned
        unpinned = HostModel.objects.get(host=host, name="pb")
        unpinned.pinned = False
        unpinned.save()
        gateway.sync()
        # pb is unloaded by a decision that found both idle past their idle_unload: the two
        # were seen loaded in the same read of the host.
        wait_until(lambda: router.model_status("pb") == "unloaded", 20, what="pb unloaded")
        wait_for_health_poll(router)
        kept = router.model_status("pa")

    assert said == [
        "pin1: load pa: done (pinned: kept loaded until unpinned)",
        "pin1: load pb: done (pinned: kept loaded until unpinned)",
    ]
    assert kept == "loaded"
    assert [r.json for r in router.requests_to("/models/unload")] == [{"model": "pb"}]
    assert "model unload: host=pin1 model=pb reason=idle" in gateway.log()
    assert ledger.statuses() == []
