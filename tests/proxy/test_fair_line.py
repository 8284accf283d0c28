"""Priority classes in a host's line, as clients see them through the gateway over real sockets:
a client key's class decides who a freed slot goes to, and each request's work is charged to
its key. The order rules themselves are tested alone (tests/core/test_fairness.py) and through
the limiter (tests/core/test_fair_limiter.py). The lines kept in Redis (CROSSBAR_TEST_SHARED=1)
are first come, first served: these tests are the in-process state's.
"""

from __future__ import annotations

import os
import threading

import httpx
import pytest

from tests.helpers.asking import asked, completions, holding, issue, one_slot_route, slow
from tests.helpers.fleet import MODEL, chat
from tests.helpers.observe import wait_for_gauge
from tests.helpers.waits import wait_until

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(
        os.environ.get("CROSSBAR_TEST_SHARED") == "1",
        reason="the shared state's lines are first come, first served (docs/replicas.md)",
    ),
]


def test_an_interactive_request_is_served_before_batch_requests_queued_earlier(
    gateway, fake, ledger
):
    batch = issue("nightly", priority="batch")
    chat_key = issue("support-chat", priority="interactive")
    fake.token_delay = 0.1
    url = one_slot_route(gateway, fake, 8)
    answers: dict[str, httpx.Response] = {}
    threads = []

    with holding(url, slow(tokens=100), fake, key=batch):  # 10 s, until the test lets it end
        for number in range(3):
            threads.append(asked(url, batch, f"batch {number}", answers))
            wait_for_gauge(gateway.url, "crossbar_queued", number + 1, host="gpu1", model=MODEL)
        threads.append(asked(url, chat_key, "interactive", answers))
        wait_for_gauge(gateway.url, "crossbar_queued", 4, host="gpu1", model=MODEL)
        ledger.sent(5)
        fake.token_delay = 0
    for thread in threads:
        thread.join()

    served = [seen.json["messages"][-1]["content"] for seen in completions(fake)]
    assert served[1:] == ["interactive", "batch 0", "batch 1", "batch 2"]
    # All answered; in which order the clients finished reading is theirs, not the line's.
    statuses = {content: answer.status_code for content, answer in answers.items()}
    assert statuses == dict.fromkeys(["batch 0", "batch 1", "batch 2", "interactive"], 200)
    wait_until(lambda: ledger.rows().count() == 5, what="the rows")
    rows = ledger.rows().exclude(queued_ms=0)
    waited = {row.client: row.queued_ms for row in rows.order_by("started")}  # the last batch's
    assert rows.count() == 4
    assert waited["support-chat"] < waited["nightly"]


def test_a_key_whose_requests_make_the_host_work_ten_times_more_is_granted_less_often(
    gateway, fake, ledger
):
    """Two standard keys of weight 1 queue requests in turn; one key's prompts are ten times
    longer. Each answer charges its key the work the host reported, so once the first answers
    are in, the line serves the cheap key's requests before the big key's next ones. (Charged
    nothing, the two keys would alternate: big, small, big, small, ...)"""
    holder = issue("holder")
    keys = {"big": issue("summaries"), "small": issue("questions")}
    words = {"big": 3000, "small": 300}
    fake.token_delay = 0.1
    url = one_slot_route(gateway, fake, 10)
    threads = []

    with holding(url, slow(tokens=100), fake, key=holder):  # 10 s, until the test lets it end
        for number in range(5):
            for kind in ("big", "small"):
                # Each prompt opens with its own word, so the host finds none of it cached.
                content = f"{kind}{number} " + "lorem " * words[kind]
                body = chat(content, max_tokens=5)
                thread = threading.Thread(
                    target=lambda body=body, key=keys[kind]: httpx.post(
                        url, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60
                    )
                )
                thread.start()
                threads.append(thread)
                queued = len(threads)
                wait_for_gauge(gateway.url, "crossbar_queued", queued, host="gpu1", model=MODEL)
        ledger.sent(11)
        fake.token_delay = 0.01
    for thread in threads:
        thread.join()

    served = [seen.json["messages"][-1]["content"].split()[0] for seen in completions(fake)]
    assert sorted(served[1:]) == sorted(f"{kind}{n}" for n in range(5) for kind in words)
    assert served[1:3] == ["big0", "small0"]  # nothing answered yet: arrival order
    order = served[1:]
    assert order.index("small3") < order.index("big2"), order
    wait_until(lambda: ledger.rows().count() == 11, what="the rows")
    prompts = {row.client: row.prompt_tokens or 0 for row in ledger.rows()}
    assert prompts["summaries"] > 9 * prompts["questions"] > 0  # ten times as many words


def test_a_keys_answer_is_charged_before_its_slot_goes_to_the_next_in_line(gateway, fake, ledger):
    """The request holding the only slot evaluates a long prompt for key `summaries`; then
    `summaries` and `questions` each queue a short one, `summaries` first. When the long
    answer ends, its work is charged before the slot is handed on, so `questions` goes first.
    (Charged after, the two keys would tie and the first queued would go: `summaries`.)"""
    keys = {"big": issue("summaries"), "small": issue("questions")}
    fake.token_delay = 0.1
    url = one_slot_route(gateway, fake, 4)
    answers: dict[str, httpx.Response] = {}
    threads = []

    long_prompt = slow("holder " + "lorem " * 3000, tokens=100)
    with holding(url, long_prompt, fake, key=keys["big"]):  # 10 s, until the test lets it end
        for number, kind in enumerate(("big", "small")):
            threads.append(asked(url, keys[kind], f"{kind} next", answers))
            wait_for_gauge(gateway.url, "crossbar_queued", number + 1, host="gpu1", model=MODEL)
        ledger.sent(3)
        fake.token_delay = 0
    for thread in threads:
        thread.join()

    served = [seen.json["messages"][-1]["content"] for seen in completions(fake)]
    assert served[1:] == ["small next", "big next"]
    statuses = {content: answer.status_code for content, answer in answers.items()}
    assert statuses == {"big next": 200, "small next": 200}
