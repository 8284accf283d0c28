"""A refusal's words and facts: the route, the model, each host's state, what to do, and
Retry-After only where waiting helps."""

from __future__ import annotations

import calendar
from typing import Any, cast

from routing.core.errors import Answer, answer_for
from routing.core.refusals import (
    SHOWN,
    Standing,
    no_healthy_host,
    pinned_host_down,
    queue_full,
    unknown_model,
)

NOON = calendar.timegm((2026, 12, 2, 12, 0, 0))


def error(answer: Answer) -> dict[str, Any]:
    """The error object of the answer's body, as a client reads it."""
    return cast(dict[str, Any], answer.body()["error"])


def host(name: str, **facts: object) -> Standing:
    values: dict = {"health": "up", "since": NOON, "parallel": 4, "queue_max": 8, **facts}
    return Standing(name, **values)


def test_a_host_shows_the_first_reason_it_takes_no_request():
    assert host("a", enabled=False, draining=True, health="down").state == "disabled"
    assert host("a", draining=True, health="down").state == "draining"
    assert host("a", health="loading").state == "loading"
    assert host("a", in_flight=4, queued=8).state == "full"
    assert host("a", in_flight=4, queued=7).state == "up"


def test_a_full_route_names_every_full_host_with_its_counts_and_says_to_retry_in_a_second():
    full = [host("gpu1", in_flight=4, queued=8), host("gpu2", in_flight=4, queued=8)]

    answer = answer_for(queue_full("chat", "llama", full))

    assert (answer.status, answer.code, answer.retry_after) == (503, "queue_full", 1)
    assert "route “chat” for model “llama”" in answer.message
    assert "gpu1 full (4/4 running, 8/8 queued); gpu2 full (4/4 running, 8/8 queued)" in (
        answer.message
    )
    body = error(answer)
    assert (body["route"], body["model"], body["code"]) == ("chat", "llama", "queue_full")
    assert [h["name"] for h in body["hosts"]] == ["gpu1", "gpu2"]


def test_a_refusals_detail_gives_each_hosts_counts_as_its_message_does():
    full = host("gpu1", in_flight=3, parallel=3, queued=5, queue_max=5)

    answer = answer_for(queue_full("chat", "llama", [full]))

    assert "gpu1 full (3/3 running, 5/5 queued)" in answer.message
    [shown] = error(answer)["hosts"]
    counts = (shown["state"], shown["running"], shown["parallel"], shown["queued"])
    assert counts + (shown["queue_max"],) == ("full", 3, 3, 5, 5)


def test_a_drained_route_says_how_to_serve_again_and_gives_no_retry_after():
    refusal = no_healthy_host("chat", "llama", [host("gpu1", draining=True)])

    answer = answer_for(refusal)

    assert (answer.code, answer.retry_after) == ("no_healthy_host", None)
    assert "gpu1 draining (health up; takes no new requests)" in answer.message
    assert "Stop draining" in answer.message


def test_a_down_host_is_named_with_since_when_and_why_and_waiting_helps():
    down = host("gpu1", health="down", reason="/health: connection refused")

    answer = answer_for(no_healthy_host("chat", "llama", [down, host("gpu2", enabled=False)]))

    assert answer.retry_after == 2
    assert "gpu1 down since 12:00:00 UTC (/health: connection refused); gpu2 disabled" in (
        answer.message
    )
    [first, _] = error(answer)["hosts"]
    assert first["since"] == "2026-12-02T12:00:00+00:00"
    assert first["reason"] == "/health: connection refused"


def test_a_route_with_no_host_serving_the_model_says_to_add_one():
    answer = answer_for(no_healthy_host("chat", "llama", []))

    assert "it has no host serving it. add one in the admin" in answer.message
    assert answer.retry_after is None


def test_a_strict_routes_drained_host_offers_a_new_conversation_but_no_retry():
    answer = answer_for(pinned_host_down("chat", "llama", host("gpu1", draining=True)))

    assert answer.code == "pinned_host_down" and answer.retry_after is None
    assert "this one's host is gpu1 draining" in answer.message
    assert "start a new conversation" in answer.message and "retry" not in answer.message


def test_an_unknown_model_lists_the_route_models_and_names_the_param():
    answer = answer_for(unknown_model("chat", "gpt-5", ["qwen", "llama"]))

    assert (answer.status, answer.code) == (404, "model_not_found")
    assert "it serves llama, qwen (GET /chat/v1/models lists them)" in answer.message
    assert error(answer) == error(answer) | {
        "param": "model",
        "models": ["llama", "qwen"],
    }


def test_a_long_list_of_hosts_is_cut_in_the_message_but_whole_in_the_detail():
    many = [host(f"h{i}", in_flight=4, queued=8) for i in range(SHOWN + 5)]

    answer = answer_for(queue_full("chat", "llama", many))

    assert answer.message.count(" full (") == SHOWN and "; and 5 more" in answer.message
    assert len(error(answer)["hosts"]) == SHOWN + 5
