"""Waiting clients: wait-status comments, queue timeouts, patience and spill, fallback routes."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from accounting.models import Request
from tests.fakes.llama_server import FakeLlamaServer
from tests.helpers.asking import holding, slow
from tests.helpers.fleet import MODEL, add_host, add_route, chat
from tests.helpers.observe import wait_for_gauge, wait_for_host_state
from tests.helpers.waits import wait_until

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def cpu() -> Iterator[FakeLlamaServer]:
    with FakeLlamaServer(slots=2, models=("small",)) as server:
        yield server


def test_a_queued_stream_hears_where_it_waits_and_then_streams(gateway, fake):
    fake.token_delay = 0.1
    add_route("chat", [add_host("gpu1", fake.url, models={MODEL: (1, 4)})], wait_status=True)
    gateway.sync()
    url = f"{gateway.url}/chat/v1/chat/completions"

    with holding(url, slow(tokens=100), fake):  # 10 s, until the test lets it finish
        with httpx.stream("POST", url, json=chat("next", stream=True, max_tokens=3)) as response:
            # The head came at once, not once the slot was free: the request still waits (its
            # line leaves only once the holder ends; a shared state's count follows a tick).
            wait_for_gauge(gateway.url, "crossbar_queued", 1, host="gpu1", model=MODEL)
            fake.token_delay = 0
            lines = [line for line in response.iter_lines() if line]

    assert response.status_code == 200
    assert lines[0] == ": crossbar-status: waiting 1"
    running = lines.index(": crossbar-status: running")
    data = [line for line in lines if line.startswith("data: ")]
    assert running > 0
    assert not any(line.startswith(": ") for line in lines[running + 1 :])
    assert len(data) == 3 + 1 and data[-1] == "data: [DONE]"


def test_the_openai_client_reads_a_stream_that_waited_with_comments(gateway, fake):
    fake.token_delay = 0.05
    add_route("chat", [add_host("gpu1", fake.url, models={MODEL: (1, 4)})])
    gateway.sync()
    url = f"{gateway.url}/chat/v1/chat/completions"
    client = openai.OpenAI(
        base_url=f"{gateway.url}/chat/v1",
        api_key="x",
        default_headers={"X-Crossbar-Wait-Status": "on"},
    )

    with holding(url, slow(tokens=15), fake):
        stream = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True, max_tokens=4
        )
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    assert text == "tok0 tok1 tok2 tok3 "


def test_without_wait_status_a_queued_request_gets_its_head_with_the_answer(gateway, fake):
    fake.token_delay = 0.05
    add_route("chat", [add_host("gpu1", fake.url, models={MODEL: (1, 4)})], wait_status=True)
    gateway.sync()
    url = f"{gateway.url}/chat/v1/chat/completions"

    with holding(url, slow(tokens=10), fake):
        response = httpx.post(
            url, json=chat(stream=True, max_tokens=2), headers={"X-Crossbar-Wait-Status": "off"}
        )

    assert response.status_code == 200
    assert ": crossbar-status" not in response.text
    assert int(response.headers["x-crossbar-queued-ms"]) > 0


def test_a_request_still_queued_after_the_queue_timeout_gets_503(gateway, fake):
    fake.token_delay = 0.1
    add_route("chat", [add_host("gpu1", fake.url, models={MODEL: (1, 4)})], queue_timeout=1)
    gateway.sync()
    url = f"{gateway.url}/chat/v1/chat/completions"

    with holding(url, slow(tokens=30), fake):
        response = httpx.post(url, json=chat("late"))

    assert response.status_code == 503
    assert response.json()["error"]["code"] == "queue_timeout"
    assert "retry-after" in response.headers


def test_a_queue_timeout_after_the_head_ends_the_stream_with_one_error_event(gateway, fake):
    fake.token_delay = 0.1
    add_route(
        "chat",
        [add_host("gpu1", fake.url, models={MODEL: (1, 4)})],
        queue_timeout=1,
        wait_status=True,
    )
    gateway.sync()
    url = f"{gateway.url}/chat/v1/chat/completions"

    with holding(url, slow(tokens=30), fake):
        response = httpx.post(url, json=chat("late", stream=True))

    data = [line for line in response.text.split("\n") if line.startswith("data: ")]
    assert response.status_code == 200
    assert len(data) == 1 and '"code": "queue_timeout"' in data[0]
    wait_until(lambda: Request.objects.filter(status=503).exists(), what="the 503 row")


def test_a_conversation_spills_to_a_free_host_after_its_patience(gateway, fake, fake2):
    fake.token_delay = 0.1
    add_route(
        "chat",
        [
            add_host("gpu1", fake.url, models={MODEL: (1, 4)}),
            add_host("gpu2", fake2.url, models={MODEL: (1, 4)}),
        ],
        lease_patience=0.5,
    )
    gateway.sync()
    url = f"{gateway.url}/chat/v1/chat/completions"
    first = httpx.post(url, json=chat("my conversation"))
    assert first.headers["x-crossbar-host"] == "gpu1"

    with holding(url, slow("my conversation", tokens=30), fake):
        started = time.monotonic()
        spilled = httpx.post(url, json=chat("my conversation"))
        waited = time.monotonic() - started
    back_home = httpx.post(url, json=chat("my conversation"))

    assert spilled.headers["x-crossbar-lease"] == "spilled"
    assert spilled.headers["x-crossbar-host"] == "gpu2"
    assert waited >= 0.5  # it was patient first
    assert back_home.headers["x-crossbar-host"] == "gpu1"  # the lease stayed home
    assert back_home.headers["x-crossbar-lease"] == "reused"


def test_a_full_home_queue_spills_at_once(gateway, fake, fake2):
    fake.token_delay = fake2.token_delay = 0.1
    add_route(
        "chat",
        [
            add_host("gpu1", fake.url, models={MODEL: (1, 0)}),
            add_host("gpu2", fake2.url, models={MODEL: (1, 0)}),
        ],
        lease_patience=60,
    )
    gateway.sync()
    url = f"{gateway.url}/chat/v1/chat/completions"

    with holding(url, slow("mine", tokens=30), fake):
        spilled = httpx.post(url, json=chat("mine"))
        with holding(url, slow("other", tokens=30), fake2):
            refused = httpx.post(url, json=chat("third"))

    assert spilled.status_code == 200
    assert spilled.headers["x-crossbar-lease"] == "spilled"
    assert spilled.headers["x-crossbar-host"] == "gpu2"
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "queue_full"


def fallback_fleet(fake: FakeLlamaServer, cpu: FakeLlamaServer, **route: object) -> None:
    cpu_route = add_route(
        "cpu", [add_host("cpu1", cpu.url, models={"small": (2, 0)}, api_key="cpu-key")]
    )
    add_route(
        "chat",
        [add_host("gpu1", fake.url, models={MODEL: (1, 4)})],
        fallback=cpu_route,
        fallback_after=0.5,
        fallback_model="small",
        **route,
    )


def test_a_request_that_waited_too_long_goes_to_the_fallback_route(gateway, fake, cpu):
    fake.token_delay = 0.1
    fallback_fleet(fake, cpu)
    gateway.sync()
    url = f"{gateway.url}/chat/v1/chat/completions"

    with holding(url, slow(tokens=30), fake):
        response = httpx.post(
            url, json=chat("help"), headers={"Authorization": "Bearer client-secret"}
        )

    seen = [s for s in cpu.seen if s.path == "/v1/chat/completions"]
    assert response.status_code == 200
    assert response.headers["x-crossbar-fallback"] == "cpu"
    assert response.headers["x-crossbar-host"] == "cpu1"
    assert len(seen) == 1 and seen[0].json["model"] == "small"
    assert seen[0].headers["authorization"] == "Bearer cpu-key"  # never the client's
    row = wait_until(lambda: Request.objects.filter(fallback="cpu").first(), what="the row")
    assert (row.route, row.host, row.model, row.status) == ("chat", "cpu1", "small", 200)
    assert row.queued_ms >= 500


def test_the_fallback_is_not_taken_when_the_primary_frees_first(gateway, fake, cpu):
    fake.token_delay = 0.05
    fallback_fleet(fake, cpu)
    gateway.sync()
    url = f"{gateway.url}/chat/v1/chat/completions"

    with holding(url, slow(tokens=4), fake):
        response = httpx.post(url, json=chat("help"))

    assert response.headers["x-crossbar-host"] == "gpu1"
    assert "x-crossbar-fallback" not in response.headers
    assert [s for s in cpu.seen if s.path == "/v1/chat/completions"] == []


def test_a_down_fallback_leaves_the_request_waiting_for_the_primary(gateway, fake, cpu):
    fake.token_delay = 0.1
    cpu.health = "error"
    fallback_fleet(fake, cpu)
    gateway.sync()
    wait_for_host_state(gateway.url, "cpu1", "down")
    url = f"{gateway.url}/chat/v1/chat/completions"

    with holding(url, slow(tokens=12), fake):
        response = httpx.post(url, json=chat("help"))

    assert response.status_code == 200
    assert response.headers["x-crossbar-host"] == "gpu1"
    assert int(response.headers["x-crossbar-queued-ms"]) >= 500


def test_a_stream_whose_head_is_out_says_when_it_falls_back(gateway, fake, cpu):
    fake.token_delay = 0.1
    fallback_fleet(fake, cpu, wait_status=True)
    gateway.sync()
    url = f"{gateway.url}/chat/v1/chat/completions"

    with holding(url, slow(tokens=30), fake):
        response = httpx.post(url, json=chat("help", stream=True, max_tokens=2))

    lines = [line for line in response.text.split("\n") if line]
    assert ": crossbar-status: fallback cpu" in lines
    fallback = lines.index(": crossbar-status: fallback cpu")
    assert fallback < lines.index(": crossbar-status: running")
    assert lines[-1] == "data: [DONE]"


def test_with_no_healthy_host_a_route_with_a_fallback_waits_for_it(gateway, fake, cpu):
    fake.health = "error"
    fallback_fleet(fake, cpu)
    gateway.sync()
    wait_for_host_state(gateway.url, "gpu1", "down")

    response = httpx.post(f"{gateway.url}/chat/v1/chat/completions", json=chat("anyone?"))

    assert response.status_code == 200
    assert response.headers["x-crossbar-fallback"] == "cpu"


def test_a_route_with_a_fallback_waits_while_its_host_resets_and_gives_its_slot_back(
    gateway, fake, fake2, ledger
):
    """Two resets before the head mark the only host down: the request waits (for the host to
    come back, or the fallback) instead of answering no_healthy_host, and the slot it held is
    not lost: the next request is served by the host, and nothing is held at the end."""
    cpu_route = add_route("cpu", [add_host("cpu1", fake2.url, models={MODEL: (1, 0)})])
    add_route(
        "chat",
        [add_host("gpu1", fake.url, models={MODEL: (1, 0)})],
        fallback=cpu_route,
        fallback_after=0.3,
    )
    gateway.sync()
    url = f"{gateway.url}/chat/v1/chat/completions"
    fake.fail_mode = "reset_before_headers"
    fake.fail_count = 2  # the gateway's first try and its retry on a fresh connection

    waited = ledger.client.post(url, json=chat("first"))

    assert waited.status_code == 200, waited.text
    assert fake.fail_mode is None  # both resets were spent on it
    wait_until(lambda: ledger.rows().count() == 1, what="the first row")
    home = ledger.client.post(url, json=chat("second"))
    assert home.status_code == 200, home.text
    assert home.headers["x-crossbar-host"] == "gpu1"


def test_a_queued_stream_whose_host_answers_an_unusable_status_ends_with_one_error_event(
    gateway, fake, ledger
):
    """The head went out while the request waited: the host's unusable status becomes one
    `upstream_failed` error event, its row a 502, and the slot comes back."""
    fake.token_delay = 0.1
    add_route("chat", [add_host("gpu1", fake.url, models={MODEL: (1, 4)})], wait_status=True)
    gateway.sync()
    url = f"{gateway.url}/chat/v1/chat/completions"

    with holding(url, slow(tokens=20), fake):
        ledger.sent()  # the holder's own request
        fake.odd_status, fake.fail_mode, fake.fail_count = "999 Weird", "odd_status", 1
        response = ledger.client.post(url, json=chat("next", stream=True))

    data = [line for line in response.text.split("\n") if line.startswith("data: ")]
    assert response.status_code == 200
    assert len(data) == 1 and '"code": "upstream_failed"' in data[0]
    assert "host gpu1 answered an unusable status line: 999 Weird" in data[0]
    assert ledger.statuses() == [200, 502]
