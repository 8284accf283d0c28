"""Every request through the gateway leaves exactly one accounting row, whatever its end."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from django.utils import timezone

from accounting.models import Request
from tests.helpers.fleet import MODEL, chat
from tests.helpers.observe import wait_for_gauge
from tests.helpers.waits import wait_until

pytestmark = pytest.mark.django_db(transaction=True)

CHAT_HOST = {"models": {MODEL: (1, 1)}}  # the `chat_route` fixture's host (tests/conftest.py)


@pytest.fixture
def chat_route(chat_route: str) -> str:
    """The chat completions URL of tests/conftest.py's route."""
    return f"{chat_route}/v1/chat/completions"


TEST_STARTED = timezone.now()


@pytest.fixture(autouse=True)
def _test_started() -> None:
    global TEST_STARTED
    TEST_STARTED = timezone.now()


def rows(count: int) -> list[Request]:
    """Wait for the gateway's recorder to write this test's `count` rows; check no more come.

    Rows of requests started before this test are left out: the shared gateway may still be
    writing an earlier test's rows when this one begins.
    """
    mine = Request.objects.filter(started__gte=TEST_STARTED)
    wait_until(lambda: mine.count() >= count, what=f"{count} accounting rows")
    time.sleep(0.7)  # longer than the recorder's flush interval: an extra row would show
    found = list(mine.order_by("started"))
    assert len(found) == count
    return found


def test_a_streamed_answer_records_its_tokens_and_times(chat_route, fake):
    fake.token_delay = 0.05
    body = chat("one two three", stream=True, max_tokens=4, stream_options={"include_usage": True})
    httpx.post(chat_route, json=body).read()
    httpx.post(chat_route, json=body).read()

    first, second = rows(2)

    assert (first.route, first.host, first.model, first.status) == ("chat", "gpu1", MODEL, 200)
    assert first.streamed and first.lease == "new" and second.lease == "reused"
    assert len(first.fingerprint) == 64 and first.fingerprint == second.fingerprint
    assert first.completion_tokens == 4
    assert second.prompt_tokens is not None
    assert first.prompt_tokens == second.prompt_tokens > 0
    assert second.cached_tokens == second.prompt_tokens - 1  # the fake's cache, as llama-server's
    assert first.ttfb_ms is not None and first.total_ms >= first.ttfb_ms
    assert first.total_ms >= 150  # four tokens 50 ms apart
    assert first.error == ""


def test_a_whole_json_answer_records_its_tokens(chat_route):
    httpx.post(chat_route, json=chat("hello there", max_tokens=3))

    (row,) = rows(1)

    assert row.status == 200 and not row.streamed
    assert row.completion_tokens == 3 and row.prompt_tokens == 3  # the opening and two words


@pytest.mark.parametrize(
    ("path", "content", "status"),
    [
        ("/chat/v1/chat/completions", b"{oops", 400),
        ("/chat/v2/chat/completions", b"{}", 404),
        ("/chat/v1/chat/completions", b'{"model": "x"' + b" " * (16 * 1024 * 1024) + b"}", 413),
    ],
)
def test_refused_requests_are_recorded_with_their_status(
    chat_route, gateway, path, content, status
):
    response = httpx.post(f"{gateway.url}{path}", content=content, timeout=30)

    (row,) = rows(1)

    assert response.status_code == row.status == status
    assert row.error and row.host == "" and row.prompt_tokens is None


def test_a_path_naming_no_route_is_answered_without_a_row_a_log_line_or_a_metric(
    chat_route, gateway
):
    before = gateway.log()
    # (An API path with a wrong route, /nope/v1/models, is a client's: tests/proxy/test_refusals.py)
    answers = [httpx.get(f"{gateway.url}{path}") for path in ("/favicon.ico", "/nope/robots.txt")]
    time.sleep(0.7)  # longer than the recorder's flush interval: a row would show

    assert [a.status_code for a in answers] == [200, 404]  # the site's own icon; nothing
    assert not Request.objects.filter(started__gte=TEST_STARTED).exists()
    assert "route=nope" not in gateway.log()[len(before) :]
    assert 'route="nope"' not in httpx.get(f"{gateway.url}/metrics").text


