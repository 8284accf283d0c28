"""Router-mode hosts started with `--no-models-autoload` answer 400 "model is not loaded" for a
model they hold unloaded: crossbar never sends them one. A request waits where its model is
loaded, as if such a host were not there, and a model loaded on no host that may serve it is
loaded by crossbar (tests/proxy/test_model_loads.py) or, where no process loads models (with
CROSSBAR_REDIS_URL), refused with `model_not_loaded`, never the host's 400."""

from __future__ import annotations

import threading

import httpx
import pytest

from tests.fakes.llama_server import FakeLlamaServer
from tests.helpers.fleet import add_host, add_route
from tests.helpers.invariants import Ledger
from tests.helpers.observe import gauge, wait_for_health_poll
from tests.helpers.waits import wait_until

pytestmark = pytest.mark.django_db(transaction=True)

COMPLETIONS = "/v1/chat/completions"


def ask(ledger: Ledger, model: str, says: str = "hi", **extra: object) -> httpx.Response:
    """A chat for `model`; each `says` is a conversation of its own."""
    body = {"model": model, "messages": [{"role": "user", "content": says}], **extra}
    return ledger.client.post("/chat/v1/chat/completions", json=body)


def test_a_request_waits_where_its_model_is_loaded_rather_than_go_where_it_is_not(gateway, ledger):
    holder = FakeLlamaServer(router_models=("a", "b"), models_autoload=False,
                             load_on_startup=("a",))  # fmt: skip
    other = FakeLlamaServer(router_models=("a", "b"), models_autoload=False,
                            load_on_startup=("b",))  # fmt: skip
    with holder, other:
        models = {"a": (1, 4), "b": (1, 4)}
        # The host without "a" first in the route: only its model state keeps requests away.
        add_route("chat", [add_host("gpu2", other.url, models=models),
                           add_host("gpu1", holder.url, models=models)])  # fmt: skip
        gateway.sync()
        wait_until(lambda: holder.model_status("a") == "loaded", what="a loaded on gpu1")
        wait_for_health_poll(holder)
        wait_for_health_poll(other)
        holder.token_delay = 0.3  # the first request holds gpu1's only slot for a while
        first: list[httpx.Response] = []
        running = threading.Thread(target=lambda: first.append(ask(ledger, "a", max_tokens=5)))
        running.start()
        wait_until(lambda: holder.in_flight == 1, what="a request running on gpu1")
        # Another conversation: gpu1 is full, gpu2 has a free slot and "a" unloaded.
        second = ask(ledger, "a", "hello", max_tokens=2)
        running.join()

    assert [first[0].status_code, second.status_code] == [200, 200]
    assert first[0].headers["x-crossbar-host"] == "gpu1"
    assert second.headers["x-crossbar-host"] == "gpu1"
    assert other.requests_to(COMPLETIONS) == []
    assert other.model_status("a") == "unloaded"
    assert ledger.statuses() == [200, 200]
    waited = ledger.rows().get(queued_ms__gt=0)
    assert (waited.host, waited.code) == ("gpu1", "")


def test_a_conversation_whose_home_is_full_never_spills_to_a_host_without_its_model_loaded(
    gateway, ledger
):
    holder = FakeLlamaServer(router_models=("a",), models_autoload=False, load_on_startup=("a",))
    other = FakeLlamaServer(router_models=("a",), models_autoload=False)
    with holder, other:
        add_route(
            "chat",
            [add_host("gpu1", holder.url, models={"a": (1, 4)}),
             add_host("gpu2", other.url, models={"a": (1, 4)})],
            lease_patience=0.2,  # then any free slot of the route may take a waiting turn
        )  # fmt: skip
        gateway.sync()
        wait_until(lambda: holder.model_status("a") == "loaded", what="a loaded on gpu1")
        wait_for_health_poll(holder)
        wait_for_health_poll(other)
        assert ask(ledger, "a").headers["x-crossbar-host"] == "gpu1"  # the conversation's home
        holder.token_delay = 0.2  # 2 s: its next turn waits past its patience
        first: list[httpx.Response] = []
        running = threading.Thread(target=lambda: first.append(ask(ledger, "a", max_tokens=10)))
        running.start()
        wait_until(lambda: holder.in_flight == 1, what="a request running on gpu1")
        again = ask(ledger, "a", max_tokens=2)  # the same conversation: gpu1 is its home
        running.join()

    assert (first[0].status_code, again.status_code) == (200, 200)
    assert again.headers["x-crossbar-host"] == "gpu1"
    assert other.requests_to(COMPLETIONS) == []
    assert ledger.statuses() == [200, 200, 200]


