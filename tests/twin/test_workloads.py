"""The twin's workloads (bench/twin/workloads.py): seeded, lazy, sized to the fleet."""

from __future__ import annotations

import hashlib
import itertools
import tracemalloc
from collections import Counter
from collections.abc import Iterable

import pytest
from cache_workload import make_workload
from twin.host import common
from twin.shapes import Conversation, Workload
from twin.workloads import BENCH_SHAPE, CALIBRATION_NUMBERS, OWN_IDS, WORKLOADS, Scale

SMALL = Scale(hosts=2, slots=2, minutes=3)


def digest(workload: Workload, conversations: Iterable[Conversation]) -> str:
    head = (workload.name, workload.seed, workload.models, workload.clients, workload.restarts)
    text = repr(head) + "".join(repr(conversation) for conversation in conversations)
    return hashlib.sha256(text.encode()).hexdigest()


def every(name: str, seed: int = 1, scale: Scale = SMALL) -> list[Conversation]:
    return list(WORKLOADS[name](seed, scale).conversations())


@pytest.mark.parametrize("name", WORKLOADS)
def test_the_same_seed_and_scale_give_the_same_conversations(name: str) -> None:
    first, second = WORKLOADS[name](7, SMALL), WORKLOADS[name](7, SMALL)
    assert digest(first, first.conversations()) == digest(second, second.conversations())


@pytest.mark.parametrize("name", WORKLOADS)
def test_another_seed_gives_other_conversations(name: str) -> None:
    one, other = WORKLOADS[name](1, SMALL), WORKLOADS[name](2, SMALL)
    assert digest(one, one.conversations()) != digest(one, other.conversations())


@pytest.mark.parametrize("name", WORKLOADS)
def test_each_call_of_the_factory_yields_the_same_conversations_again(name: str) -> None:
    workload = WORKLOADS[name](3, SMALL)
    first = list(workload.conversations())
    assert first and list(workload.conversations()) == first


@pytest.mark.parametrize("name", WORKLOADS)
def test_conversations_come_in_order_of_their_start(name: str) -> None:
    starts = [conversation.start for conversation in every(name)]
    assert starts == sorted(starts)


@pytest.mark.parametrize("name", WORKLOADS)
def test_a_conversations_own_segments_appear_in_no_other_and_shared_ones_are_few(
    name: str,
) -> None:
    owners: dict[int, set[int]] = {}
    for conversation in every(name):
        segments = [*conversation.opening, *(s for turn in conversation.turns for s in turn.added)]
        for segment in segments:
            owners.setdefault(segment.id, set()).add(conversation.id)
    assert all(len(owners[id_]) == 1 for id_ in owners if id_ >= OWN_IDS)
    shared = [id_ for id_ in owners if id_ < OWN_IDS]
    numbers = [id_ for id_ in shared if CALIBRATION_NUMBERS <= id_]  # calibration's task numbers
    assert len(shared) - len(numbers) <= 4


@pytest.mark.parametrize("name", WORKLOADS)
def test_each_turn_after_the_first_waits_and_adds_to_the_prompt(name: str) -> None:
    for conversation in every(name):
        assert conversation.turns[0].pause == 0 and conversation.opening
        assert all(turn.pause >= 0 and turn.added for turn in conversation.turns[1:])
        assert all(turn.max_tokens > 0 for turn in conversation.turns)


def test_every_agent_opens_with_the_same_system_prompt_and_a_task_of_its_own() -> None:
    conversations = every("agent")
    assert len({conversation.opening[0] for conversation in conversations}) == 1
    assert 3000 <= conversations[0].opening[0].tokens <= 6000
    assert all(conversation.opening[1].id >= OWN_IDS for conversation in conversations)
    assert all(5 <= len(conversation.turns) <= 30 for conversation in conversations)
    later = [turn for conversation in conversations for turn in conversation.turns[1:]]
    assert all(turn.keeps_answer and 1 <= turn.pause <= 20 for turn in later)


def test_no_two_long_docs_conversations_share_a_segment() -> None:
    seen: Counter[int] = Counter()
    for conversation in every("long_docs"):
        ids = {s.id for s in conversation.opening}
        ids |= {s.id for turn in conversation.turns for s in turn.added}
        seen.update(ids)
    assert seen and max(seen.values()) == 1


def test_the_arrivals_grow_with_the_fleet_for_the_same_load() -> None:
    def arrivals(hosts: int) -> int:
        return sum(1 for _ in WORKLOADS["agent"](1, Scale(hosts, 2, minutes=10)).conversations())

    small, large = arrivals(2), arrivals(20)
    assert 5 * small < large < 20 * small


