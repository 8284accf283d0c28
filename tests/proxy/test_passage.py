"""A request's lifecycle from its placement to the host's response head, seen from the
outside: the head it returns and the trail of the attempt that got it, what the client hears
when hosts fail, where a waiting request shows it waits, and requests that take no slot.

No server: the in-memory fleet of tests/core/test_placement.py, and hosts that answer
the lifecycle's `forward` as each test says (a head, or a reset that marks the host down, as
`routing.proxy.upstream.forward` does). The stateful model (test_passage_model.py) checks the
slot promises over random runs; these pin what a client and the request's row see.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, cast

import httpx
import pytest

from routing.core.clients import Admitted, ClientGate, ClientSpec
from routing.core.errors import ClientLimited, HostDown, NoHealthyHost, PinnedHostDown
from routing.core.patience import Figures
from routing.core.placement import Placement, Waiting
from routing.core.prefixes import NO_PREFIX, Prefix
from routing.core.running import RunningTable
from routing.proxy import lifecycle as lifecycle_module
from routing.proxy.ask import Ask
from routing.proxy.lifecycle import Lifecycle
from routing.proxy.record import Arrival, Outcome, Trail, clock
from routing.runtime import Runtime
from tests.helpers.memory_fleet import (
    MODEL,
    WAIT,
    MemoryFleet,
    Route,
    assert_nothing_held,
    host,
    placer,
    settle,
)


@dataclass(frozen=True)
class _Ask:
    """The fields of `Ask` a lifecycle reads itself; the rest is `forward`'s."""

    model: str | None = MODEL
    host: str = ""
    fingerprint: str = "conversation"  # as `placer`'s
    takes_slot: bool = True
    names_slot: bool = False  # no slot of its own to name
    prefix: Prefix = NO_PREFIX
    payload: None = None


class Fleet(MemoryFleet):
    """The in-memory fleet as the lifecycle's runtime: its hosts answer `forward`, and
    `probe_down` (asking hosts that are down how they are now) brings back `comes_back`;
    `running` is the dashboard's table of running requests, `figures` the hosts' figures."""

    def __init__(self, hosts: dict[str, dict[str, Any]], route: Route, resetting: set[str]):
        super().__init__(hosts, route)
        self.resetting = resetting
        self.asked: list[tuple[object, object, str | None, str]] = []
        self.probed: list[object] = []
        self.comes_back = ""
        self.running = RunningTable()
        self.figures = Figures()
        self.clients = ClientGate(require=False)
        self.head: Any = None  # what a healthy host answers: ("head of", host) unless set
        self.stream_idle_timeout = WAIT
        self.models = None  # no model actor: these hosts load nothing

    def arrived(self, model: str | None) -> None:
        """A request arrives: with no model actor, nobody counts it."""

    @property
    def live(self) -> Fleet:
        """The runtime's live fleet: this one (the lifecycle places and ranks there)."""
        return self

    async def forward(
        self, runtime: Any, ask: Any, model: str | None, name: str, id_slot: int | None
    ) -> Any:
        self.asked.append((runtime, ask, model, name))
        if name in self.resetting:
            self.mark(name, healthy=False)  # as the runtime marks it down
            raise HostDown(f"host {name} closed the connection")
        return ("head of", name) if self.head is None else self.head

    async def admit(self, client: ClientSpec, route: str) -> Admitted:
        return self.clients.admit(client, route)

    async def probe_down(self, route: object) -> None:
        self.probed.append(route)
        if self.comes_back:
            self.set_host(self.comes_back, healthy=True)


async def passage(
    fleet: Fleet, route: Route, *, slot: bool = True, trail: Trail | None = None, **ask: Any
) -> Lifecycle:
    """The lifecycle of one request: placed now (it may wait), or one that takes no slot."""
    life = Lifecycle(trail, cast(Runtime, fleet), cast(Any, route), forward=fleet.forward)
    await life.place(cast(Ask, _Ask(takes_slot=slot, **ask)))
    return life


