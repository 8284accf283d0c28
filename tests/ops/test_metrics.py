"""/metrics: Prometheus' text format, moved by real requests through the real gateway."""

from __future__ import annotations

import threading

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.fakes.llama_server import FakeLlamaServer
from tests.helpers.fleet import MODEL, add_host, add_route, chat
from tests.helpers.gateway import running_gateway
from tests.helpers.machine import free_port
from tests.helpers.waits import wait_until

pytestmark = pytest.mark.django_db(transaction=True)

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(url: str, token: str | None = None) -> Samples:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    response = httpx.get(f"{url}/metrics", headers=headers)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


def scrape_until(url: str, predicate, what: str) -> Samples:
    """Scrape until `predicate(samples)` holds; return those samples."""
    found: list[Samples] = []

    def check() -> bool:
        found[:] = [scrape(url)]
        return bool(predicate(found[0]))

    wait_until(check, what=what)
    return found[0]


def value(samples: Samples, name: str, **labels: str) -> float:
    """A sample's value; 0 when the series does not exist yet (counters start there)."""
    return samples.get((name, frozenset(labels.items())), 0.0)


def delta(before: Samples, after: Samples, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


PLACE = {"route": "chat", "host": "gpu1", "model": MODEL}


def test_finished_requests_move_the_counters_histograms_and_token_counts(gateway, fake):
    add_route("chat", [add_host("gpu1", fake.url)])
    gateway.sync()
    url = f"{gateway.url}/chat/v1/chat/completions"
    before = scrape(gateway.url)

    first = httpx.post(url, json=chat("metrics please", max_tokens=3))
    second = httpx.post(
        url,
        json=chat(
            "metrics please", stream=True, max_tokens=4, stream_options={"include_usage": True}
        ),
    )
    after = scrape(gateway.url)

    assert first.status_code == second.status_code == 200
    assert delta(before, after, "crossbar_requests_total", **PLACE, status="200", code="") == 2
    assert delta(before, after, "crossbar_request_duration_seconds_count", **PLACE) == 2
    assert delta(before, after, "crossbar_ttfb_seconds_count", **PLACE) == 2
    assert delta(before, after, "crossbar_queue_wait_seconds_count", **PLACE) == 2
    assert delta(before, after, "crossbar_completion_tokens_total", **PLACE) == 3 + 4
    prompt = first.json()["usage"]["prompt_tokens"] * 2  # the same prompt twice
    assert delta(before, after, "crossbar_prompt_tokens_total", **PLACE) == prompt
    # The second turn found the conversation's lease and the host's cache.
    assert delta(before, after, "crossbar_cached_tokens_total", **PLACE) > 0
    leases = {"route": "chat", "host": "gpu1"}
    assert delta(before, after, "crossbar_lease_outcomes_total", **leases, outcome="new") == 1
    assert delta(before, after, "crossbar_lease_outcomes_total", **leases, outcome="reused") == 1


def test_a_refused_request_counts_its_status_without_the_client_chosen_model(gateway, fake):
    add_route("chat", [add_host("gpu1", fake.url)])
    gateway.sync()
    before = scrape(gateway.url)

    response = httpx.post(
        f"{gateway.url}/chat/v1/chat/completions",
        json={"model": "no-such-model-x9", "messages": []},
    )
    text = httpx.get(f"{gateway.url}/metrics").text
    after = scrape(gateway.url)

    assert response.status_code == 404
    labels = {"route": "chat", "host": "", "model": "", "status": "404", "code": "model_not_found"}
    assert delta(before, after, "crossbar_requests_total", **labels) == 1
    assert "no-such-model-x9" not in text


def test_slots_in_flight_and_queue_show_while_requests_run(gateway, fake):
    fake.token_delay = 0.1
    add_route("chat", [add_host("gpu1", fake.url, models={MODEL: (1, 3)})])
    gateway.sync()
    url = f"{gateway.url}/chat/v1/chat/completions"
    pair = {"host": "gpu1", "model": MODEL}

    def stream(i: int) -> None:
        httpx.post(url, json=chat(f"long {i}", stream=True, max_tokens=15), timeout=30)

    before = scrape(gateway.url)
    threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    busy = scrape_until(
        gateway.url,
        lambda s: value(s, "crossbar_queued", **pair) == 1,
        what="one request running and one queued",
    )
    for thread in threads:
        thread.join()
    idle = scrape(gateway.url)

    assert value(busy, "crossbar_in_flight", **pair) == 1
    assert value(busy, "crossbar_slots", **pair) == 1
    assert value(busy, "crossbar_queue_max", **pair) == 3
    assert delta(before, busy, "crossbar_leases_held", host="gpu1") == 2  # two conversations
    assert value(idle, "crossbar_in_flight", **pair) == 0
    assert value(idle, "crossbar_queued", **pair) == 0


def test_host_state_is_one_gauge_per_host_and_state(gateway, fake):
    gone = f"http://127.0.0.1:{free_port()}"  # nothing listens: the poller marks it down
    add_route("chat", [add_host("gpu1", fake.url), add_host("gpu2", gone, draining=True)])
    gateway.sync()

    samples = scrape_until(
        gateway.url,
        lambda s: (
            value(s, "crossbar_host_state", host="gpu2", state="down") == 1
            and value(s, "crossbar_host_state", host="gpu1", state="up") == 1
        ),
        what="gpu1 up and gpu2 down",
    )

    states = {"up": 1, "down": 0, "loading": 0, "unknown": 0}
    assert {s: value(samples, "crossbar_host_state", host="gpu1", state=s) for s in states} == (
        states
    )
    assert value(samples, "crossbar_host_draining", host="gpu2") == 1
    assert value(samples, "crossbar_host_draining", host="gpu1") == 0


def test_a_request_served_by_the_fallback_route_is_counted(gateway, fake):
    fake.token_delay = 0.1
    with FakeLlamaServer(slots=2, models=("small",)) as cpu:
        cpu_route = add_route("cpu", [add_host("cpu1", cpu.url, models={"small": (2, 0)})])
        add_route(
            "chat",
            [add_host("gpu1", fake.url, models={MODEL: (1, 4)})],
            fallback=cpu_route,
            fallback_after=0.3,
            fallback_model="small",
        )
        gateway.sync()
        url = f"{gateway.url}/chat/v1/chat/completions"
        before = scrape(gateway.url)
        hold = chat("hold", stream=True, max_tokens=20)
        holder = threading.Thread(target=lambda: httpx.post(url, json=hold, timeout=30))
        holder.start()
        wait_until(lambda: fake.in_flight == 1, what="the only slot to be taken")
        response = httpx.post(url, json=chat("help"))
        holder.join()
    after = scrape(gateway.url)

    assert response.headers["x-crossbar-fallback"] == "cpu"
    assert delta(before, after, "crossbar_fallbacks_total", route="chat", fallback="cpu") == 1
    labels = {"route": "chat", "host": "cpu1", "model": "small", "status": "200", "code": ""}
    assert delta(before, after, "crossbar_requests_total", **labels) == 1


def test_the_recorder_reports_its_backlog_and_losses(gateway, fake):
    add_route("chat", [add_host("gpu1", fake.url)])
    gateway.sync()
    httpx.post(f"{gateway.url}/chat/v1/chat/completions", json=chat())

    samples = scrape(gateway.url)

    assert ("crossbar_recorder_backlog", frozenset()) in samples
    assert value(samples, "crossbar_recorder_dropped_total") == 0
    assert value(samples, "crossbar_recorder_written_total") >= 0


@pytest.fixture
def gateway_with_metrics_token(django_db_setup, tmp_path):
    with running_gateway(tmp_path, CROSSBAR_METRICS_TOKEN="scrape-secret") as gw:
        yield gw


def test_the_metrics_token_is_required_when_set(gateway_with_metrics_token):
    url = f"{gateway_with_metrics_token.url}/metrics"

    missing = httpx.get(url)
    wrong = httpx.get(url, headers={"Authorization": "Bearer nope"})
    samples = scrape(gateway_with_metrics_token.url, token="scrape-secret")

    assert missing.status_code == wrong.status_code == 401
    assert missing.headers["www-authenticate"].startswith("Bearer")
    assert "crossbar_requests" not in missing.text
    assert ("crossbar_recorder_backlog", frozenset()) in samples


def test_metrics_need_no_token_by_default(gateway):
    assert httpx.get(f"{gateway.url}/metrics").status_code == 200


def test_a_returning_conversation_that_finds_its_cache_gone_counts_as_a_cold_turn(gateway, fake):
    add_route("chat", [add_host("gpu1", fake.url)])
    gateway.sync()
    url = f"{gateway.url}/chat/v1/chat/completions"
    session = {"X-Crossbar-Session": "cold-turn-conversation"}
    opening = "please tell me about the long history of the river valley and its towns"
    before = scrape(gateway.url)

    first = httpx.post(url, json=chat(opening, max_tokens=2), headers=session)
    warm = httpx.post(url, json=chat(opening + " and bridges", max_tokens=2), headers=session)
    # The same conversation (its lease) with a prompt the host has never seen: a cold cache.
    cold = httpx.post(url, json=chat("unrelated words entirely", max_tokens=2), headers=session)
    after = scrape(gateway.url)

    leases = [response.headers["x-crossbar-lease"] for response in (first, warm, cold)]
    assert leases == ["new", "reused", "reused"]
    assert warm.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert delta(before, after, "crossbar_cold_turns_total", route="chat", host="gpu1") == 1


def test_errors_count_with_their_code_and_successes_with_none(gateway, fake):
    add_route("chat", [add_host("gpu1", fake.url, models={MODEL: (1, 0)})])
    gateway.sync()
    fake.token_delay = 0.1
    url = f"{gateway.url}/chat/v1/chat/completions"
    before = scrape(gateway.url)
    holder = threading.Thread(
        target=lambda: httpx.post(url, json=chat("hold", stream=True, max_tokens=10), timeout=30)
    )
    holder.start()
    wait_until(lambda: fake.in_flight == 1, what="the only slot to be taken")
    refused = httpx.post(url, json=chat("no room"))
    holder.join()
    after = scrape(gateway.url)

    assert refused.status_code == 503
    refusals = {
        labels: count - before.get((name, labels), 0.0)
        for (name, labels), count in after.items()
        if name == "crossbar_requests_total" and ("code", "queue_full") in labels
    }
    assert sum(refusals.values()) == 1
    assert all(("status", "503") in labels for labels in refusals)
    assert delta(before, after, "crossbar_requests_total", **PLACE, status="200", code="") == 1


def test_the_code_label_stays_bounded_whatever_codes_arrive(monkeypatch):
    from routing.ops import metrics

    monkeypatch.setattr(metrics, "_codes", set())

    kept = [metrics.code_label(f"code_{i}") for i in range(metrics.MAX_CODES)]
    past_the_bound = metrics.code_label("one_too_many")
    odd = metrics.code_label("Not A Code; DROP")

    assert kept == [f"code_{i}" for i in range(metrics.MAX_CODES)]
    assert metrics.code_label("code_3") == "code_3"  # a known code stays itself
    assert past_the_bound == "other" and odd == "other"
    assert metrics.code_label("") == ""
