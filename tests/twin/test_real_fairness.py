"""`make bench-fairness` (bench/bench_fairness.py, bench/fairness_workload.py): the rates a
calibration gives, the workloads the cases send, the keys the gateway is given. The real
llama-servers themselves are the benchmark's, never the suite's."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime

import pytest
from bench_fairness import CLIENTS, key_of, make_keys, split, to_first_byte
from fairness_workload import INTERACTIVE, SUMMARY, Calibration, conversations, rate, workload

from accounting.keys import hash_key
from accounting.models import ClientKey
from accounting.rows import RequestRecord
from routing.core.fingerprint import fingerprint

# A fleet of 4 slots where a chat's turn holds its slot 0.5 s and a summary 2 s.
MEASURED = Calibration(4, {INTERACTIVE.name: 0.5, SUMMARY.name: 2.0})


def test_a_client_at_4x_the_slots_sends_four_times_what_keeps_every_slot_busy() -> None:
    assert rate(4.0, SUMMARY, MEASURED) == pytest.approx(4.0 * 4 / 2.0)
    # A chat holds a slot for each of its turns: 3.5 turns of 0.5 s on average.
    assert rate(0.3, INTERACTIVE, MEASURED) == pytest.approx(0.3 * 4 / (3.5 * 0.5))


def test_a_clients_arrivals_come_at_its_rate() -> None:
    every = rate(4.0, SUMMARY, MEASURED)  # 8 a second
    arrivals = workload(1, 600.0, {"batch": (SUMMARY, 4.0)}, MEASURED)
    assert len(arrivals) / 600.0 == pytest.approx(every, rel=0.05)
    assert [chat.start for chat in arrivals] == sorted(chat.start for chat in arrivals)
    assert all(chat.start < 600.0 for chat in arrivals)


def test_the_interactive_chats_are_the_same_alone_and_beside_the_flood() -> None:
    alone = workload(1, 120.0, CLIENTS["alone"], MEASURED)
    beside = workload(1, 120.0, CLIENTS["fair"], MEASURED)
    assert alone == [chat for chat in beside if chat.client == "interactive"]
    assert {chat.client for chat in beside} == {"interactive", "batch"}


def test_each_turn_of_a_chat_begins_with_the_whole_prompt_before_it() -> None:
    chats = itertools.islice(conversations(1, "interactive", INTERACTIVE, 1.0), 20)
    for chat in chats:
        prompts = [turn.messages for turn in chat.turns]
        assert all(later[: len(earlier)] == earlier
                   for earlier, later in itertools.pairwise(prompts))  # fmt: skip
        # One conversation: every turn has the fingerprint of the first (one lease, one cache).
        names = {fingerprint("POST", {"messages": list(p)}, None) for p in prompts}
        assert len(names) == 1
        assert prompts[0][0]["role"] == "system"


def test_a_summary_is_one_long_request_that_fits_a_tiny_model_slot() -> None:
    for chat in itertools.islice(conversations(1, "batch", SUMMARY, 1.0), 50):
        (turn,) = chat.turns
        words = len(turn.messages[-1]["content"].split())
        # About a token a word: the prompt and its answer within a slot's 4,096 tokens.
        assert 1500 <= words <= 2800 + 4
        assert words + turn.max_tokens < 3400


@pytest.mark.django_db
def test_the_keys_made_for_a_case_are_the_twins_classes_and_weights() -> None:
    from django.core.management import call_command

    for command, _, script in make_keys("weights"):
        call_command(command, command=script)
    keys = {key.name: key for key in ClientKey.objects.all()}
    assert (keys["light"].priority, keys["light"].weight) == ("standard", 1.0)
    assert (keys["heavy"].priority, keys["heavy"].weight) == ("standard", 2.0)
    assert keys["heavy"].key_hash == hash_key(key_of("heavy"))
    assert make_keys("fifo") == []


def row(name: str, status: int = 200, head_ms: int | None = 5, queued_ms: int = 0) -> RequestRecord:
    return RequestRecord("bench", name, "m", "h1", datetime.now(UTC), queued_ms, head_ms, 900,
                         status, True, "new", 10, 0, 5)  # fmt: skip


def test_a_rows_ttfb_becomes_the_first_body_byte_of_the_request_sent_in_its_place() -> None:
    # Chat `a`'s two turns and summary `b`'s refused one, as written; the bench's times by
    # fingerprint in the order sent.
    heads = [row("a", queued_ms=40), row("b", 503, None), row("a", head_ms=7)]
    firsts: dict[str, list[float | None]] = {"a": [120.4, 80.0], "b": [None]}
    records = to_first_byte(heads, firsts)
    assert [r.ttfb_ms for r in records] == [120, None, 80]
    waited = split(records, heads, {"a": "interactive", "b": "batch"})
    assert waited == {"interactive": {"queued": [0.0, 0.04], "head": [0.005, 0.007],
                                      "first_byte": [0.08, 0.12],
                                      "granted": [0.08, 0.08]}}  # fmt: skip


def test_a_row_the_bench_has_no_time_for_keeps_its_head_time() -> None:
    assert to_first_byte([row("a"), row("a")], {"a": [50.0]})[1].ttfb_ms == 5