def test_a_request_waiting_in_line_takes_a_slot_of_a_host_as_soon_as_its_model_is_loaded_there(
    gateway, ledger
):
    holder = FakeLlamaServer(router_models=("a",), models_autoload=False, load_on_startup=("a",))
    other = FakeLlamaServer(router_models=("a",), models_autoload=False)
    with holder, other:
        add_route(
            "chat",
            [add_host("gpu1", holder.url, models={"a": (1, 4)}),
             add_host("gpu2", other.url, models={"a": (1, 4)})],
            lease_patience=0.2,
        )  # fmt: skip
        gateway.sync()
        wait_until(lambda: holder.model_status("a") == "loaded", what="a loaded on gpu1")
        wait_for_health_poll(holder)
        wait_for_health_poll(other)
        holder.token_delay = 1.0  # 30 s: gpu1 stays full through the load below
        first: list[httpx.Response] = []
        running = threading.Thread(  # streamed: its head comes at once, however long it runs
            target=lambda: first.append(ask(ledger, "a", max_tokens=30, stream=True))
        )
        running.start()
        wait_until(lambda: holder.in_flight == 1, what="a request running on gpu1")
        waiting: list[httpx.Response] = []
        second = threading.Thread(target=lambda: waiting.append(ask(ledger, "a", "two")))
        second.start()
        wait_until(lambda: gauge(gateway.url, "crossbar_queued", host="gpu1", model="a") == 1,
                   what="the second request in gpu1's line")  # fmt: skip
        # An operator loads "a" on gpu2 (the admin's action posts the same).
        assert httpx.post(f"{other.url}/models/load", json={"model": "a"}).status_code == 200
        second.join(timeout=20)  # served by gpu2; else it waits for gpu1's slot, long after
        holder.token_delay = 0.0  # the rest of the first at once: it has done its part
        running.join()
        second.join()

    assert waiting[0].status_code == 200
    assert waiting[0].headers["x-crossbar-host"] == "gpu2"
    assert first[0].status_code == 200
    assert ledger.statuses() == [200, 200]


@pytest.mark.parametrize(
    ("setting", "served"), [("", 200), ("yes", 200), ("no", 503)], ids=["unknown", "yes", "no"]
)
def test_a_host_that_does_not_say_whether_it_loads_on_demand_is_taken_at_the_operators_word(
    gateway, ledger, setting, served
):
    # A plain server (no router) lists only its own model: "a" is not loaded there.
    with FakeLlamaServer(models=("own",)) as host:
        add_route("chat", [add_host("gpu1", host.url, models={"a": (1, 4)},
                                    loads_on_demand=setting)])  # fmt: skip
        gateway.sync()
        wait_for_health_poll(host)
        answer = ask(ledger, "a")

    assert answer.status_code == served
    if served == 503:
        assert answer.json()["error"]["code"] == "model_not_loaded"
        assert host.requests_to(COMPLETIONS) == []
    assert ledger.statuses() == [served]


def test_what_a_router_says_of_its_autoload_wins_over_the_operators_setting(gateway, ledger):
    """The operator says gpu1 loads on demand; its /props says it does not. Taken at the
    operator's word the request would go to the router, which has nothing loaded; taken at the
    router's, crossbar loads the model there first."""
    with FakeLlamaServer(router_models=("a",), models_autoload=False) as router:
        add_route("chat", [add_host("gpu1", router.url, models={"a": (1, 4)},
                                    loads_on_demand="yes")])  # fmt: skip
        gateway.sync()
        wait_for_health_poll(router)
        served = ask(ledger, "a")

    assert served.status_code == 200
    assert [seen.json for seen in router.requests_to("/models/load")] == [{"model": "a"}]
    assert ledger.statuses() == [200]
    assert ledger.rows().get().placement == "loaded"