def fleet_of(route: Route, resetting: Iterable[str] = (), **specs: dict[str, Any]) -> Fleet:
    return Fleet(specs or {name: host() for name in route.hosts}, route, set(resetting))


async def test_the_head_returned_is_the_hosts_with_the_trail_of_the_attempt_that_got_it() -> None:
    route = Route()
    fleet = fleet_of(route)
    table = fleet.running
    arrival = Arrival(t0=clock() - 2.0)  # it arrived two seconds ago
    request = await passage(fleet, route, trail=Trail(arrival))
    assert request.waiting is None  # placed at once: nothing to show

    answered = await request.through()

    assert isinstance(answered.placement, Placement)
    served_by = answered.placement.host
    assert answered.upstream == ("head of", served_by)
    assert fleet.asked == [(fleet, request.ask, MODEL, served_by)]  # the lifecycle's runtime
    trail = answered.trail
    assert (trail.host, trail.lease, trail.placement) == (served_by, "new", "new")
    assert trail.ttfb_ms is not None
    assert 2000 <= trail.ttfb_ms <= (clock() - arrival.t0) * 1000
    assert [(row.host, row.queued_ms) for row in table.snapshot()] == [(served_by, 0)]
    request.host_done()  # the host's stream has ended: its slot back
    assert_nothing_held(fleet)


async def test_with_nowhere_else_to_go_the_client_hears_which_host_failed() -> None:
    route = Route(hosts=("gpu1",))
    request = await passage(fleet := fleet_of(route, {"gpu1"}), route)

    with pytest.raises(HostDown, match="host gpu1 closed the connection"):
        await request.through()

    assert_nothing_held(fleet)


async def test_a_strict_route_names_its_pinned_host_when_that_host_fails() -> None:
    route = Route(strict=True)
    request = await passage(fleet := fleet_of(route, {"gpu1", "gpu2"}), route)

    with pytest.raises(PinnedHostDown) as refused:
        await request.through()

    assert refused.value.host == fleet.asked[0][3]
    assert_nothing_held(fleet)


async def test_a_waiting_request_shows_where_it_waits_until_it_has_its_slot() -> None:
    route = Route(hosts=("gpu1",))
    fleet = fleet_of(route, gpu1=host(queue_max=1))
    ahead = await placer(fleet, route).now()
    assert isinstance(ahead, Placement)
    request = await passage(fleet, route)
    waiting = request.waiting
    assert isinstance(waiting, Waiting)
    # A row for a wait that fails names where it waited: in its home's line.
    trail = request.trail
    assert (trail.host, trail.lease, trail.placement) == ("gpu1", "reused", "home")
    task = asyncio.create_task(request.through())
    await settle()
    assert request.waiting is waiting and not task.done()

    ahead.slot.release()
    answered = await asyncio.wait_for(task, WAIT)

    assert request.waiting is None
    assert answered.upstream == ("head of", "gpu1")
    assert answered.placement is not None
    request.host_done()
    assert_nothing_held(fleet)


# -- requests that take no slot (a model inspected, a host's own state) ----------------------


async def test_a_request_without_a_slot_skips_a_host_found_down_for_the_next() -> None:
    route = Route()
    fleet = fleet_of(route, {"gpu1"})

    table = fleet.running
    request = await passage(fleet, route, slot=False)

    answered = await request.through()

    assert answered.upstream == ("head of", "gpu2") and answered.placement is None
    assert fleet.asked == [(fleet, request.ask, MODEL, "gpu1"), (fleet, request.ask, MODEL, "gpu2")]
    assert answered.trail.host == "gpu2"
    assert [(row.host, row.queued_ms) for row in table.snapshot()] == [("gpu2", 0)]
    assert_nothing_held(fleet)


async def test_a_request_without_a_slot_hears_the_last_failure_when_every_host_fails() -> None:
    route = Route()
    fleet = fleet_of(route, {"gpu1", "gpu2"})

    with pytest.raises(HostDown, match="host gpu2 closed the connection"):
        await (await passage(fleet, route, slot=False)).through()

    assert fleet.probed == []  # there were usable hosts: nothing to probe


