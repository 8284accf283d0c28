"""The model of the request path (Hypothesis' rule-based state machine) that
tests/proxy/test_passage_model.py checks, in virtual time, against the real `Lifecycle` and
`Placer` over a `MemoryFleet`; tests/shared runs it over Redis. What it does and checks: that
test module's docstring."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from routing.core.choose import ranked
from routing.core.errors import HostDown, NoHealthyHost, PinnedHostDown, QueueFull
from routing.core.patience import DEFAULT_PATIENCE, Figures, Pricing
from routing.core.prefixes import NO_PREFIX, Prefix, PrefixIndex, prefix_blocks
from routing.core.running import RunningTable
from routing.proxy.ask import Ask
from routing.proxy.lifecycle import Answered, Lifecycle
from routing.proxy.record import Arrival, Trail
from routing.runtime import Runtime
from tests.helpers.memory_fleet import MODEL, MemoryFleet, Route, host

HOSTS = ("gpu1", "gpu2")
PROMPT = prefix_blocks({"messages": [{"role": "user", "content": "word " * 256}]})
SMALL = "small"  # the fallback route's model
MODES = ("ok", "reset", "hang")


class VirtualLoop(asyncio.SelectorEventLoop):
    """An event loop whose clock moves only when the model says so."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0

    def time(self) -> float:
        return self.now


@dataclass(eq=False)
class Request:
    """One client request as the model follows it."""

    number: int
    fingerprint: str
    task: asyncio.Task[Answered]
    line: str = ""  # the host whose line it joined on arrival
    holding: tuple[str, str] | None = None  # the (host, model) whose slot it holds
    answered: Answered | None = None
    ended: bool = False


@dataclass
class Host:
    mode: str = "ok"
    hung: list[asyncio.Future[None]] = field(default_factory=list)