def test_a_full_queue_records_a_503(chat_route, gateway, fake):
    fake.token_delay = 0.1  # 10 s each, until the test lets them finish
    body = chat(stream=True, max_tokens=100)
    threads = [
        threading.Thread(target=lambda: httpx.post(chat_route, json=body, timeout=60))
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    wait_until(lambda: fake.in_flight == 1, what="the slot taken")
    wait_for_gauge(gateway.url, "crossbar_queued", 1, host="gpu1", model=MODEL)
    refused = httpx.post(chat_route, json=chat("third"))
    fake.token_delay = 0
    for t in threads:
        t.join()

    statuses = sorted(row.status for row in rows(3))

    assert refused.status_code == 503
    assert statuses == [200, 200, 503]


def test_a_client_leaving_while_queued_is_recorded_as_499(chat_route, fake):
    fake.token_delay = 0.1
    holder = threading.Thread(
        target=lambda: httpx.post(chat_route, json=chat(stream=True, max_tokens=20), timeout=30)
    )
    holder.start()
    wait_until(lambda: fake.in_flight == 1, what="the slot taken")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(chat_route, json=chat("impatient"), timeout=0.5)
    holder.join()

    by_status = {row.status: row for row in rows(2)}

    assert set(by_status) == {200, 499}
    assert by_status[499].queued_ms >= 0 and by_status[499].ttfb_ms is None


def test_a_client_leaving_mid_stream_is_recorded_as_499(chat_route, fake):
    fake.token_delay = 0.1
    with httpx.stream("POST", chat_route, json=chat(stream=True, max_tokens=50)) as response:
        lines = response.iter_lines()
        next(lines)

    (row,) = rows(1)

    assert row.status == 499 and row.streamed and row.ttfb_ms is not None
    assert "disconnected" in row.error


def test_a_connection_reset_before_the_head_is_recorded_as_502(chat_route, fake):
    fake.fail_mode = "reset_before_headers"
    httpx.post(chat_route, json=chat("a"))

    (row,) = rows(1)

    assert row.status == 502 and "gpu1" in row.error and row.ttfb_ms is None


def test_a_host_sending_no_head_in_time_is_recorded_as_504(chat_route, fake):
    fake.fail_mode = "hang"
    httpx.post(chat_route, json=chat("b"), timeout=20)

    (row,) = rows(1)

    assert row.status == 504 and "no response head" in row.error


def test_a_reset_mid_stream_is_recorded_as_502(chat_route, fake):
    fake.fail_mode = "reset_mid_stream"
    with httpx.stream("POST", chat_route, json=chat(stream=True, max_tokens=30)) as response:
        try:
            response.read()
        except httpx.HTTPError:
            pass

    (row,) = rows(1)

    assert row.status == 502 and "mid-stream" in row.error


def test_no_healthy_host_is_recorded_as_503(chat_route, fake):
    fake.health = "error"
    statuses = []

    def refused() -> bool:
        statuses.append(httpx.post(chat_route, json=chat()).status_code)
        return statuses[-1] == 503

    wait_until(refused, what="the host to be seen down")
    recorded = rows(len(statuses))

    assert [row.status for row in recorded] == statuses
    assert recorded[-1].error.startswith("no healthy host: ") and recorded[-1].host == ""


def test_a_host_header_the_gateway_does_not_serve_is_refused_with_a_row(chat_route, gateway, fake):
    response = httpx.post(chat_route, json=chat(), headers={"Host": "rebound.example"})

    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_host"
    (row,) = rows(1)
    assert (row.status, row.code, row.route) == (400, "invalid_host", "chat")
    assert [seen for seen in fake.seen if seen.method == "POST"] == []
