"""Placement over an in-memory fleet: which host serves a request, why, and what it holds.

`MemoryFleet` is the `routing.core.placement.Fleet` protocol over plain dicts of hosts, with a
real `Limiter` and a real `LeaseTable`, and no Django. Timers are real loop timers kept short
(patience, fallback_after, queue_timeout of 0.05 s); a test waits for its outcome with a
generous timeout and asserts only that a deadline had passed, never how long anything took.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from routing.core.choose import Candidate
from routing.core.errors import NoHealthyHost, PinnedHostDown, QueueFull, QueueTimeout, answer_for
from routing.core.leases import LeaseKey, LeaseOutcome, LeaseTable
from routing.core.limiter import Limiter, Slot
from routing.core.pairs import Pair
from routing.core.placement import Placement, Placer, Reason, Waiting
from routing.core.prefixes import PrefixIndex
from routing.core.ranking import Ranking, Rankings
from routing.core.state import Held, LocalState

MODEL = "llama3"
SHORT = 0.05  # seconds: patience, fallback_after or queue_timeout when a test needs it to pass
LONG = 300.0  # seconds: a deadline no test reaches
WAIT = 10.0  # seconds a test waits for an outcome before failing (a busy machine is slow)
# asyncio may run a timer up to its clock's resolution early: "after the deadline" allows that.
EARLY = 1e-3


@dataclass(slots=True, frozen=True)
class Route:
    """A route as placement reads it (`RouteRules`); every deadline is long unless changed."""

    name: str = "chat"
    hosts: tuple[str, ...] = ("gpu1", "gpu2")
    lease_ttl: float = 60.0
    strict: bool = False
    queue_timeout: float = LONG
    lease_patience: float | None = LONG  # None: auto (tests/core/test_priced_patience.py)
    fallback: str = ""
    fallback_after: float = LONG
    fallback_model: str = ""


def host(
    parallel: int = 1,
    queue_max: int = 0,
    *,
    model: str = MODEL,
    healthy: bool = True,
    draining: bool = False,
    weight: float = 1.0,
) -> dict[str, Any]:
    """A host as a plain dict: its state, and the one model it serves with its limits."""
    return {
        "healthy": healthy,
        "draining": draining,
        "weight": weight,
        "models": {model: {"parallel": parallel, "queue_max": queue_max}},
    }


class MemoryFleet:
    """`routing.core.placement.Fleet` over plain dicts: hosts by name, routes by name.

    Its rankings are kept as the runtime keeps them (routing/core/ranking.py): the limiter and
    the lease table touch a host whose counts change, and a change of a host's dict must go
    through `mark` or `set_host` (as the runtime's health table and reloads touch it)."""

    def __init__(self, hosts: dict[str, dict[str, Any]], *routes: Route) -> None:
        self.rankings = Rankings(self.candidate)
        self.limiter = Limiter(on_change=self.rankings.touch)
        self.leases = LeaseTable(on_change=self.rankings.touch)
        self.state = LocalState(self.limiter, self.leases)
        self.prefixes = PrefixIndex(10_000)
        self.prefix_margin = 1
        self.hosts = hosts
        self.routes = {route.name: route for route in routes}
        for name, spec in hosts.items():
            for model, limits in spec["models"].items():
                self.limiter.configure(name, model, limits["parallel"], limits["queue_max"])

    def candidate(self, name: str, model: str | None) -> Candidate | None:
        spec = self.hosts.get(name)
        if spec is None:
            return None
        serves = model in spec["models"]
        state = self.state
        return Candidate(
            host=name,
            healthy=spec["healthy"],
            draining=spec["draining"],
            loaded=serves,
            can_serve=serves,
            free=state.free_for(name, model) if serves and model is not None else 0,
            queued=state.queued(name, model) if model is not None else 0,
            weight=spec["weight"],
            leases=state.leases_held(name),
        )

    def candidates(self, route: Route, model: str) -> list[Candidate]:
        """The route's hosts from scratch: `choose.ranked` of these is what `ranking` keeps."""
        return [c for name in route.hosts if (c := self.candidate(name, model)) is not None]

    def ranking(self, route: Route, model: str) -> Ranking:
        self.state.expire_leases()
        return self.rankings.of(route.name, route.hosts, model)

    def usable(self, route: Route, model: str, host: str) -> bool:
        spec = self.hosts.get(host)
        return (
            spec is not None
            and host in route.hosts
            and spec["healthy"]
            and not spec["draining"]
            and model in spec["models"]
        )

    def serves(self, route: Route, model: str) -> bool:
        """Whether a host of `route` lists `model` (as `LiveFleet.serves`)."""
        return any(
            model in self.hosts[name]["models"] for name in route.hosts if name in self.hosts
        )

    def fallback_of(self, route: Route) -> Route | None:
        return self.routes.get(route.fallback) if route.fallback else None

    def mark(self, name: str, **state: Any) -> None:
        """Change a host's state, as a health answer or a reload changes it (the rankings
        hear of it)."""
        self.hosts[name].update(state)
        self.rankings.touch(name)

    def set_host(self, name: str, **state: Any) -> None:
        """`mark`; then offer its slots again through the fleet's state, as the runtime's
        health table does (so `LocalState.wake` is on the tested path too)."""
        self.mark(name, **state)
        self.state.wake(name)

    def occupy(self, name: str, model: str = MODEL) -> Slot:
        """Hold one slot of the host from outside placement (another client's request)."""
        got = self.limiter.place([Pair(name, model)])
        assert isinstance(got, Slot), f"{name} has no free slot for {model}"
        return got


def placer(
    fleet: MemoryFleet,
    route: Route,
    fingerprint: str = "conversation",
    prompt: tuple[int, ...] = (),
) -> Placer:
    return Placer(fleet, route, MODEL, fingerprint, asyncio.get_running_loop().time(), prompt)


async def placed(
    fleet: MemoryFleet,
    route: Route,
    fingerprint: str = "conversation",
    prompt: tuple[int, ...] = (),
) -> Placement:
    got = await placer(fleet, route, fingerprint, prompt).now()
    assert isinstance(got, Placement), f"expected a slot at once, got {got!r}"
    return got


def lease_of(fleet: MemoryFleet, route: Route, fingerprint: str = "conversation") -> str | None:
    return fleet.leases.find(LeaseKey(route.name, fingerprint, MODEL))


async def settle(rounds: int = 5) -> None:
    for _ in range(rounds):
        await asyncio.sleep(0)


def assert_nothing_held(fleet: MemoryFleet) -> None:
    """No slot held, nobody queued, and no waiter left behind that a free slot would go to."""
    snapshot = fleet.limiter.snapshot()
    assert [(s.host, s.model, s.in_flight, s.queued) for s in snapshot] == [
        (s.host, s.model, 0, 0) for s in snapshot
    ]
    for snap in snapshot:
        # Every slot can be taken and given back; a forgotten waiter would be handed one.
        slots = [fleet.occupy(snap.host, snap.model) for _ in range(snap.parallel)]
        for slot in slots:
            slot.release()
        assert fleet.limiter.in_flight(snap.host, snap.model) == 0, snap


# -- the home host, and new conversations --------------------------------------------------


async def test_a_conversation_returns_to_its_home_host() -> None:
    route = Route()
    fleet = MemoryFleet({"gpu1": host(parallel=2), "gpu2": host(parallel=4)}, route)
    first = await placed(fleet, route)
    assert (first.host, first.reason, first.lease) == ("gpu2", Reason.NEW, LeaseOutcome.NEW)
    first.slot.release()
    busy = [fleet.occupy("gpu2") for _ in range(3)]  # gpu1 has more free slots now

    again = await placed(fleet, route)
    stranger = await placed(fleet, route, "another conversation")

    assert (again.host, again.reason, again.lease) == ("gpu2", Reason.HOME, LeaseOutcome.REUSED)
    assert (again.route, again.model) == ("chat", MODEL)
    assert stranger.host == "gpu1"
    assert lease_of(fleet, route) == "gpu2"
    for slot in [again.slot, stranger.slot, *busy]:
        slot.release()
    assert_nothing_held(fleet)


async def test_a_slot_taken_at_once_reports_no_time_waited() -> None:
    route = Route()
    fleet = MemoryFleet({"gpu1": host(), "gpu2": host()}, route)

    got = await placed(fleet, route)
    again = await placed(fleet, route, "another conversation")

    assert (got.waited, again.waited) == (0.0, 0.0)


async def test_a_new_conversation_goes_to_the_host_with_most_free_slots() -> None:
    route = Route(hosts=("gpu1", "gpu2", "gpu3"))
    fleet = MemoryFleet(
        {"gpu1": host(parallel=2), "gpu2": host(parallel=4), "gpu3": host(parallel=3)}, route
    )

    got = await placed(fleet, route)

    assert (got.host, got.reason, got.lease) == ("gpu2", Reason.NEW, LeaseOutcome.NEW)
    assert lease_of(fleet, route) == "gpu2"
    assert fleet.limiter.in_flight("gpu2", MODEL) == 1


async def test_ties_go_to_the_host_with_fewer_leases_so_lone_conversations_spread() -> None:
    route = Route(hosts=("gpu1", "gpu2", "gpu3"))
    fleet = MemoryFleet({name: host(parallel=2) for name in route.hosts}, route)
    hosts = []

    for number in range(6):
        got = await placed(fleet, route, f"conversation {number}")
        hosts.append(got.host)
        got.slot.release()  # each conversation is done before the next arrives

    assert hosts == ["gpu1", "gpu2", "gpu3", "gpu1", "gpu2", "gpu3"]
    assert fleet.leases.held_by_host() == {"gpu1": 2, "gpu2": 2, "gpu3": 2}


async def test_a_request_without_a_conversation_is_placed_but_never_leased() -> None:
    route = Route()
    fleet = MemoryFleet({"gpu1": host(), "gpu2": host()}, route)

    got = await placed(fleet, route, fingerprint="")

    assert (got.reason, got.lease) == (Reason.NONE, LeaseOutcome.NONE)
    assert len(fleet.leases) == 0


# -- prefix affinity -----------------------------------------------------------------------

PROMPT = (11, 12, 13, 14, 15, 16)  # a prompt's block chain (routing/core/prefixes.py)


async def test_a_new_conversation_goes_to_the_host_holding_more_of_its_prompt() -> None:
    route = Route()
    fleet = MemoryFleet({"gpu1": host(parallel=2), "gpu2": host(parallel=2)}, route)
    fleet.prefixes.learn("gpu1", MODEL, PROMPT[:2])  # the system prompt, say
    fleet.prefixes.learn("gpu2", MODEL, PROMPT[:5])  # and the document after it

    got = await placed(fleet, route, prompt=PROMPT)

    assert (got.host, got.reason, got.lease) == ("gpu2", Reason.PREFIX, LeaseOutcome.NEW)
    assert lease_of(fleet, route) == "gpu2"


async def test_a_request_without_a_conversation_goes_where_its_prompt_is_cached_too() -> None:
    route = Route()
    fleet = MemoryFleet({"gpu1": host(), "gpu2": host()}, route)
    fleet.prefixes.learn("gpu2", MODEL, PROMPT)

    got = await placed(fleet, route, fingerprint="", prompt=PROMPT)

    assert (got.host, got.reason, got.lease) == ("gpu2", Reason.PREFIX, LeaseOutcome.NONE)
    assert len(fleet.leases) == 0


async def test_hosts_holding_as_much_of_the_prompt_keep_the_rankings_order() -> None:
    route = Route()
    fleet = MemoryFleet({"gpu1": host(), "gpu2": host()}, route)
    for name in route.hosts:
        fleet.prefixes.learn(name, MODEL, PROMPT[:3])

    got = await placed(fleet, route, prompt=PROMPT)

    assert (got.host, got.reason) == ("gpu1", Reason.NEW)


@pytest.mark.parametrize(("busy", "expected"), [(1, "gpu2"), (2, "gpu1")])
async def test_the_host_holding_the_prompt_goes_first_only_within_the_load_margin(
    busy: int, expected: str
) -> None:
    route = Route()
    fleet = MemoryFleet({"gpu1": host(parallel=4), "gpu2": host(parallel=4)}, route)
    fleet.prefixes.learn("gpu2", MODEL, PROMPT)
    held = [fleet.occupy("gpu2") for _ in range(busy)]  # the margin is 1 request

    got = await placed(fleet, route, prompt=PROMPT)

    assert got.host == expected
    assert got.reason == (Reason.PREFIX if expected == "gpu2" else Reason.NEW)
    for slot in [got.slot, *held]:
        slot.release()
    assert_nothing_held(fleet)


async def test_conversations_sharing_a_system_prompt_spread_over_the_hosts() -> None:
    route = Route()
    fleet = MemoryFleet({"gpu1": host(parallel=2), "gpu2": host(parallel=2)}, route)
    system = PROMPT[:3]
    fleet.prefixes.learn("gpu1", MODEL, system)  # one host holds the system prompt
    went = []

    for number in range(8):
        prompt = (*system, 100 + number)  # the system prompt, then the conversation's own
        got = await placed(fleet, route, f"conversation {number}", prompt)
        fleet.prefixes.learn(got.host, MODEL, prompt)  # as the answer teaches the index
        went.append((got.host, got.reason))
        got.slot.release()  # each is done before the next arrives

    # The second joins the first where the prompt is cached (a lease ahead: within the
    # margin); the third would put gpu1 two ahead, so it goes to gpu2, which then holds the
    # prompt too, and the ranking's spread takes over.
    assert went[:3] == [("gpu1", Reason.NEW), ("gpu1", Reason.PREFIX), ("gpu2", Reason.NEW)]
    assert fleet.leases.held_by_host() == {"gpu1": 4, "gpu2": 4}


@pytest.mark.parametrize(("leased_on_gpu2", "expected"), [(0, ("gpu2", Reason.NEW)),
                                                        (3, ("gpu1", Reason.PREFIX))])  # fmt: skip
async def test_a_host_whose_slots_all_hold_leased_conversations_takes_no_other_by_prefix(
    leased_on_gpu2: int, expected: tuple[str, Reason]
) -> None:
    # gpu1 holds the prompt, and as many conversations leased as it has slots: one more would
    # overwrite one of theirs. With room on gpu2 (ranked first: more free slots) the request
    # goes there, however wide the margin; with gpu2 as full of conversations, the cache
    # decides again.
    route = Route()
    fleet = MemoryFleet({"gpu1": host(parallel=2), "gpu2": host(parallel=3)}, route)
    fleet.prefixes.learn("gpu1", MODEL, PROMPT)
    fleet.prefix_margin = 5
    leased = {"gpu1": 2, "gpu2": leased_on_gpu2}
    for name, count in leased.items():
        for number in range(count):
            fleet.leases.keep(LeaseKey(route.name, f"{name} {number}", MODEL), name, LONG)

    got = await placed(fleet, route, "a new conversation", PROMPT)

    assert (got.host, got.reason) == expected
    got.slot.release()
    assert_nothing_held(fleet)


async def test_when_every_host_is_full_a_new_conversation_joins_the_host_holding_fewer() -> None:
    # gpu1 holds the shared opening and one conversation more than gpu2; neither has a slot
    # free. Its cache would save one prefill, but every turn of the conversation would wait
    # in the longer line: it goes to gpu2, within the margin or not.
    route = Route()
    fleet = MemoryFleet({"gpu1": host(2, 8), "gpu2": host(2, 8)}, route)
    fleet.prefixes.learn("gpu1", MODEL, PROMPT)
    held = [fleet.occupy(name) for name in ("gpu1", "gpu2") for _ in range(2)]
    for name, count in {"gpu1": 3, "gpu2": 2}.items():
        for number in range(count):
            fleet.leases.keep(LeaseKey(route.name, f"{name} {number}", MODEL), name, LONG)

    got = await placer(fleet, route, "a new conversation", PROMPT).now()

    assert isinstance(got, Waiting)
    assert (got.host, got.reason) == ("gpu2", Reason.NEW)
    got.waiter.cancel()
    for slot in held:
        slot.release()
    assert_nothing_held(fleet)


async def test_a_full_host_holding_the_prompt_leaves_the_request_to_a_free_one() -> None:
    route = Route()
    fleet = MemoryFleet({"gpu1": host(queue_max=1), "gpu2": host(queue_max=1)}, route)
    fleet.prefixes.learn("gpu2", MODEL, PROMPT)
    fleet.prefix_margin = 5
    held = fleet.occupy("gpu2")

    got = await placed(fleet, route, prompt=PROMPT)

    assert (got.host, got.reason) == ("gpu1", Reason.NEW)
    for slot in (got.slot, held):
        slot.release()


async def test_with_every_host_full_the_request_queues_where_its_prompt_is_cached() -> None:
    route = Route()
    fleet = MemoryFleet({"gpu1": host(queue_max=1), "gpu2": host(queue_max=1)}, route)
    fleet.prefixes.learn("gpu2", MODEL, PROMPT)
    held = [fleet.occupy("gpu1"), fleet.occupy("gpu2")]

    request = placer(fleet, route, prompt=PROMPT)
    waiting = await request.now()

    assert isinstance(waiting, Waiting)
    assert (waiting.host, waiting.reason) == ("gpu2", Reason.PREFIX)
    held[1].release()
    got = await asyncio.wait_for(request.wait(waiting), WAIT)
    assert (got.host, got.reason, got.lease) == ("gpu2", Reason.PREFIX, LeaseOutcome.NEW)
    assert lease_of(fleet, route) == "gpu2"
    for slot in (got.slot, held[0]):
        slot.release()
    assert_nothing_held(fleet)


# -- a busy home: waiting, patience and spilling -------------------------------------------


async def test_home_busy_with_queue_room_waits_at_home_for_its_slot() -> None:
    route = Route(lease_patience=LONG)
    fleet = MemoryFleet({"gpu1": host(queue_max=1), "gpu2": host(queue_max=1)}, route)
    first_turn = await placed(fleet, route)
    assert first_turn.host == "gpu1"

    waiting = await (second := placer(fleet, route)).now()
    assert isinstance(waiting, Waiting)
    assert (waiting.host, waiting.reason, waiting.lease) == (
        "gpu1", Reason.HOME, LeaseOutcome.REUSED,
    )  # fmt: skip
    task = asyncio.create_task(second.wait(waiting))
    await settle()
    assert not task.done()  # gpu2's free slot is not taken while patience lasts
    assert fleet.limiter.free_for("gpu2", MODEL) == 1
    first_turn.slot.release()
    got = await asyncio.wait_for(task, WAIT)

    assert (got.host, got.reason, got.lease) == ("gpu1", Reason.HOME, LeaseOutcome.REUSED)
    got.slot.release()
    assert_nothing_held(fleet)


async def test_home_busy_takes_a_slot_freed_on_another_host_after_lease_patience() -> None:
    route = Route(lease_patience=SHORT)
    fleet = MemoryFleet({"gpu1": host(queue_max=1), "gpu2": host(queue_max=1)}, route)
    first_turn = await placed(fleet, route)
    other = fleet.occupy("gpu2")
    waiting = await (second := placer(fleet, route)).now()
    assert isinstance(waiting, Waiting) and waiting.host == "gpu1"
    task = asyncio.create_task(second.wait(waiting))
    await settle()

    other.release()
    got = await asyncio.wait_for(task, WAIT)

    assert (got.host, got.reason, got.lease) == ("gpu2", Reason.SPILLED, LeaseOutcome.SPILLED)
    assert got.waited >= SHORT - EARLY
    assert lease_of(fleet, route) == "gpu1"  # the lease stays with the cache-warm host
    assert fleet.limiter.queued("gpu1", MODEL) == 0
    first_turn.slot.release()
    got.slot.release()
    third_turn = await placed(fleet, route)
    assert (third_turn.host, third_turn.reason) == ("gpu1", Reason.HOME)
    third_turn.slot.release()
    assert_nothing_held(fleet)


@pytest.mark.parametrize(("at_home", "elsewhere", "leased_to"), [(4, 1, "gpu2"), (3, 2, "gpu1")])
async def test_a_turn_spilled_from_a_home_holding_more_conversations_takes_its_lease_along(
    at_home: int, elsewhere: int, leased_to: str
) -> None:
    # gpu1 holds `at_home` conversations (this one among them), gpu2 `elsewhere`, two slots
    # each. A turn that waited at gpu1 past its patience runs on gpu2, which holds its history
    # from then on. Kept at gpu1, its next turns would wait in the longer line every time (a
    # restart moved 10 of 12 conversations onto one host, and they stayed); so the lease goes
    # along when that brings the two hosts' conversations closer, and stays home otherwise.
    route = Route(lease_patience=SHORT)
    fleet = MemoryFleet({"gpu1": host(2, 8), "gpu2": host(2, 8)}, route)
    (await placed(fleet, route)).slot.release()
    for name, count in {"gpu1": at_home - 1, "gpu2": elsewhere}.items():
        for number in range(count):
            fleet.leases.keep(LeaseKey(route.name, f"{name} {number}", MODEL), name, LONG)
    held = [fleet.occupy(name) for name in ("gpu1", "gpu2") for _ in range(2)]
    waiting = await (turn := placer(fleet, route)).now()
    assert isinstance(waiting, Waiting) and (waiting.host, waiting.reason) == ("gpu1", Reason.HOME)
    task = asyncio.create_task(turn.wait(waiting))
    loop = asyncio.get_running_loop()
    await asyncio.sleep(turn.started + SHORT + SHORT / 5 - loop.time())  # patience spent
    await settle()

    held.pop().release()  # a slot of gpu2
    got = await asyncio.wait_for(task, WAIT)

    moved = leased_to == "gpu2"
    assert (got.host, got.reason) == ("gpu2", Reason.SPILLED)
    assert got.lease is (LeaseOutcome.MOVED if moved else LeaseOutcome.SPILLED)
    assert lease_of(fleet, route) == leased_to
    got.slot.release()
    for slot in held:
        slot.release()
    assert_nothing_held(fleet)


async def test_a_new_conversation_that_spills_after_patience_is_leased_where_it_ran() -> None:
    route = Route(lease_patience=SHORT)
    fleet = MemoryFleet({"gpu1": host(queue_max=1), "gpu2": host(queue_max=1)}, route)
    held = [fleet.occupy("gpu1"), fleet.occupy("gpu2")]
    waiting = await (newcomer := placer(fleet, route, "fresh")).now()
    assert isinstance(waiting, Waiting) and waiting.reason is Reason.NEW
    queued_at = waiting.host
    task = asyncio.create_task(newcomer.wait(waiting))
    await settle()

    elsewhere = next(slot for slot in held if slot.host != queued_at)
    elsewhere.release()
    got = await asyncio.wait_for(task, WAIT)

    assert got.host != queued_at
    assert (got.reason, got.lease) == (Reason.SPILLED, LeaseOutcome.NEW)
    assert lease_of(fleet, route, "fresh") == got.host  # no cache was warm where it queued
    got.slot.release()
    for slot in held:
        slot.release()
    assert_nothing_held(fleet)


@pytest.mark.parametrize(("patience", "served_on"), [(0.0, "gpu2"), (0.5, "gpu1")])
async def test_a_busy_home_sends_its_conversation_to_a_free_host_at_once_only_without_patience(
    patience: float, served_on: str
) -> None:
    route = Route(lease_patience=patience)
    fleet = MemoryFleet({"gpu1": host(queue_max=1), "gpu2": host(queue_max=1)}, route)
    first_turn = await placed(fleet, route)
    assert first_turn.host == "gpu1"

    got = await placer(fleet, route).now()

    if served_on == "gpu2":  # no patience: gpu2's free slot now, the lease stays home
        assert isinstance(got, Placement)
        assert (got.host, got.reason, got.lease) == ("gpu2", Reason.SPILLED, LeaseOutcome.SPILLED)
        got.slot.release()
    else:  # half a second of patience is still patience: in home's line first
        assert isinstance(got, Waiting)
        assert (got.host, got.reason) == ("gpu1", Reason.HOME)
        assert got.waiter.cancel() is None
    assert lease_of(fleet, route) == "gpu1"
    first_turn.slot.release()
    assert_nothing_held(fleet)


async def test_home_queue_full_spills_at_once_to_a_free_host() -> None:
    route = Route(lease_patience=LONG)
    fleet = MemoryFleet({"gpu1": host(queue_max=0), "gpu2": host(queue_max=0)}, route)
    first_turn = await placed(fleet, route)

    got = await placed(fleet, route)

    assert (got.host, got.reason, got.lease) == ("gpu2", Reason.SPILLED, LeaseOutcome.SPILLED)
    assert lease_of(fleet, route) == "gpu1"
    first_turn.slot.release()
    got.slot.release()
    assert_nothing_held(fleet)


async def test_home_queue_full_queues_on_another_host_with_room() -> None:
    route = Route(lease_patience=LONG)
    fleet = MemoryFleet({"gpu1": host(queue_max=0), "gpu2": host(queue_max=1)}, route)
    first_turn = await placed(fleet, route)
    other = fleet.occupy("gpu2")

    waiting = await (second := placer(fleet, route)).now()
    assert isinstance(waiting, Waiting)
    assert (waiting.host, waiting.reason) == ("gpu2", Reason.SPILLED)
    task = asyncio.create_task(second.wait(waiting))
    other.release()
    got = await asyncio.wait_for(task, WAIT)

    assert (got.host, got.reason, got.lease) == ("gpu2", Reason.SPILLED, LeaseOutcome.SPILLED)
    assert lease_of(fleet, route) == "gpu1"
    first_turn.slot.release()
    got.slot.release()
    assert_nothing_held(fleet)


async def test_a_request_queued_elsewhere_that_is_handed_its_home_slot_is_served_at_home() -> None:
    route = Route(lease_patience=SHORT)
    fleet = MemoryFleet({"gpu1": host(queue_max=0), "gpu2": host(queue_max=1)}, route)
    first_turn = await placed(fleet, route)
    other = fleet.occupy("gpu2")
    waiting = await (second := placer(fleet, route)).now()
    assert isinstance(waiting, Waiting) and waiting.host == "gpu2"  # home's queue is full
    task = asyncio.create_task(second.wait(waiting))
    # Past the patience, the request also watches home: let that timer run first.
    loop = asyncio.get_running_loop()
    await asyncio.sleep(second.started + SHORT + SHORT / 5 - loop.time())
    await settle()

    first_turn.slot.release()
    got = await asyncio.wait_for(task, WAIT)

    assert (got.host, got.reason, got.lease) == ("gpu1", Reason.HOME, LeaseOutcome.REUSED)
    assert (got.route, got.model) == ("chat", MODEL)
    assert SHORT - EARLY <= got.waited <= loop.time() - second.started
    assert fleet.limiter.queued("gpu2", MODEL) == 0
    got.slot.release()
    other.release()
    assert_nothing_held(fleet)


async def test_a_request_moved_into_a_line_takes_a_slot_of_its_host_come_back_after_patience() -> (
    None
):
    # gpu1 restarts: its conversation's turn moves into gpu2's line, and waits there past its
    # patience. gpu1 comes back empty; a free slot there must take the turn (and the lease),
    # not leave it behind gpu2's own conversations while gpu1 idles.
    route = Route(lease_patience=SHORT)
    fleet = MemoryFleet({"gpu1": host(2, 8), "gpu2": host(2, 8)}, route)
    (await placed(fleet, route)).slot.release()
    fleet.set_host("gpu1", healthy=False)
    held = [fleet.occupy("gpu2") for _ in range(2)]
    waiting = await (moved := placer(fleet, route)).now()
    assert isinstance(waiting, Waiting)
    assert (waiting.host, waiting.reason) == ("gpu2", Reason.MOVED)
    task = asyncio.create_task(moved.wait(waiting))
    loop = asyncio.get_running_loop()
    await asyncio.sleep(moved.started + SHORT + SHORT / 5 - loop.time())  # patience spent
    await settle()
    assert not task.done()

    fleet.set_host("gpu1", healthy=True)
    got = await asyncio.wait_for(task, WAIT)

    assert (got.host, got.reason, got.lease) == ("gpu1", Reason.SPILLED, LeaseOutcome.MOVED)
    assert lease_of(fleet, route) == "gpu1"
    assert fleet.limiter.queued("gpu2", MODEL) == 0
    got.slot.release()
    for slot in held:
        slot.release()
    assert_nothing_held(fleet)


async def test_every_host_full_refuses_with_queue_full() -> None:
    route = Route()
    fleet = MemoryFleet({"gpu1": host(queue_max=1), "gpu2": host(queue_max=0)}, route)
    home = await placed(fleet, route)
    busy = [fleet.occupy("gpu2")]
    queued = await placer(fleet, route, "someone queued").now()
    assert isinstance(queued, Waiting)
    before = fleet.limiter.snapshot()

    with pytest.raises(QueueFull) as at_home:
        await placer(fleet, route).now()
    with pytest.raises(QueueFull):
        await placer(fleet, route, "a new conversation").now()

    answer = answer_for(at_home.value)
    assert (answer.status, answer.code, answer.retry_after) == (503, "queue_full", 1)
    assert fleet.limiter.snapshot() == before
    assert lease_of(fleet, route, "a new conversation") is None
    queued.waiter.cancel()
    for slot in [home.slot, *busy]:
        slot.release()
    assert_nothing_held(fleet)


# -- an unusable home, and no usable host -------------------------------------------------


@pytest.mark.parametrize("unusable", [{"healthy": False}, {"draining": True}])
async def test_home_down_or_draining_moves_the_lease(unusable: dict[str, bool]) -> None:
    route = Route()
    fleet = MemoryFleet({"gpu1": host(), "gpu2": host()}, route)
    (await placed(fleet, route)).slot.release()
    assert lease_of(fleet, route) == "gpu1"

    fleet.set_host("gpu1", **unusable)
    got = await placed(fleet, route)

    assert (got.host, got.reason, got.lease) == ("gpu2", Reason.MOVED, LeaseOutcome.MOVED)
    assert lease_of(fleet, route) == "gpu2"
    got.slot.release()
    fleet.set_host("gpu1", healthy=True, draining=False)
    next_turn = await placed(fleet, route)
    assert (next_turn.host, next_turn.reason) == ("gpu2", Reason.HOME)


async def test_a_strict_route_refuses_with_pinned_host_down_and_keeps_the_pin() -> None:
    route = Route(strict=True)
    fleet = MemoryFleet({"gpu1": host(), "gpu2": host()}, route)
    (await placed(fleet, route)).slot.release()

    fleet.set_host("gpu1", healthy=False)
    with pytest.raises(PinnedHostDown) as refused:
        await placer(fleet, route).now()

    assert refused.value.host == "gpu1"
    answer = answer_for(refused.value)
    assert (answer.status, answer.code) == (503, "pinned_host_down")
    assert lease_of(fleet, route) == "gpu1"
    assert_nothing_held(fleet)
    fleet.set_host("gpu1", healthy=True)
    back = await placed(fleet, route)
    assert (back.host, back.reason, back.lease) == ("gpu1", Reason.HOME, LeaseOutcome.REUSED)


async def test_no_usable_host_refuses_with_no_healthy_host() -> None:
    route = Route()
    fleet = MemoryFleet({"gpu1": host(healthy=False), "gpu2": host(draining=True)}, route)

    with pytest.raises(NoHealthyHost) as refused:
        await placer(fleet, route).now()

    assert answer_for(refused.value).code == "no_healthy_host"
    assert lease_of(fleet, route) is None
    assert_nothing_held(fleet)


async def test_no_usable_host_refuses_at_once_when_the_routes_fallback_is_gone() -> None:
    route = Route(fallback="deleted")  # names a route the fleet no longer has
    fleet = MemoryFleet({"gpu1": host(healthy=False), "gpu2": host(healthy=False)}, route)

    with pytest.raises(NoHealthyHost):
        await placer(fleet, route).now()

    assert_nothing_held(fleet)


# -- the fallback route, and hosts coming back ---------------------------------------------


def with_fallback(**chat: Any) -> tuple[Route, Route]:
    """The `chat` route (gpu1, gpu2) falling back to `cpu` (cpu1) and its small model."""
    fallback = Route(name="cpu", hosts=("cpu1",))
    route = Route(fallback="cpu", fallback_model="small", **chat)
    return route, fallback


async def test_with_no_usable_host_a_route_with_a_fallback_waits_then_takes_a_fallback_slot() -> (
    None
):
    route, fallback = with_fallback(fallback_after=SHORT)
    fleet = MemoryFleet(
        {"gpu1": host(healthy=False), "gpu2": host(healthy=False), "cpu1": host(model="small")},
        route,
        fallback,
    )

    waiting = await (request := placer(fleet, route)).now()
    assert isinstance(waiting, Waiting)
    assert waiting.host == ""  # no line to wait in: it watches the hosts and the fallback
    got = await asyncio.wait_for(request.wait(waiting), WAIT)

    assert (got.host, got.reason, got.route, got.model, got.fallback) == (
        "cpu1", Reason.FALLBACK, "cpu", "small", "cpu",
    )  # fmt: skip
    assert got.waited >= SHORT - EARLY
    assert lease_of(fleet, route) is None  # the conversation has no home yet
    got.slot.release()
    assert_nothing_held(fleet)


async def test_a_queued_request_takes_a_fallback_slot_after_fallback_after() -> None:
    route, fallback = with_fallback(hosts=("gpu1",), fallback_after=SHORT)
    fleet = MemoryFleet({"gpu1": host(queue_max=1), "cpu1": host(model="small")}, route, fallback)
    home = await placed(fleet, route)

    waiting = await (request := placer(fleet, route)).now()
    assert isinstance(waiting, Waiting) and waiting.host == "gpu1"
    got = await asyncio.wait_for(request.wait(waiting), WAIT)

    assert (got.host, got.reason, got.route, got.model) == ("cpu1", Reason.FALLBACK, "cpu", "small")
    assert got.lease == LeaseOutcome.NONE
    assert got.waited >= SHORT - EARLY
    assert fleet.limiter.queued("gpu1", MODEL) == 0
    assert lease_of(fleet, route) == "gpu1"
    home.slot.release()
    got.slot.release()
    assert_nothing_held(fleet)


async def test_a_fallback_with_no_free_slot_keeps_the_request_waiting_for_the_next_one() -> None:
    route, fallback = with_fallback(hosts=("gpu1",), fallback_after=SHORT)
    fleet = MemoryFleet({"gpu1": host(queue_max=1), "cpu1": host(model="small")}, route, fallback)
    home = await placed(fleet, route)
    cpu = fleet.occupy("cpu1", "small")
    request = placer(fleet, route)
    waiting = await request.now()
    assert isinstance(waiting, Waiting)
    task = asyncio.create_task(request.wait(waiting))

    # Past fallback_after: the loop runs that timer before it wakes this later sleep.
    loop = asyncio.get_running_loop()
    await asyncio.sleep(request.started + SHORT + SHORT / 5 - loop.time())
    await settle()
    assert not task.done()
    assert fleet.limiter.queued("gpu1", MODEL) == 1
    cpu.release()
    got = await asyncio.wait_for(task, WAIT)

    assert (got.host, got.reason, got.route) == ("cpu1", Reason.FALLBACK, "cpu")
    home.slot.release()
    got.slot.release()
    assert_nothing_held(fleet)


async def test_a_fallback_serving_the_routes_own_model_is_still_the_fallback() -> None:
    route = Route(fallback="cpu", fallback_after=SHORT)  # no fallback_model: the same one
    fallback = Route(name="cpu", hosts=("cpu1",))
    fleet = MemoryFleet(
        {"gpu1": host(healthy=False), "gpu2": host(healthy=False), "cpu1": host()},
        route,
        fallback,
    )

    waiting = await (request := placer(fleet, route)).now()
    assert isinstance(waiting, Waiting)
    got = await asyncio.wait_for(request.wait(waiting), WAIT)

    assert (got.host, got.reason, got.route, got.model, got.fallback) == (
        "cpu1", Reason.FALLBACK, "cpu", MODEL, "cpu",
    )  # fmt: skip
    assert lease_of(fleet, route) is None  # the conversation's home is not the fallback
    got.slot.release()
    assert_nothing_held(fleet)


async def test_a_host_coming_back_serves_a_request_waiting_with_no_usable_host() -> None:
    route, fallback = with_fallback(fallback_after=LONG)
    fleet = MemoryFleet(
        {"gpu1": host(healthy=False), "gpu2": host(healthy=False), "cpu1": host(model="small")},
        route,
        fallback,
    )
    waiting = await (request := placer(fleet, route)).now()
    assert isinstance(waiting, Waiting)
    task = asyncio.create_task(request.wait(waiting))
    await settle()
    assert not task.done()

    fleet.set_host("gpu2", healthy=True)
    got = await asyncio.wait_for(task, WAIT)

    assert (got.host, got.reason, got.lease, got.route) == (
        "gpu2", Reason.NEW, LeaseOutcome.NEW, "chat",
    )  # fmt: skip
    assert lease_of(fleet, route) == "gpu2"
    got.slot.release()
    assert_nothing_held(fleet)


async def test_a_strict_route_with_a_fallback_waits_for_its_pinned_host_to_come_back() -> None:
    route, fallback = with_fallback(strict=True, fallback_after=LONG)
    fleet = MemoryFleet(
        {"gpu1": host(), "gpu2": host(), "cpu1": host(model="small")}, route, fallback
    )
    (await placed(fleet, route)).slot.release()
    fleet.set_host("gpu1", healthy=False)
    waiting = await (request := placer(fleet, route)).now()
    assert isinstance(waiting, Waiting)
    task = asyncio.create_task(request.wait(waiting))
    await settle()
    assert not task.done()  # gpu2 is free, but the conversation is pinned to gpu1

    fleet.set_host("gpu1", healthy=True)
    got = await asyncio.wait_for(task, WAIT)

    assert (got.host, got.reason, got.lease) == ("gpu1", Reason.HOME, LeaseOutcome.REUSED)
    got.slot.release()
    assert_nothing_held(fleet)


# -- ending a wait: timeout and cancellation ---------------------------------------------


async def test_queue_timeout_raises_queue_timeout_and_leaves_nothing_held() -> None:
    route = Route(hosts=("gpu1",), queue_timeout=SHORT)
    fleet = MemoryFleet({"gpu1": host(queue_max=1)}, route)
    home = await placed(fleet, route)
    waiting = await (request := placer(fleet, route)).now()
    assert isinstance(waiting, Waiting)

    with pytest.raises(QueueTimeout) as timed_out:
        await asyncio.wait_for(request.wait(waiting), WAIT)

    answer = answer_for(timed_out.value)
    assert (answer.status, answer.code, answer.retry_after) == (503, "queue_timeout", 5)
    assert answer.message == f"queue timeout: no slot for {MODEL} within {SHORT:g} s"
    assert asyncio.get_running_loop().time() >= request.started + SHORT - EARLY
    assert fleet.limiter.queued("gpu1", MODEL) == 0
    home.slot.release()
    assert_nothing_held(fleet)


async def test_cancelling_a_wait_leaves_nothing_held() -> None:
    route = Route(lease_patience=SHORT)
    fleet = MemoryFleet({"gpu1": host(queue_max=1), "gpu2": host(queue_max=1)}, route)
    home = await placed(fleet, route)
    other = fleet.occupy("gpu2")
    waiting = await (request := placer(fleet, route)).now()
    assert isinstance(waiting, Waiting)
    task = asyncio.create_task(request.wait(waiting))
    await settle()

    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    assert fleet.limiter.queued("gpu1", MODEL) == 0
    home.slot.release()
    other.release()
    assert_nothing_held(fleet)


@pytest.mark.parametrize("where", ["home", "spill"])
async def test_a_wait_cancelled_in_the_turn_its_slot_is_handed_over_leaves_nothing_held(
    where: str,
) -> None:
    route = Route(lease_patience=0.0 if where == "spill" else LONG)
    fleet = MemoryFleet({"gpu1": host(queue_max=1), "gpu2": host(queue_max=1)}, route)
    home = (await placed(fleet, route)).slot
    other = fleet.occupy("gpu2")
    waiting = await (request := placer(fleet, route)).now()
    assert isinstance(waiting, Waiting) and waiting.host == "gpu1"
    task = asyncio.create_task(request.wait(waiting))
    await settle()  # the wait has started, and a patience of 0 has been spent

    (home if where == "home" else other).release()  # hands the slot to the waiter
    # Its line's slot is granted; a slot elsewhere is held for it, for its task to decide.
    handed = waiting.waiter.granted if where == "home" else waiting.waiter.offered
    assert handed.done()
    task.cancel()  # the client leaves in that very turn, before the wait sees its slot
    with pytest.raises(asyncio.CancelledError):
        await task

    assert fleet.limiter.queued("gpu1", MODEL) == 0
    (other if where == "home" else home).release()
    assert_nothing_held(fleet)


class LeaseWriteFails(LocalState):
    """Local state whose lease writes fail (the shared state's store went away mid-request),
    after `meanwhile` ran: what other requests did while the write was on its way."""

    __slots__ = ("meanwhile",)

    def __init__(self, fleet: MemoryFleet, meanwhile: Callable[[], None] = lambda: None):
        super().__init__(fleet.limiter, fleet.leases)
        self.meanwhile = meanwhile

    async def keep_lease(self, key: LeaseKey, host: str, ttl: float, found: str | None) -> None:
        self.meanwhile()
        raise ConnectionError("lease store unreachable")


@pytest.mark.parametrize("conversation", ["returning", "new"])
async def test_a_request_whose_lease_cannot_be_written_gives_back_the_slot_it_took(
    conversation: str,
) -> None:
    route = Route()
    fleet = MemoryFleet({"gpu1": host(parallel=2), "gpu2": host(parallel=2)}, route)
    (await placed(fleet, route, "returning")).slot.release()  # it has a home now
    fleet.state = LeaseWriteFails(fleet)

    with pytest.raises(ConnectionError):
        await placer(fleet, route, conversation).now()

    assert_nothing_held(fleet)


async def test_a_request_whose_lease_cannot_be_written_gives_back_its_place_in_line() -> None:
    route = Route()
    fleet = MemoryFleet({"gpu1": host(queue_max=1), "gpu2": host(queue_max=1)}, route)
    first_turn = await placed(fleet, route)
    fleet.state = LeaseWriteFails(fleet)

    with pytest.raises(ConnectionError):
        await placer(fleet, route).now()  # home busy: it had joined home's line

    assert fleet.limiter.queued("gpu1", MODEL) == 0
    first_turn.slot.release()
    assert_nothing_held(fleet)


async def test_a_slot_handed_over_while_the_lease_was_written_is_given_back_when_it_fails() -> None:
    route = Route()
    fleet = MemoryFleet({"gpu1": host(queue_max=1), "gpu2": host(queue_max=1)}, route)
    first_turn = await placed(fleet, route)
    fleet.state = LeaseWriteFails(fleet, meanwhile=first_turn.slot.release)

    with pytest.raises(ConnectionError):
        await placer(fleet, route).now()  # in home's line, then handed its slot meanwhile

    assert_nothing_held(fleet)


async def test_a_new_conversation_that_spilled_gives_back_its_slot_when_its_lease_fails() -> None:
    route = Route(lease_patience=SHORT)
    fleet = MemoryFleet({"gpu1": host(queue_max=1), "gpu2": host(queue_max=1)}, route)
    held = {name: fleet.occupy(name) for name in ("gpu1", "gpu2")}
    waiting = await (newcomer := placer(fleet, route)).now()
    assert isinstance(waiting, Waiting) and waiting.reason is Reason.NEW
    fleet.state = LeaseWriteFails(fleet)  # fails the write after the spill, not the first
    task = asyncio.create_task(newcomer.wait(waiting))
    await settle()

    held.pop("gpu2" if waiting.host == "gpu1" else "gpu1").release()  # where it may spill
    with pytest.raises(ConnectionError):
        await asyncio.wait_for(task, WAIT)

    for slot in held.values():
        slot.release()
    assert_nothing_held(fleet)


async def test_a_slot_on_a_host_that_came_back_is_given_back_if_the_lease_fails() -> None:
    route, fallback = with_fallback(fallback_after=LONG)
    fleet = MemoryFleet(
        {"gpu1": host(healthy=False), "gpu2": host(healthy=False), "cpu1": host(model="small")},
        route,
        fallback,
    )
    waiting = await (request := placer(fleet, route)).now()
    assert isinstance(waiting, Waiting) and waiting.host == ""
    fleet.state = LeaseWriteFails(fleet)
    task = asyncio.create_task(request.wait(waiting))
    await settle()

    fleet.set_host("gpu2", healthy=True)
    with pytest.raises(ConnectionError):
        await asyncio.wait_for(task, WAIT)

    assert_nothing_held(fleet)


# -- property: a burst of new conversations ------------------------------------------------


async def _burst(
    limits: list[tuple[int, int]], arrivals: int, patience: float, rng: random.Random
) -> None:
    names = tuple(f"gpu{number}" for number in range(1, len(limits) + 1))
    route = Route(hosts=names, lease_patience=patience)
    bounds = dict(zip(names, limits, strict=True))
    fleet = MemoryFleet({name: host(*limit) for name, limit in bounds.items()}, route)

    def within_limits() -> None:
        for name, (parallel, queue_max) in bounds.items():
            assert fleet.limiter.in_flight(name, MODEL) <= parallel, name
            assert fleet.limiter.queued(name, MODEL) <= queue_max, name

    served: list[Placement] = []
    queued: list[tuple[Placer, Waiting]] = []
    refused = 0
    for number in range(arrivals):  # one loop turn: nothing else runs in between
        request = placer(fleet, route, f"conversation {number}")
        try:
            got = await request.now()
        except QueueFull:
            refused += 1
            continue
        if isinstance(got, Placement):
            served.append(got)
        else:
            queued.append((request, got))
        within_limits()

    slots = sum(parallel for parallel, _ in limits)
    room = sum(parallel + queue_max for parallel, queue_max in limits)
    assert len(served) == min(arrivals, slots)
    assert len(served) + len(queued) == min(arrivals, room)
    assert refused == arrivals - min(arrivals, room)

    held = [placement.slot for placement in served]
    tasks = [asyncio.create_task(request.wait(waiting)) for request, waiting in queued]
    # Each wait must have begun before it is cancelled: a task cancelled before its first step
    # never runs `wait`, so nothing would give its place back (the caller's duty, not tested).
    await asyncio.sleep(0)
    cancelled: set[asyncio.Task[Placement]] = set()
    async with asyncio.timeout(WAIT):
        while held or tasks:
            for task in [task for task in tasks if task.done()]:
                tasks.remove(task)
                if not task.cancelled():
                    held.append(task.result().slot)
            choices = []
            if held:
                choices.append("end")
            if any(task not in cancelled for task in tasks):
                choices.append("cancel")
            if choices and rng.choice(choices) == "end":
                held.pop(rng.randrange(len(held))).release()
            elif choices:
                victim = rng.choice([task for task in tasks if task not in cancelled])
                victim.cancel()
                cancelled.add(victim)
            within_limits()
            # Sometimes none: a cancel in the very turn a release handed the slot over.
            for _ in range(rng.randrange(3) if choices else 1):
                await asyncio.sleep(0)

    assert all(snap.in_flight == 0 and snap.queued == 0 for snap in fleet.limiter.snapshot())
    assert_nothing_held(fleet)


@settings(max_examples=150, deadline=None)
@given(
    limits=st.lists(st.tuples(st.integers(1, 4), st.integers(0, 4)), min_size=1, max_size=5),
    arrivals=st.integers(0, 40),
    patience=st.sampled_from([0.0, LONG]),
    rng=st.randoms(use_true_random=False),
)
def test_a_burst_of_new_conversations_fills_slots_then_queues_refuses_the_rest_and_leaks_nothing(
    limits: list[tuple[int, int]], arrivals: int, patience: float, rng: random.Random
) -> None:
    asyncio.run(_burst(limits, arrivals, patience, rng))


# -- stress: traffic while hosts go down, drain and come back ---------------------------


async def _random_traffic(rng: random.Random) -> list[str]:
    """Four hundred random steps; returns what went wrong (nothing, when placement holds)."""
    limits = {name: (rng.randint(1, 3), rng.randint(0, 2)) for name in ("gpu1", "gpu2", "gpu3")}
    fallback = Route(name="cpu", hosts=("cpu1",))
    route = Route(
        hosts=tuple(limits),
        strict=rng.random() < 0.3,
        lease_patience=rng.choice([0.0, 0.002, 0.01]),
        fallback=rng.choice(["", "cpu"]),
        fallback_after=rng.choice([0.0, 0.003, 0.02]),
        fallback_model="small",
        queue_timeout=rng.choice([0.01, 0.05]),
    )
    hosts = {name: host(*limit) for name, limit in limits.items()}
    hosts["cpu1"] = host(1, 0, model="small")
    fleet = MemoryFleet(hosts, route, fallback)
    pairs = {(name, MODEL): limit[0] for name, limit in limits.items()} | {("cpu1", "small"): 1}
    wrong: list[str] = []
    held: list[tuple[Held, str]] = []
    busy: set[str] = set()  # conversations with a request under way: one at a time each
    tasks: list[asyncio.Task[None]] = []

    def judge(got: Placement, fingerprint: str) -> None:
        lease = lease_of(fleet, route, fingerprint) if fingerprint else None
        if got.reason == Reason.FALLBACK:
            if (got.host, got.route, got.model) != ("cpu1", "cpu", "small"):
                wrong.append(f"fallback placed as {got}")
        elif got.host == "cpu1" or got.route != "chat":
            wrong.append(f"the fallback's host served as the route's own: {got}")
        if got.reason == Reason.HOME and lease != got.host:
            wrong.append(f"home on {got.host}, lease on {lease}")
        if got.reason == Reason.SPILLED and got.lease == LeaseOutcome.SPILLED and lease == got.host:
            wrong.append(f"spilled onto its own lease host {got.host}")
        if got.reason == Reason.SPILLED and got.lease != LeaseOutcome.SPILLED and lease != got.host:
            wrong.append(f"a new conversation spilled to {got.host}, lease left on {lease}")
        if got.reason in (Reason.NEW, Reason.MOVED) and lease != got.host:
            wrong.append(f"{got.reason} on {got.host}, lease on {lease}")
        held.append((got.slot, fingerprint))

    async def wait(request: Placer, waiting: Waiting, fingerprint: str) -> None:
        try:
            got = await request.wait(waiting)
        except QueueTimeout:
            busy.discard(fingerprint)
            return
        except asyncio.CancelledError:
            busy.discard(fingerprint)
            raise
        judge(got, fingerprint)

    for _ in range(400):
        roll = rng.random()
        if roll < 0.4:
            fingerprint = rng.choice(["", *sorted({"a", "b", "c", "d", "e"} - busy)])
            busy.add(fingerprint)
            request = placer(fleet, route, fingerprint)
            try:
                got = await request.now()
            except (QueueFull, NoHealthyHost, PinnedHostDown):
                busy.discard(fingerprint)
            else:
                if isinstance(got, Placement):
                    judge(got, fingerprint)
                else:
                    tasks.append(asyncio.create_task(wait(request, got, fingerprint)))
                    await asyncio.sleep(0)  # the wait begins before anyone may cancel it
        elif roll < 0.65 and held:
            slot, fingerprint = held.pop(rng.randrange(len(held)))
            slot.release()
            busy.discard(fingerprint)
        elif roll < 0.72 and tasks:
            rng.choice(tasks).cancel()
        elif roll < 0.8:
            name = rng.choice([*limits, "cpu1"])
            fleet.set_host(name, healthy=rng.random() < 0.7, draining=rng.random() < 0.15)
        for (name, model), parallel in pairs.items():
            if fleet.limiter.in_flight(name, model) > parallel:
                wrong.append(f"{name} over its {parallel} slots")
        tasks = [task for task in tasks if not task.done()]
        await asyncio.sleep(0.001 if rng.random() < 0.3 else 0)

    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for slot, _ in held:
        slot.release()
    for name in [*limits, "cpu1"]:
        fleet.set_host(name, healthy=True, draining=False)
    assert_nothing_held(fleet)
    return wrong


async def test_random_traffic_while_hosts_fail_and_return_never_oversubscribes_nor_leaks() -> None:
    seed = random.SystemRandom().randrange(2**32)
    for number in range(4):
        rng = random.Random(seed + number)
        assert await _random_traffic(rng) == [], f"seed {seed + number}"
