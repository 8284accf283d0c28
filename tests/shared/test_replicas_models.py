"""Fleet model placement with two gateway processes sharing one Redis: one decides at a time
(the lease `models:decider`), the other sends it its requests' demand and serves them once its
own reading of the hosts shows the model loaded.

Each test starts its own redis-server and two gateways as `make run` serves them, in front of
two fake router-mode hosts that load no model on demand.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

import httpx
import pytest

from tests.fakes.llama_server import FakeLlamaServer
from tests.helpers.fleet import add_host, add_route
from tests.helpers.gateway import Gateway, two_gateways
from tests.helpers.observe import wait_for_health_poll
from tests.helpers.waits import wait_until

pytestmark = pytest.mark.django_db(transaction=True)

CHAT = "/chat/v1/chat/completions"
LOAD = "/models/load"
DECIDES = "model placement: this process decides"


def ask(gateway: Gateway, model: str, says: str = "hi") -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": says}], "max_tokens": 2}
    return httpx.post(gateway.url + CHAT, json=body, timeout=60)


@contextlib.contextmanager
def two_routers(
    load_delay: float, failing: frozenset[str] = frozenset()
) -> Iterator[tuple[FakeLlamaServer, FakeLlamaServer]]:
    """Two routers listing models a and b, loading none on demand (and failing the loads of
    `failing`), behind route `chat`."""
    first, second = (
        FakeLlamaServer(router_models=("a", "b"), models_autoload=False, load_delay=load_delay,
                        failing_models=failing)
        for _ in range(2)
    )  # fmt: skip
    with first, second:
        models = {"a": (4, 4), "b": (4, 4)}
        add_route("chat", [add_host("gpu1", first.url, models=models),
                           add_host("gpu2", second.url, models=models)])  # fmt: skip
        yield first, second


def loads(*routers: FakeLlamaServer) -> list[str]:
    """The models the routers were asked to load, in all."""
    bodies = [seen.json for router in routers for seen in router.requests_to(LOAD)]
    return [body["model"] for body in bodies if isinstance(body, dict)]


def decider_and_follower(first: Gateway, second: Gateway) -> tuple[Gateway, Gateway]:
    """The gateway that holds the lease (its log says so), and the other."""
    deciding = wait_until(
        lambda: [g for g in (first, second) if DECIDES in g.log()],
        timeout=30,
        what="one gateway to take the model decider's lease",
    )
    assert len(deciding) == 1, "two processes decide at once"
    decider = deciding[0]
    return decider, second if decider is first else first


def test_requests_to_both_processes_for_a_model_loaded_nowhere_cause_one_load(tmp_path, redis_url):
    with (
        two_routers(load_delay=1.0) as routers,
        two_gateways(tmp_path, redis_url) as gateways,
    ):
        for router in routers:
            wait_for_health_poll(router)
        decider_and_follower(*gateways)
        answers: list[httpx.Response] = []
        threads = [
            threading.Thread(target=lambda g=g, n=n: answers.append(ask(g, "a", f"chat {n}")))
            for n, g in enumerate(gateways * 2)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for router in routers:
            wait_for_health_poll(router)  # a decision the load's end set off is carried out

    assert [a.status_code for a in answers] == [200] * 4
    assert {a.headers["x-crossbar-placement"] for a in answers} == {"loaded"}
    assert loads(*routers) == ["a"]
    assert sorted(r.model_status("a") for r in routers) == ["loaded", "unloaded"]


def test_a_request_to_the_follower_is_served_after_the_deciders_load(tmp_path, redis_url):
    with (
        two_routers(load_delay=0.5) as routers,
        two_gateways(tmp_path, redis_url) as gateways,
    ):
        for router in routers:
            wait_for_health_poll(router)
        decider, follower = decider_and_follower(*gateways)
        answer = ask(follower, "a")

    assert answer.status_code == 200
    assert answer.headers["x-crossbar-placement"] == "loaded"
    assert loads(*routers) == ["a"]
    assert "model load: host=" in decider.log()
    assert "model load: host=" not in follower.log()


def test_the_decider_killed_the_other_process_takes_the_lease_and_loads_for_a_new_request(
    tmp_path, redis_url
):
    with (
        two_routers(load_delay=0.2) as routers,
        two_gateways(tmp_path, redis_url, CROSSBAR_MODEL_IDLE_UNLOAD="0") as gateways,
    ):
        for router in routers:
            wait_for_health_poll(router)
        decider, survivor = decider_and_follower(*gateways)
        before = ask(decider, "a")
        decider.process.send_signal(signal.SIGKILL)
        decider.process.wait(timeout=10)
        wait_until(
            lambda: DECIDES in survivor.log(),
            timeout=30,
            what="the survivor to take the lease over",
        )
        after = ask(survivor, "b")

    assert before.status_code == 200
    assert after.status_code == 200
    assert after.headers["x-crossbar-placement"] == "loaded"
    assert sorted(loads(*routers)) == ["a", "b"]
    assert "model load: host=" in survivor.log()


def test_a_load_that_fails_on_the_decider_answers_the_followers_request_with_the_hosts_words(
    tmp_path, redis_url
):
    with (
        two_routers(load_delay=0.2, failing=frozenset({"a"})) as routers,
        two_gateways(tmp_path, redis_url) as gateways,
    ):
        for router in routers:
            wait_for_health_poll(router)
        _, follower = decider_and_follower(*gateways)
        refused = ask(follower, "a")

    assert refused.status_code == 503
    error = refused.json()["error"]
    assert error["code"] == "model_not_loaded"
    assert "its /models: failed" in error["message"]
    assert loads(*routers) == ["a"]
