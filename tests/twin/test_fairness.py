"""`python -m twin --fairness` (bench/twin/fairness.py): client keys presented through the
view's own access check, their classes ordering a host's line, and the judgement's table."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import replace

from twin.clock import in_virtual_time
from twin.fairness import CASES, one, table, verdicts
from twin.gateway import Policy, TwinGateway
from twin.host import TwinHost
from twin.run import run
from twin.shapes import Conversation, Segment, Turn, Workload

from routing.core.clients import ClientSpec
from routing.core.fairness import Priority
from tests.helpers.twin_profiles import PROFILE

ONE_SLOT = replace(PROFILE, slots=1)
KEYS = {
    "batch": ClientSpec("batch", priority=Priority.BATCH),
    "interactive": ClientSpec("interactive", priority=Priority.INTERACTIVE),
}


def summary(number: int, start: float, client: str) -> Conversation:
    """One request: a document of its own and a 200-token answer (4 s of decoding)."""
    return Conversation(number, start, "chat", client, (Segment(1000 * number, 2000),),
                        (Turn(0.0, (), 200),))  # fmt: skip


def one_slot_run(keys: dict[str, ClientSpec] | None) -> dict[str, list[float]]:
    """Three batch requests at 0, 0.1 and 0.2 s, an interactive one at 0.3 s, on one host of
    one slot: each client's longest wait (s)."""
    talks = (summary(1, 0.0, "batch"), summary(2, 0.1, "batch"), summary(3, 0.2, "batch"),
             summary(4, 0.3, "interactive"))  # fmt: skip

    def made() -> Iterator[Conversation]:
        return iter(talks)

    workload = Workload("test", 7, made, ("chat",), ("batch", "interactive"))
    figures = run(workload, ONE_SLOT, 1, Policy("auto"), keys, by_client=True)
    assert figures.served == 4, figures
    return {c.client: [c.longest_wait_s, c.slot_s] for c in figures.by_client}


def test_an_interactive_keys_request_queued_behind_batch_ones_is_served_next() -> None:
    fair = one_slot_run(KEYS)
    fifo = one_slot_run(None)

    hold = fair["batch"][1] / 3  # one batch request's time in the slot
    # With keys: the interactive request waits only for the batch request running when it
    # came; the two queued before it wait for it too.
    assert fair["interactive"][0] < hold
    assert fair["batch"][0] > 2 * hold
    # Without keys, one first-come line: it waits for all three.
    assert fifo["interactive"][0] > 2 * hold
    assert fifo["batch"][0] < 2 * hold


def test_a_request_without_a_key_is_refused_401_once_keys_are_in_use() -> None:
    keys = {"interactive": KEYS["interactive"]}  # the batch client has no key

    def made() -> Iterator[Conversation]:
        return iter((summary(1, 0.0, "batch"), summary(2, 0.1, "interactive")))

    workload = Workload("test", 7, made, ("chat",), ("batch", "interactive"))
    figures = run(workload, ONE_SLOT, 1, Policy("auto"), keys, by_client=True)

    assert (figures.served, figures.failed) == (1, 1)
    assert figures.client("interactive").served == 1
    # Refused at the door, before its body is read: its row names neither key nor fingerprint.
    assert (figures.client("").requests, figures.client("").refused) == (1, 1)


def test_the_judgement_prints_each_cases_fleet_and_clients_and_five_verdicts() -> None:
    runs = {case.name: [one(case, "gpu-8b", 1, 1, 0.2)] for case in CASES}

    lines = table("title", runs).splitlines()
    verdict_lines = verdicts(runs)

    assert lines[0] == "title"
    assert lines[1].split() == [
        "case", "client", "requests", "served", "refused", "queue_full", "ttfb", "p50", "p95",
        "slot", "s", "wait", "max", "tokens/s", "evaluated",
    ]  # fmt: skip
    rows = [line.split()[:2] for line in lines[2:] if not line.startswith(" ")]
    assert rows == [[case.name, "(fleet)"] for case in CASES]
    clients = [line.split()[0] for line in lines[2:] if line.startswith(" ")]
    assert clients == ["interactive", "batch", "interactive", "standard",
                       "batch", "interactive", "standard", "heavy", "light"]  # fmt: skip
    assert len(verdict_lines) == 5
    assert all(line.split(":")[0] in ("pass", "FAIL") for line in verdict_lines)


def test_the_gateway_times_a_slots_hold_in_virtual_time() -> None:
    """Priced patience weighs how long each slot has been held: in the twin, virtual seconds,
    not the CPU time the run took (which made runs with headroom differ between processes)."""

    async def held_for_ten_virtual_seconds() -> list[float]:
        gateway = TwinGateway({"h0000": TwinHost("h0000", PROFILE, "chat")}, "chat", None,
                              queue_max=8)  # fmt: skip
        running = gateway.runtime.running
        running.placed(running.add("twin", "chat", ""), "h0000", 0, "chat")
        await asyncio.sleep(10.0)
        held = running.holding("h0000", "chat")
        await gateway.aclose()
        return held

    assert in_virtual_time(held_for_ten_virtual_seconds()) == [10.0]


def test_the_same_fair_run_gives_the_same_figures_every_time() -> None:
    fair = next(case for case in CASES if case.name == "fair")

    assert one(fair, "gpu-70b", 1, 2, 0.2) == one(fair, "gpu-70b", 1, 2, 0.2)