def test_a_restart_comes_at_40_percent_and_on_more_than_two_hosts_another_at_70() -> None:
    two = WORKLOADS["restart"](1, Scale(2, 2, minutes=10))
    assert [restart.at for restart in two.restarts] == [240.0]
    more = WORKLOADS["restart"](1, Scale(4, 2, minutes=10))
    assert [restart.at for restart in more.restarts] == [240.0, 420.0]
    assert more.restarts[0].host != more.restarts[1].host
    agent = WORKLOADS["agent"](1, Scale(4, 2, minutes=10))
    assert list(more.conversations()) == list(agent.conversations())


def test_a_burst_brings_two_to_four_times_the_fleets_slots_within_seconds() -> None:
    conversations = every("bursts", scale=Scale(2, 2, minutes=4))
    first = [conversation for conversation in conversations if conversation.start < 180]
    assert 8 <= len(first) <= 16 and max(c.start for c in first) < 10
    assert min(c.start for c in conversations if c.start >= 180) < 190


def test_demand_moves_from_one_model_to_another_over_at_least_three() -> None:
    workload = WORKLOADS["models_shift"](1, Scale(4, 4, minutes=6))
    assert len(workload.models) == 3
    phases = [Counter(c.model for c in workload.conversations() if c.start // 180 == phase)
              for phase in (0, 1)]  # fmt: skip
    assert phases[0].most_common(1)[0][0] != phases[1].most_common(1)[0][0]
    assert all(len(phase) == 3 for phase in phases)


def test_the_batch_client_floods_with_one_turn_summaries_beside_two_others() -> None:
    workload = WORKLOADS["clients"](1, SMALL)
    conversations = list(workload.conversations())
    by_client = Counter(conversation.client for conversation in conversations)
    assert set(by_client) == set(workload.clients) == {"interactive", "batch", "standard"}
    assert by_client["batch"] > by_client["interactive"]
    batch = [c for c in conversations if c.client == "batch"]
    assert all(len(c.turns) == 1 and c.opening[0].tokens >= 3000 for c in batch)


def test_few_has_half_as_many_conversations_as_slots_each_lasting_the_run() -> None:
    conversations = every("few", scale=Scale(4, 4, minutes=10))
    assert len(conversations) == 8
    for conversation in conversations:
        assert sum(turn.pause for turn in conversation.turns) > 300


@pytest.mark.parametrize("name", WORKLOADS)
def test_the_first_ten_conversations_of_a_million_come_without_making_the_rest(name: str) -> None:
    workload = WORKLOADS[name](1, Scale(hosts=2000, slots=8, minutes=150))
    tracemalloc.start()
    try:
        first = list(itertools.islice(workload.conversations(), 10))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(first) == 10
    assert peak < 8 * 2**20


def test_calibration_sends_bench_caches_default_turns_messages_starts_and_pauses() -> None:
    bench = sorted(make_workload(BENCH_SHAPE, 0).conversations, key=lambda c: c.start)
    twin = every("calibration", seed=0)
    assert (len(twin), sum(len(c.turns) for c in twin)) == (24, 144)
    assert [(c.id, c.start) for c in twin] == [(c.number, c.start) for c in bench]
    for ours, theirs in zip(twin, bench, strict=True):
        pauses = [0.0, *(turn.pause_after for turn in theirs.turns[:-1])]
        assert [turn.pause for turn in ours.turns] == pauses
        # The opening is two messages: the system message, then the task (its number's digits
        # segments of their own, a token each).
        assert len(ours.opening) == 2 + len(str(ours.id))
        messages = [2 + sum(len(t.added) for t in ours.turns[: n + 1])
                    for n in range(len(ours.turns))]  # fmt: skip
        assert messages == [len(turn.messages) for turn in theirs.turns]
        assert not any(turn.keeps_answer for turn in ours.turns[1:])
        assert all(turn.max_tokens == 96 for turn in ours.turns)


def test_calibrations_shared_opening_reckons_near_the_1676_tokens_the_bench_measured() -> None:
    openings = {conversation.opening[0] for conversation in every("calibration", seed=0)}
    assert len(openings) == 1
    assert abs(openings.pop().tokens - 1676) / 1676 < 0.02


def test_calibrations_tasks_share_their_numbers_leading_digits_as_llama_tokenizes_them() -> None:
    """`Task 1: ...`, `Task 10: ...` and `Task 11: ...` share `Task 1` (a token a digit), one
    token more than each shares with `Task 0: ...` or `Task 20: ...`."""
    openings = {conversation.id: conversation.opening for conversation in every("calibration", 0)}

    def shared(one: int, other: int) -> int:
        return common(openings[one], openings[other])

    everyones = shared(0, 3)
    assert everyones == openings[0][0].tokens
    assert shared(1, 10) == shared(10, 11) == shared(2, 23) == everyones + 1
    assert shared(0, 10) == shared(10, 20) == shared(1, 2) == everyones
