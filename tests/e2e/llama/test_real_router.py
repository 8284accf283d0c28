"""The gateway in front of real llama-servers in router mode started with
`--no-models-autoload`: such a host answers 400 "model is not loaded" for a model it lists but
has not loaded, so a request for a model loaded on one host only waits for that host when it
is full, and never reaches the other; a model loaded on neither is loaded by crossbar on one
(with shared state, by the process holding the decider's lease).
Skips when no llama-server binary is found."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.llama.locate import NOT_BUILT, binary_expected
from tests.e2e.llama.server import LlamaServer, running_router
from tests.helpers.fleet import add_host, add_route
from tests.helpers.invariants import Ledger
from tests.helpers.observe import gauge, wait_for_gauge, wait_for_host_state
from tests.helpers.waits import wait_until

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(not binary_expected(), reason=NOT_BUILT),
]

MODELS = ("a", "b", "c")  # the tiny model under three names: three models to a router


@pytest.fixture
def routers(llama_binary: Path, tiny_model: Path, tmp_path: Path) -> Iterator[list[LlamaServer]]:
    """Two routers over one `--models-dir` (the tiny model hard-linked as a, b and c), room
    for two models each, loading none on demand."""
    models_dir = tmp_path / "models"
    models_dir.mkdir()
    for name in MODELS:
        os.link(tiny_model, models_dir / f"{name}.gguf")
    extra = ("--models-max", "2", "--no-models-autoload")
    with (
        running_router(llama_binary, models_dir, tmp_path, extra) as first,
        running_router(llama_binary, models_dir, tmp_path, extra) as second,
    ):
        yield [first, second]


def status_of(router: LlamaServer, model: str) -> str:
    """The status the router's `/v1/models` gives `model`."""
    listed = httpx.get(f"{router.url}/v1/models", timeout=5).json()["data"]
    return next(entry["status"]["value"] for entry in listed if entry["id"] == model)


def load(router: LlamaServer, model: str) -> None:
    """Load `model` on `router` through its own endpoint and wait until it says loaded."""
    assert httpx.post(f"{router.url}/models/load", json={"model": model}).status_code == 200
    wait_until(lambda: status_of(router, model) == "loaded", timeout=60, what=f"{model} loaded")


def instance_of(router: LlamaServer, model: str) -> int:
    """The process id of the llama-server the router runs for `model`."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            command = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        if parent == router.process.pid and f"{model}.gguf".encode() in b" ".join(command):
            return int(entry.name)
    raise AssertionError(f"no instance of {model} under the router {router.url}")


def ask(ledger: Ledger, says: str) -> httpx.Response:
    body = {"model": "a", "messages": [{"role": "user", "content": says}], "max_tokens": 2}
    return ledger.client.post("/chat/v1/chat/completions", json=body, timeout=60)


def test_a_request_for_a_model_loaded_on_one_router_waits_for_it_when_it_is_full(
    gateway, ledger, routers
):
    holder, other = routers
    load(holder, "a")
    load(other, "b")
    models = {name: (1, 4) for name in MODELS}
    # The router without "a" first in the route, so only its model state keeps requests away.
    add_route("chat", [add_host("llama2", other.url, models=models),
                       add_host("llama1", holder.url, models=models)])  # fmt: skip
    gateway.sync()
    wait_for_host_state(gateway.url, "llama1", "up")  # read with its models
    wait_for_host_state(gateway.url, "llama2", "up")

    # llama1's instance of "a" stopped: the first request holds llama1's only slot until it
    # goes on, so the second, another conversation, finds llama1 full and llama2 free.
    stopped = instance_of(holder, "a")
    os.kill(stopped, signal.SIGSTOP)
    try:
        answers: dict[str, httpx.Response] = {}
        first = threading.Thread(target=lambda: answers.update(first=ask(ledger, "one")))
        first.start()
        wait_for_gauge(gateway.url, "crossbar_in_flight", 1, host="llama1", model="a")
        second = threading.Thread(target=lambda: answers.update(second=ask(ledger, "two")))
        second.start()
        # Queued on llama1 (or, were it sent to llama2, answered there at once).
        wait_until(
            lambda: (
                "second" in answers
                or gauge(gateway.url, "crossbar_queued", host="llama1", model="a") == 1
            ),
            what="the second request queued on llama1",
        )
    finally:
        os.kill(stopped, signal.SIGCONT)
    first.join()
    second.join()

    assert {name: answer.status_code for name, answer in answers.items()} == {
        "first": 200,
        "second": 200,
    }
    assert {answer.headers["x-crossbar-host"] for answer in answers.values()} == {"llama1"}
    assert ledger.statuses() == [200, 200]
    assert set(ledger.rows().values_list("host", "code")) == {("llama1", "")}
    assert ledger.rows().filter(queued_ms__gt=0).count() == 1


def ask_for_c(gateway, ledger: Ledger, routers: list[LlamaServer]) -> httpx.Response:
    """Both routers behind route `chat`, listing model c (loaded on neither): one request
    for c, once both are up."""
    add_route("chat", [add_host(f"llama{n}", router.url, models={"c": (1, 4)})
                       for n, router in enumerate(routers, 1)])  # fmt: skip
    gateway.sync()
    wait_for_host_state(gateway.url, "llama1", "up")
    wait_for_host_state(gateway.url, "llama2", "up")
    body = {"model": "c", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    return ledger.client.post("/chat/v1/chat/completions", json=body, timeout=120)


def test_a_model_loaded_on_no_router_is_loaded_by_crossbar_on_one_and_the_request_served_there(
    gateway, ledger, routers
):
    served = ask_for_c(gateway, ledger, routers)

    assert served.status_code == 200
    host = served.headers["x-crossbar-host"]
    assert served.headers["x-crossbar-placement"] == "loaded"
    number = int(host.removeprefix("llama"))
    assert status_of(routers[number - 1], "c") == "loaded"
    assert status_of(routers[2 - number], "c") == "unloaded"  # one load, not one per router
    assert ledger.statuses() == [200]
    assert list(ledger.rows().values_list("placement", "host", "code")) == [("loaded", host, "")]
