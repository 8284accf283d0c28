"""The twin drives crossbar's own runtime and lifecycle (bench/twin/gateway.py, run.py): what
placement decides shows in the rows it writes, in virtual time."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import replace

import pytest
from twin.clock import in_virtual_time
from twin.gateway import Policy, TwinAsk, TwinGateway, message
from twin.host import TwinHost
from twin.run import one_host, run
from twin.shapes import (
    Conversation,
    Restart,
    Segment,
    Turn,
    Workload,
)

from routing.proxy.record import Outcome
from tests.helpers.twin_profiles import MODEL, PROFILE

SYSTEM = Segment(1, 2000)


def conversation(number: int, start: float, turns: int, pause: float = 5.0) -> Conversation:
    own = Segment(1000 * number, 300)
    later = tuple(Turn(pause, (Segment(1000 * number + k, 200),), 40) for k in range(1, turns))
    return Conversation(number, start, "chat", "default", (SYSTEM, own),
                        (Turn(0.0, (), 40), *later))  # fmt: skip


def workload(*conversations: Conversation, restarts: tuple[Restart, ...] = ()) -> Workload:
    def made() -> Iterator[Conversation]:
        return iter(conversations)

    return Workload("test", 7, made, ("chat",), restarts=restarts)


def test_a_conversations_turns_stay_on_its_host_and_find_their_history_cached() -> None:
    figures = run(workload(conversation(1, 0.0, 4)), PROFILE, 2, Policy("auto"))

    assert (figures.requests, figures.served) == (4, 4)
    assert sorted(figures.shares) == [0.0, 1.0]  # every turn on one host
    # Turn 1 evaluates 2,300 tokens; each later one its 200 new ones (its history, the
    # answer before it included, was cached in its named slot).
    assert figures.evaluated == 2300 + 3 * 200
    assert figures.cached == (2300 + 40) + (2540 + 40) + (2780 + 40)
    assert figures.spills == 0


def test_two_conversations_opening_together_go_to_the_two_hosts_and_stay_there() -> None:
    talks = workload(conversation(1, 0.0, 3), conversation(2, 0.1, 3))
    figures = run(talks, PROFILE, 2, Policy("auto"))

    assert figures.served == 6
    assert figures.shares == (0.5, 0.5)  # the less loaded host for the second, then leases
    # Neither host had answered when the second came, so neither held the shared system
    # prompt yet: each evaluates its whole opening, then only what each turn adds.
    assert figures.evaluated == 2 * (2300 + 2 * 200)


def test_a_host_restarted_midway_loses_its_caches_and_the_conversation_goes_on_elsewhere() -> None:
    restarted = workload(conversation(1, 0.0, 3, pause=20.0), restarts=(Restart(10.0, 0),))
    calm = workload(conversation(1, 0.0, 3, pause=20.0))

    figures = run(restarted, PROFILE, 2, Policy("auto"))
    baseline = run(calm, PROFILE, 2, Policy("auto"))

    assert (figures.served, figures.refused, figures.failed) == (3, 0, 0)
    # Without the restart it stays on h0000; with it, the second turn finds h0000 down (its
    # restart takes 5 s, the poll finds it within 5 s more) or back but empty: either way it
    # is evaluated whole once more.
    assert baseline.shares == (1.0, 0.0)
    assert figures.evaluated == baseline.evaluated + (2300 + 40)


def test_a_run_gives_the_same_figures_every_time() -> None:
    talks = workload(*(conversation(n, n * 0.7, 4, pause=1.0) for n in range(1, 12)))
    first = run(talks, PROFILE, 2, Policy("auto"))
    again = run(talks, PROFILE, 2, Policy("auto"))

    assert first == again
    assert first.queued[1] > 0  # eleven conversations on four slots: some waited


def test_the_one_host_reference_has_the_slots_speed_and_memory_of_the_whole_fleet() -> None:
    fleet = replace(PROFILE, slots=4, cache_ram_mib=100)
    one = one_host(fleet, 3, "chat")

    assert (one.slots, one.cache_ram_mib) == (12, 300)
    speeds = one.models["chat"]
    assert speeds.prefill_tps == pytest.approx(3 * MODEL.prefill_tps)
    # n streams on one host of three hosts' compute go as n/3 streams (rounded up) on one.
    assert speeds.decode_tps == (50.0, 50.0, 50.0, 45.0, 45.0, 45.0)


def test_a_request_that_finds_its_host_down_before_any_poll_marks_it_down_and_goes_elsewhere() -> (
    None
):
    """The host restarted and no poll has seen it yet: the request's own connection, refused,
    marks it down (as the real `forward` does), and the request is placed again on the other
    host, at once rather than after a poll interval."""

    async def main() -> tuple[Outcome, bool, float]:
        loop = asyncio.get_running_loop()
        hosts = {name: TwinHost(name, PROFILE, "chat") for name in ("h0", "h1")}
        gateway = TwinGateway(hosts, "chat", None, queue_max=4, poll_interval=600.0)
        prompt = (SYSTEM, Segment(1000, 300))
        messages = [message(SYSTEM, "system"), message(prompt[1], "user")]
        first = await gateway.ask(TwinAsk(prompt, messages, 10, Segment(-1, 10)))
        assert first.status == 200
        home = next(name for name, twin in hosts.items() if twin.slots[0].holds_tokens
                    or twin.slots[1].holds_tokens)  # fmt: skip
        hosts[home].go_down()
        began = loop.time()
        again = await asyncio.wait_for(
            gateway.ask(TwinAsk(prompt, messages, 10, Segment(-2, 10))), timeout=30.0
        )
        eligible = gateway.runtime.health.eligible(home)
        await gateway.aclose()
        return again, eligible, loop.time() - began

    again, eligible, took = in_virtual_time(main())
    assert again.status == 200
    assert not eligible
    assert took < 5.0  # its cold start and its answer elsewhere, not a poll interval (600 s)
