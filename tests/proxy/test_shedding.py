"""Load shedding by class over real sockets: at a host whose line is full of batch requests, an
interactive request is queued and served, and the batch request queued last is refused with
429 `over_capacity` instead. The rule itself is tested through the limiter
(tests/core/test_shedding.py). The lines kept in Redis (CROSSBAR_TEST_SHARED=1) shed nobody:
these tests are the in-process state's.
"""

from __future__ import annotations

import os

import httpx
import pytest

from tests.helpers.asking import asked, completions, holding, issue, one_slot_route, slow
from tests.helpers.fleet import MODEL
from tests.helpers.observe import wait_for_gauge
from tests.helpers.waits import wait_until

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(
        os.environ.get("CROSSBAR_TEST_SHARED") == "1",
        reason="the shared state's lines are first come, first served (docs/replicas.md)",
    ),
]


def test_an_interactive_request_at_a_line_full_of_batch_ones_is_served_and_the_last_is_shed(
    gateway, fake, ledger
):
    batch = issue("nightly", priority="batch")
    chat_key = issue("support-chat", priority="interactive")
    fake.token_delay = 0.1
    url = one_slot_route(gateway, fake, 2)
    answers: dict[str, httpx.Response] = {}
    threads = []

    with holding(url, slow(tokens=100), fake, key=batch):  # 10 s, until the test lets it end
        for number in range(2):
            threads.append(asked(url, batch, f"batch {number}", answers))
            wait_for_gauge(gateway.url, "crossbar_queued", number + 1, host="gpu1", model=MODEL)
        threads.append(asked(url, chat_key, "interactive", answers))
        wait_until(lambda: "batch 1" in answers, what="the last batch request's answer")
        assert "interactive" not in answers  # queued, not refused
        wait_for_gauge(gateway.url, "crossbar_queued", 2, host="gpu1", model=MODEL)
        ledger.sent(4)
        fake.token_delay = 0
    for thread in threads:
        thread.join()

    shed = answers["batch 1"]
    assert shed.status_code == 429
    assert shed.headers["Retry-After"] == "1"
    error = shed.json()["error"]
    assert error["code"] == "over_capacity"
    assert "a request of class interactive took its place" in error["message"]
    assert answers["interactive"].status_code == 200
    assert answers["batch 0"].status_code == 200
    served = [seen.json["messages"][-1]["content"] for seen in completions(fake)]
    assert served[1:] == ["interactive", "batch 0"]
    wait_until(lambda: ledger.rows().count() == 4, what="the rows")
    (row,) = ledger.rows().filter(status=429)
    assert (row.client, row.code, row.host) == ("nightly", "over_capacity", "gpu1")
    assert "a request of class interactive took its place" in row.error
    assert ledger.rows().filter(status=200).count() == 3
