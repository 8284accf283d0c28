"""Router-mode hosts (llama-server loading models on demand): placement never unloads a busy
model when another host could take the load, and a waiting stream hears that its model loads."""

from __future__ import annotations

import threading

import httpx
import pytest

from tests.fakes.llama_server import FakeLlamaServer
from tests.helpers.fleet import add_host, add_route
from tests.helpers.observe import wait_for_gauge, wait_for_health_poll
from tests.helpers.waits import wait_until

pytestmark = pytest.mark.django_db(transaction=True)

MODELS = {"small": (1, 4), "large": (1, 4), "other": (1, 4)}


def ask(url: str, model: str, **extra: object) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": f"hi {model}"}], **extra}
    return httpx.post(f"{url}/chat/v1/chat/completions", json=body, timeout=60)


def test_a_model_to_load_goes_where_loading_it_unloads_nothing_busy(gateway):
    busy = FakeLlamaServer(router_models=tuple(MODELS), models_max=1)
    idle = FakeLlamaServer(router_models=tuple(MODELS), models_max=1)
    with busy, idle:
        hosts = [
            # gpu1 is the bigger box: only a busy model keeps new loads away from it.
            add_host("gpu1", busy.url, models=MODELS, weight=3),
            add_host("gpu2", idle.url, models=MODELS),
        ]
        add_route("chat", hosts, lease_ttl=2)  # conversations soon forgotten: only work is busy
        gateway.sync()
        # Both routers polled: one polled (nothing loaded) against one not yet (assumed
        # loaded) would rank by that, not by weight.
        wait_for_health_poll(busy)
        wait_for_health_poll(idle)
        assert ask(gateway.url, "other").headers["x-crossbar-host"] == "gpu1"
        wait_for_health_poll(busy)  # which tells the gateway "other" is loaded
        # "other" has a live conversation on gpu1: loading "small" there would unload it.
        assert ask(gateway.url, "small").headers["x-crossbar-host"] == "gpu2"
        # Now "other" is loaded on gpu1 and "small" on gpu2. Keep "other" busy on gpu1:
        busy.token_delay = 1.0  # 30 s: busy through the waits below, on a loaded machine too
        holding = threading.Thread(
            target=ask, args=(gateway.url, "other"), kwargs={"max_tokens": 30, "stream": True}
        )
        holding.start()
        wait_until(lambda: busy.in_flight == 1, what="a request running on gpu1")
        # The leases of "small" expire (their TTL is 2 s), and a health poll tells the gateway
        # that "small" is loaded on gpu2.
        wait_for_gauge(gateway.url, "crossbar_leases_held", 0, host="gpu2")
        wait_for_health_poll(idle)

        placed = ask(gateway.url, "large")
        busy.token_delay = 0.0  # the rest of the holding stream at once: it has done its part
        holding.join()

    # gpu1 weighs more, but loading there would unload "other", which is busy; on gpu2 it
    # unloads "small", which nothing uses any more.
    assert placed.status_code == 200
    assert placed.headers["x-crossbar-host"] == "gpu2"
    assert busy.model_status("other") == "loaded"


def test_a_waiting_stream_hears_that_its_model_is_loading(gateway):
    with FakeLlamaServer(router_models=("large",), models_max=1, load_delay=3) as router:
        add_route("chat", [add_host("gpu1", router.url, models={"large": (1, 4)})],
                  wait_status=True)  # fmt: skip
        gateway.sync()
        first = threading.Thread(target=ask, args=(gateway.url, "large"))
        first.start()  # it holds the only slot while the router loads the model
        wait_until(lambda: router.model_status("large") == "loading", what="the load to start")
        wait_for_health_poll(router)  # the gateway sees the model loading

        lines: list[str] = []
        body = {"model": "large", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        with httpx.stream(
            "POST", f"{gateway.url}/chat/v1/chat/completions", json=body, timeout=60
        ) as response:
            lines = [line for line in response.iter_lines() if line]
        first.join()

    assert lines[0] == ": crossbar-status: waiting 1"
    assert ": crossbar-status: loading" in lines
    assert lines.index(": crossbar-status: loading") < lines.index(": crossbar-status: running")
    assert lines[-1] == "data: [DONE]"
