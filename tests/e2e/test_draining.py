"""A stopping gateway tells its load balancer: from SIGTERM on, `/health` answers 503 `draining`
(on connections it still serves) while the requests in flight finish."""

from __future__ import annotations

import signal

import httpx
import pytest

from accounting.models import Request
from tests.conftest import running_gateway, wait_until
from tests.fleet import add_host, add_route, chat

pytestmark = pytest.mark.django_db(transaction=True)
URL = "/chat/v1/chat/completions"


def refused(url: str) -> bool:
    try:
        httpx.get(f"{url}/health", timeout=2)
    except httpx.ConnectError:
        return True
    return False


def test_health_answers_draining_while_the_stream_in_flight_finishes(
    django_db_setup, tmp_path, fake
):
    fake.token_delay = 0.1
    add_route("chat", [add_host("gpu1", fake.url)])
    with running_gateway(tmp_path, CROSSBAR_SHUTDOWN_GRACE="30") as gateway:
        gateway.sync()
        # A load balancer probing over its kept-alive connection.
        with httpx.Client(base_url=gateway.url, timeout=10) as balancer:
            before = balancer.get("/health")
            body = chat(stream=True, max_tokens=20)
            with httpx.stream("POST", f"{gateway.url}{URL}", json=body, timeout=30) as response:
                lines = response.iter_lines()
                next(line for line in lines if line.startswith("data: "))

                gateway.process.send_signal(signal.SIGTERM)
                wait_until(lambda: refused(gateway.url), timeout=10, what="new connections refused")
                during = balancer.get("/health")
                rest = [line for line in lines if line.startswith("data: ")]
        exit_code = gateway.process.wait(timeout=30)

    assert (before.status_code, before.json()["status"]) == (200, "ok")
    assert (during.status_code, during.json()) == (503, {"status": "draining"})
    assert rest[-1] == "data: [DONE]" and len(rest) == 20
    assert exit_code == 0
    (row,) = Request.objects.all()
    assert (row.status, row.completion_tokens) == (200, 20)