@pytest.mark.parametrize("comes_back", ["gpu2", ""])
async def test_a_request_without_a_slot_and_no_usable_host_probes_them_once_first(
    comes_back: str,
) -> None:
    route = Route()
    fleet = fleet_of(route, gpu1=host(healthy=False), gpu2=host(healthy=False))
    fleet.comes_back = comes_back
    request = await passage(fleet, route, slot=False)

    if comes_back:
        assert (await request.through()).upstream == ("head of", comes_back)
    else:
        with pytest.raises(NoHealthyHost):
            await request.through()

    assert fleet.probed == [route]


async def test_an_operator_naming_one_host_reaches_it_whatever_its_health() -> None:
    route = Route()
    fleet = fleet_of(route, gpu1=host(), gpu2=host(healthy=False))

    answered = await (await passage(fleet, route, slot=False, host="gpu2")).through()

    assert answered.upstream == ("head of", "gpu2")
    assert fleet.probed == []


# -- what a request holds, given back on every way out ---------------------------------------

ONE_AT_A_TIME = ClientSpec("alice", max_concurrent=1)
GONE = Outcome(499, "client disconnected", "client_disconnected")


async def _fails_at_its_host(life: Lifecycle, fleet: Fleet) -> None:
    fleet.resetting.update(fleet.hosts)
    with pytest.raises(HostDown) as failed:
        await life.through()
    life.fail(failed.value)


async def _relayed_to_its_end(life: Lifecycle, fleet: Fleet) -> None:
    await life.through()
    assert [chunk async for chunk in life.relay()] == [b"{}"]


async def _leaves_while_queued(life: Lifecycle, fleet: Fleet) -> None:
    assert life.waiting is not None
    task = asyncio.create_task(life.through())
    await settle()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    life.end(GONE)


async def _leaves_before_its_wait_began(life: Lifecycle, fleet: Fleet) -> None:
    assert life.waiting is not None  # a status stream whose body never ran
    life.end(GONE)


async def _leaves_with_a_slot_not_yet_used(life: Lifecycle, fleet: Fleet) -> None:
    assert life.waiting is None  # placed at once; the client left before the host was asked
    life.end(GONE)


@pytest.mark.parametrize(
    "way_out",
    [
        _fails_at_its_host,
        _relayed_to_its_end,
        _leaves_while_queued,
        _leaves_before_its_wait_began,
        _leaves_with_a_slot_not_yet_used,
    ],
)
async def test_every_way_out_gives_back_the_pass_the_slot_and_the_running_entry_with_one_row(
    way_out: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    rows: list[Outcome] = []
    monkeypatch.setattr(lifecycle_module, "finish", lambda trail, outcome: rows.append(outcome))
    route = Route(hosts=("gpu1",))
    fleet = fleet_of(route, gpu1=host(queue_max=1))
    fleet.head = httpx.Response(200, stream=httpx.ByteStream(b"{}"))
    queued = way_out in (_leaves_while_queued, _leaves_before_its_wait_began)
    ahead = fleet.occupy("gpu1") if queued else None
    life = Lifecycle(None, cast(Runtime, fleet), cast(Any, route), forward=fleet.forward)
    await life.admit(ONE_AT_A_TIME)
    with pytest.raises(ClientLimited):
        await fleet.admit(ONE_AT_A_TIME, route.name)  # its one request is in flight
    await life.place(cast(Ask, _Ask()))

    await way_out(life, fleet)
    life.end(GONE)  # a later ending (the handler's close, say) changes nothing
    life.fail(HostDown("host gpu1 closed the connection"))

    assert len(rows) == 1
    assert fleet.running.snapshot() == []
    (await fleet.admit(ONE_AT_A_TIME, route.name)).release()  # its pass was given back
    if ahead is not None:
        ahead.release()
    assert_nothing_held(fleet)