class RequestPath(RuleBasedStateMachine):
    """The model over one process's state (`LocalState`), in virtual time. A subclass over
    another backing overrides the hooks below the rules (tests/shared)."""

    # The route's lease_patience, one drawn per run; None: auto, priced by figures drawn with
    # the fleet, and AUTO_DEFAULT while a host has none (the fallback's).
    PATIENCES: tuple[float | None, ...] = (0.0, 1.0, 300.0, None)
    AUTO_DEFAULT = DEFAULT_PATIENCE
    QUEUE_TIMEOUT = 20.0
    FALLBACK_AFTER = 3.0
    PASSES = (0.5, 1.5, 4.0, 30.0)  # how long `time_passes` lets pass, one drawn per step

    def __init__(self) -> None:
        super().__init__()
        self.loop: asyncio.AbstractEventLoop = self.make_loop()
        self.numbers = itertools.count(1)
        self.requests: list[Request] = []
        self.hosts = {name: Host() for name in (*HOSTS, "cpu1")}
        # Requests in the line they joined on arrival, in arrival order (until they ask a host).
        self.lines: dict[str, list[Request]] = {name: [] for name in self.hosts}
        self.lives: dict[int, Lifecycle] = {}
        self.fleet: MemoryFleet
        self.route: Route
        self.pricing: Pricing

    # -- the fleet ----------------------------------------------------------------------

    @initialize(
        strict=st.booleans(),
        patience=st.integers(0, 3),
        fallback=st.booleans(),
        limits=st.lists(st.tuples(st.integers(1, 2), st.integers(0, 2)), min_size=2, max_size=2),
        modes=st.lists(st.sampled_from(MODES), min_size=2, max_size=2),
        prices=st.lists(st.tuples(st.floats(0.1, 10), st.floats(0.1, 10)), min_size=2, max_size=2),
    )
    def build(
        self,
        strict: bool,
        patience: int,
        fallback: bool,
        limits: list[tuple[int, int]],
        modes: list[str],
        prices: list[tuple[float, float]] | None = None,
    ) -> None:
        for name, mode in zip(HOSTS, modes, strict=True):
            self.hosts[name].mode = mode
        self.route = Route(
            hosts=HOSTS,
            strict=strict,
            lease_patience=self.PATIENCES[patience],
            queue_timeout=self.QUEUE_TIMEOUT,
            fallback="cpu" if fallback else "",
            fallback_after=self.FALLBACK_AFTER,
            fallback_model=SMALL,
        )
        cpu = Route(name="cpu", hosts=("cpu1",))
        hosts = {name: host(parallel, queue_max) for name, (parallel, queue_max) in
                 zip(HOSTS, limits, strict=True)}  # fmt: skip
        hosts["cpu1"] = host(1, 1, model=SMALL)
        self.fleet = self.make_fleet(hosts, self.route, cpu)
        self.pricing = self.priced(prices or [])

    def settle(self) -> None:
        """Run every task that can run now, and every timer that is due."""
        before = {pair: self.held(pair) for pair in self.pairs()}
        self.loop.run_until_complete(self.rounds())
        for request in self.requests:
            if request.task.done() and not request.ended and request.answered is None:
                self.took_its_end(request)
        for pair, was in before.items():
            parallel = self.parallel(pair)
            now = self.held(pair)
            assert now <= max(parallel, was), f"{pair} granted past parallel={parallel}"

    def pairs(self) -> list[tuple[str, str]]:
        return [*((name, MODEL) for name in HOSTS), ("cpu1", SMALL)]

    def priced(self, prices: list[tuple[float, float]]) -> Pricing:
        """Each host's (service seconds, cold start seconds of the prompt) as its figures."""
        figures = Figures()
        for name, (service, cold) in zip(HOSTS, prices, strict=False):  # none: unpriced
            figures.held(name, MODEL, service)
            figures.prompted(name, MODEL, PROMPT, PROMPT.length, 0, cold * 1000)  # a unit a token

        def slots(name: str) -> int:
            return self.parallel((name, MODEL))

        return Pricing(figures, PrefixIndex(1000), MODEL, PROMPT, slots, self.AUTO_DEFAULT)

    def parallel(self, pair: tuple[str, str]) -> int:
        host_name, model = pair
        return int(self.fleet.hosts[host_name]["models"][model]["parallel"])

    # -- how a host is asked ------------------------------------------------------------

    async def forward(
        self, runtime: Any, ask: Any, model: str | None, name: str, id_slot: int | None
    ) -> Any:
        request = cast(Request, ask.request)
        assert model is not None
        assert request.holding is None, "a request asked a host while holding another slot"
        line = self.lines[name]
        if request in line:  # served from its own line: everyone who joined before is gone
            ahead = line[: line.index(request)]
            assert not [r.number for r in ahead if self.still_in_line(r, name)], "not FIFO"
        for joined in self.lines.values():
            if request in joined:
                joined.remove(request)  # out of line for good: a later line is not followed
        request.holding = (name, model)
        try:
            mode = self.hosts[name].mode
            if mode == "reset":
                self.mark_down(name)  # forward marks the host down
                raise HostDown(f"host {name} closed the connection")
            if mode == "hang":
                answer = self.loop.create_future()
                self.hosts[name].hung.append(answer)
                await answer
        except BaseException:
            request.holding = None  # the passage gives the slot back, at once
            raise
        return object()

    def still_in_line(self, request: Request, name: str) -> bool:
        life = self.lives.get(request.number)
        waiting = life.waiting if life is not None else None
        return waiting is not None and waiting.host == name and not request.task.done()

    # -- the rules ----------------------------------------------------------------------

    @rule(conversation=st.sampled_from(["", "a", "b", "c", "d"]), process=st.integers(0, 1))
    def arrive(self, conversation: str, process: int) -> None:
        number = next(self.numbers)
        request = Request(number, conversation, cast(asyncio.Task[Answered], None))
        life = Lifecycle(
            Trail(Arrival()), cast(Runtime, _Runtime(self.fleet_of(process))),
            cast(Any, self.route), forward=self.forward, prices=lambda *_: self.pricing,
        )  # fmt: skip
        try:
            self.loop.run_until_complete(life.place(cast(Ask, _Ask(request, conversation))))
        except (QueueFull, NoHealthyHost, PinnedHostDown) as refusal:
            self.check_refusal(refusal, conversation)
            return
        first = life.waiting
        if first is not None and first.host:
            request.line = first.host
            self.lines[first.host].append(request)
        self.lives[number] = life
        request.task = self.loop.create_task(life.through())
        self.requests.append(request)
        self.settle()

    def check_refusal(self, refusal: Exception, conversation: str) -> None:
        if not self.CHECKS_REFUSALS:
            return
        usable = [name for name in HOSTS if self.fleet.usable(self.route, MODEL, name)]
        if isinstance(refusal, QueueFull):
            for name in usable:
                limiter = self.fleet.limiter
                limits = self.fleet.hosts[name]["models"][MODEL]
                assert limiter.free_for(name, MODEL) == 0, f"refused with a free slot on {name}"
                assert limiter.queued(name, MODEL) >= limits["queue_max"], (
                    f"refused with room in {name}'s line"
                )
        elif isinstance(refusal, NoHealthyHost):
            assert not usable and not self.route.fallback, "refused with a host to go to"
        else:  # PinnedHostDown: its home is not usable and the route may not move it
            assert self.route.strict and not self.route.fallback

    @rule(name=st.sampled_from([*HOSTS, "cpu1"]), mode=st.sampled_from(MODES))
    def host_behaves(self, name: str, mode: str) -> None:
        self.hosts[name].mode = mode

    @rule(name=st.sampled_from([*HOSTS, "cpu1"]), healthy=st.booleans())
    def host_health_changes(self, name: str, healthy: bool) -> None:
        self.set_host(name, healthy=healthy)
        self.settle()

    @rule(name=st.sampled_from(HOSTS), draining=st.booleans())
    def host_drains(self, name: str, draining: bool) -> None:
        self.set_host(name, draining=draining)
        self.settle()

    @rule(name=st.sampled_from([*HOSTS, "cpu1"]))
    def hung_host_answers(self, name: str) -> None:
        hung, self.hosts[name].hung = self.hosts[name].hung, []
        for answer in hung:
            if not answer.done():
                answer.set_result(None)
        self.settle()

    @precondition(lambda self: any(r.answered and not r.ended for r in self.requests))
    @rule(data=st.data())
    def stream_ends(self, data: st.DataObject) -> None:
        streaming = [r for r in self.requests if r.answered is not None and not r.ended]
        self.end_stream(data.draw(st.sampled_from(streaming)))
        self.settle()

    @precondition(lambda self: any(not r.ended for r in self.requests))
    @rule(data=st.data())
    def client_leaves(self, data: st.DataObject) -> None:
        request = data.draw(st.sampled_from([r for r in self.requests if not r.ended]))
        if request.answered is not None:
            self.end_stream(request)  # mid-stream: the relay gives the slot back
        else:
            request.task.cancel()  # queued, or waiting for the host's head
        self.settle()

    @rule(name=st.sampled_from(HOSTS), parallel=st.integers(1, 3), queue_max=st.integers(0, 2))
    def config_reloads(self, name: str, parallel: int, queue_max: int) -> None:
        self.fleet.hosts[name]["models"][MODEL] = {"parallel": parallel, "queue_max": queue_max}
        self.configure(name, parallel, queue_max)
        self.settle()

    @rule(step=st.integers(0, 3))
    def time_passes(self, step: int) -> None:
        self.let_pass(self.PASSES[step])
        self.settle()

    # -- the checks ---------------------------------------------------------------------

    def took_its_end(self, request: Request) -> None:
        """The request's passage ended: with the host's head (it streams now), or not."""
        task = request.task
        if not task.cancelled() and task.exception() is None:
            request.answered = task.result()
            assert request.answered.placement is not None
            slot = request.answered.placement.slot
            assert request.holding == (slot.host, slot.model)
        else:
            if not task.cancelled():
                error = task.exception()
                assert not isinstance(error, AssertionError), error
            assert request.holding is None
            request.ended = True

    def end_stream(self, request: Request) -> None:
        assert request.answered is not None and request.answered.placement is not None
        self.act(self.lives[request.number].host_done)  # the relay: the host is done
        request.holding = None
        request.ended = True

    @invariant()
    def every_held_slot_belongs_to_a_live_request(self) -> None:
        if not hasattr(self, "fleet"):
            return
        for pair in self.pairs():
            holders = [r.number for r in self.requests if r.holding == pair]
            held = self.held(pair)
            assert held == len(holders), f"{pair}: {held} slots held, by requests {holders}"

    @invariant()
    def each_ranking_kept_is_the_order_the_chooser_gives_from_scratch(self) -> None:
        """What changes a host's place touches it in its rankings: none is ever stale."""
        if not hasattr(self, "fleet"):
            return
        for process in (0, 1):
            fleet = self.fleet_of(process)
            for route, model in ((self.route, MODEL), (fleet.routes["cpu"], SMALL)):
                assert list(fleet.ranking(route, model).hosts()) == ranked(
                    fleet.candidates(route, model)
                ), f"the ranking of {route.name} for {model} at process {process}"

    def teardown(self) -> None:
        if hasattr(self, "fleet"):
            for state in self.hosts.values():
                state.mode = "ok"
            for request in self.requests:
                if not request.task.done():
                    request.task.cancel()
            self.settle()
            for request in self.requests:
                if request.answered is not None and not request.ended:
                    self.end_stream(request)
            self.settle()
            self.every_held_slot_belongs_to_a_live_request()
            self.nothing_is_held()
        self.close()

    # -- the backing: one process's state, in virtual time --------------------------------

    CHECKS_REFUSALS = True  # at quiescence nothing moves, so a refusal can be checked at once

    def make_loop(self) -> asyncio.AbstractEventLoop:
        return VirtualLoop()

    def act(self, action: Callable[[], None]) -> None:
        """Do what the gateway does synchronously (a relay's release, a health change)."""
        action()

    def make_fleet(self, hosts: dict[str, dict[str, Any]], *routes: Route) -> MemoryFleet:
        return MemoryFleet(hosts, *routes)

    def fleet_of(self, process: int) -> MemoryFleet:
        return self.fleet  # one process

    async def rounds(self) -> None:
        # A slot declined by a watcher goes to the next one through its task: about three
        # loop turns a watcher, and a route with a fallback may have a dozen watching.
        for _ in range(120):
            await asyncio.sleep(0)

    def held(self, pair: tuple[str, str]) -> int:
        return self.fleet.limiter.in_flight(*pair)

    def set_host(self, name: str, **state: bool) -> None:
        self.fleet.set_host(name, **state)

    def mark_down(self, name: str) -> None:
        self.fleet.mark(name, healthy=False)

    def configure(self, name: str, parallel: int, queue_max: int) -> None:
        self.fleet.limiter.configure(name, MODEL, parallel, queue_max)

    def let_pass(self, seconds: float) -> None:
        cast(VirtualLoop, self.loop).now += seconds

    def nothing_is_held(self) -> None:
        for pair in self.pairs():
            assert self.fleet.limiter.queued(*pair) == 0, f"{pair} still has a line"
            slots = [self.fleet.occupy(*pair) for _ in range(self.parallel(pair))]
            for slot in slots:
                slot.release()
            assert self.fleet.limiter.in_flight(*pair) == 0, f"{pair} lost a slot"

    def close(self) -> None:
        self.loop.close()


@dataclass(frozen=True)
class _Ask:
    """What the lifecycle hands to `forward`: here, the model's own request."""

    request: Request
    fingerprint: str
    model: str | None = MODEL
    host: str = ""
    takes_slot: bool = True
    names_slot: bool = False  # no slot of its own to name
    prefix: Prefix = NO_PREFIX
    payload: None = None


class _Runtime:
    """One process's runtime as the lifecycle reads it: the fleet placement reads, a table
    of running requests, the hosts' figures; a down host asked again stays as it is."""

    def __init__(self, fleet: MemoryFleet) -> None:
        self.live = fleet
        self.running = RunningTable()
        self.figures = Figures()
        self.models = None  # no model actor: these hosts load nothing

    def arrived(self, model: str | None) -> None:
        """A request arrives: with no model actor, nobody counts it."""

    async def probe_down(self, route: object) -> None:
        pass
