"""Fleet placement's decision: which model is loaded where, and why.

Plain examples of each rule, then a model in virtual time (demand arriving, requests starting
and ending, loads ending or failing, time passing, the operator pinning) with every decision
applied, whose invariants hold after every step.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from routing.core.model_placement import (
    DEFAULT_LOAD_S,
    SWAP_WINDOW,
    Action,
    Demand,
    Host,
    Load,
    Model,
    ModelOnHost,
    ModelRules,
    Snapshot,
    Status,
    Unload,
    Unplaced,
    decide,
)

LOADED = ModelOnHost(Status.LOADED, since=0.0, last_used=1000.0)


def fleet(
    hosts: Mapping[str, Host],
    models: Mapping[str, Model],
    pairs: Mapping[tuple[str, str], ModelOnHost] | None = None,
) -> Snapshot:
    """Every host lists every model, unloaded unless `pairs` says otherwise."""
    every = {(h, m): ModelOnHost() for h in hosts for m in models}
    return Snapshot(hosts, models, every | dict(pairs or {}))


def asked(waiting: int, **rules: object) -> Model:
    return Model(Demand(waiting=waiting), ModelRules(**rules))  # type: ignore[arg-type]


def loads(actions: list[Action]) -> list[tuple[str, str]]:
    return [(a.host, a.model) for a in actions if isinstance(a, Load)]


def unloads(actions: list[Action]) -> list[tuple[str, str]]:
    return [(a.host, a.model) for a in actions if isinstance(a, Unload)]


# -- a model asked for and loaded nowhere ----------------------------------------------------


def test_a_model_asked_for_and_loaded_nowhere_is_loaded_on_the_host_with_the_cheapest_load() -> (
    None
):
    snapshot = fleet(
        {"gpu1": Host(2), "gpu2": Host(2)},
        {"chat": asked(3)},
        {("gpu1", "chat"): ModelOnHost(load_s=9.0), ("gpu2", "chat"): ModelOnHost(load_s=3.0)},
    )
    actions = decide(snapshot, now=1000.0)
    assert actions == [Load("gpu2", "chat", "demand: 3 waiting, loaded nowhere; load 3 s on gpu2")]


def test_a_host_with_free_room_is_chosen_before_a_faster_one_that_must_unload() -> None:
    snapshot = fleet(
        {"gpu1": Host(1), "gpu2": Host(1)},
        {"chat": asked(1), "coder": Model()},
        {("gpu1", "chat"): ModelOnHost(load_s=2.0), ("gpu1", "coder"): LOADED},
    )
    assert loads(decide(snapshot, now=1000.0)) == [("gpu2", "chat")]


def test_making_room_unloads_the_least_valuable_idle_model_and_says_for_whom() -> None:
    busy_yesterday = ModelOnHost(Status.LOADED, last_used=900.0)
    snapshot = fleet(
        {"gpu1": Host(2)},
        {"chat": asked(2), "coder": Model(Demand(rate=0.5)), "small": Model(Demand(rate=0.1))},
        {("gpu1", "coder"): busy_yesterday, ("gpu1", "small"): busy_yesterday},
    )
    actions = decide(snapshot, now=1000.0)
    assert actions[0] == Unload("gpu1", "small", "making room for chat")
    assert loads(actions) == [("gpu1", "chat")]


def test_a_model_with_requests_running_or_waiting_is_never_unloaded_to_make_room() -> None:
    snapshot = fleet(
        {"gpu1": Host(2)},
        {"chat": asked(1), "coder": Model(Demand(running=1)), "small": Model(Demand(waiting=1))},
        {
            ("gpu1", "coder"): ModelOnHost(Status.LOADED, running=1),
            ("gpu1", "small"): ModelOnHost(Status.LOADED, waiting=1),
        },
    )
    actions = decide(snapshot, now=1000.0)
    assert actions == [
        Unplaced("chat", "no host: gpu1 full, and nothing there may be unloaded"),
    ]


def test_a_model_idle_on_a_host_but_waited_for_elsewhere_is_not_unloaded() -> None:
    snapshot = fleet(
        {"gpu1": Host(1)},
        {"chat": asked(1), "coder": Model(Demand(waiting=4), ModelRules(idle_unload=1.0))},
        {("gpu1", "coder"): ModelOnHost(Status.LOADED, last_used=0.0)},
    )
    assert unloads(decide(snapshot, now=1000.0)) == []


def test_a_model_within_its_minimum_residency_is_not_unloaded_to_make_room() -> None:
    snapshot = fleet(
        {"gpu1": Host(1, min_residency=60.0)},
        {"chat": asked(1), "coder": Model()},
        {("gpu1", "coder"): ModelOnHost(Status.LOADED, since=950.0, last_used=950.0)},
    )
    assert unloads(decide(snapshot, now=1000.0)) == []
    assert unloads(decide(snapshot, now=1010.0)) == [("gpu1", "coder")]


def test_memory_counts_each_models_size_when_the_host_gives_its_memory() -> None:
    snapshot = fleet(
        {"gpu1": Host(3, memory_gb=24.0), "gpu2": Host(3, memory_gb=48.0)},
        {"big": Model(Demand(waiting=1), size_gb=30.0)},
        {("gpu1", "big"): ModelOnHost(load_s=1.0)},
    )
    assert loads(decide(snapshot, now=1000.0)) == [("gpu2", "big")]


def test_a_host_the_model_is_not_allowed_on_is_never_chosen() -> None:
    snapshot = fleet({"gpu1": Host(2), "gpu2": Host(2)}, {"chat": asked(1, hosts={"gpu2"})})
    assert loads(decide(snapshot, now=1000.0)) == [("gpu2", "chat")]


# -- a line that outgrows its hosts --------------------------------------------------------


# gpu2 holds "docs", idle 100 s and long loaded: a copy of chat there would unload it.
FULL_GPU2 = {("gpu2", "docs"): ModelOnHost(Status.LOADED, since=0.0, last_used=900.0)}


def test_a_line_priced_above_the_load_unloads_an_idle_model_for_a_copy() -> None:
    snapshot = fleet(
        {"gpu1": Host(2), "gpu2": Host(1)},
        {"chat": Model(Demand(waiting=12, running=3), service_s=10.0), "docs": asked(0)},
        {
            ("gpu1", "chat"): ModelOnHost(Status.LOADED, running=3, waiting=12, slots=3),
            ("gpu2", "chat"): ModelOnHost(load_s=3.0),
            **FULL_GPU2,
        },
    )
    reason = "demand: 12 waiting, priced wait 40 s > load 3 s on gpu2"
    assert decide(snapshot, now=1000.0) == [
        Unload("gpu2", "docs", "making room for chat"),
        Load("gpu2", "chat", reason),
    ]


def test_a_line_priced_below_the_load_unloads_nothing_and_waits_where_it_is() -> None:
    snapshot = fleet(
        {"gpu1": Host(2), "gpu2": Host(1)},
        {"chat": Model(Demand(waiting=2, running=1), service_s=1.0), "docs": asked(0)},
        {("gpu1", "chat"): ModelOnHost(Status.LOADED, running=1, waiting=2, slots=1), **FULL_GPU2},
    )
    assert decide(snapshot, now=1000.0) == []


def test_a_line_its_copies_cannot_take_gets_a_copy_at_once_where_a_host_has_free_room() -> None:
    """Priced below the load, and loaded all the same: room nobody uses costs nothing."""
    snapshot = fleet(
        {"gpu1": Host(2), "gpu2": Host(2)},
        {"chat": Model(Demand(waiting=2, running=1), service_s=1.0)},
        {("gpu1", "chat"): ModelOnHost(Status.LOADED, running=1, waiting=2, slots=1)},
    )
    assert decide(snapshot, now=1000.0) == [
        Load("gpu2", "chat", "demand: 2 waiting, free room on gpu2")
    ]


def test_a_model_is_loaded_on_the_least_busy_host_then_the_one_holding_fewest_models() -> None:
    busy = ModelOnHost(Status.LOADED, since=0.0, last_used=1000.0, running=2)
    snapshot = fleet(
        {"gpu1": Host(3), "gpu2": Host(3), "gpu3": Host(3)},
        {"chat": asked(1), "docs": asked(0), "code": asked(0)},
        {("gpu1", "docs"): busy, ("gpu2", "docs"): LOADED, ("gpu2", "code"): LOADED,
         ("gpu3", "code"): LOADED},
    )  # fmt: skip
    assert loads(decide(snapshot, now=1000.0)) == [("gpu3", "chat")]


def test_a_model_already_loading_gets_no_second_load_for_the_same_demand() -> None:
    snapshot = fleet(
        {"gpu1": Host(2), "gpu2": Host(2)},
        {"chat": asked(50)},
        {("gpu1", "chat"): ModelOnHost(Status.LOADING, since=999.0)},
    )
    assert decide(snapshot, now=1000.0) == []


# -- the operator's rules ------------------------------------------------------------------


def test_a_host_that_spent_its_swap_budget_loads_nothing_until_its_minute_passes() -> None:
    host = Host(2, swap_budget=2, recent_loads=(950.0, 990.0))
    snapshot = fleet({"gpu1": host}, {"chat": asked(1)})
    assert decide(snapshot, now=1000.0) == [
        Unplaced("chat", "no host: gpu1 swap budget of 2 loads a minute spent"),
    ]
    assert loads(decide(snapshot, now=950.0 + SWAP_WINDOW)) == [("gpu1", "chat")]


def test_a_failed_host_is_skipped_until_its_back_off_ends() -> None:
    failed = ModelOnHost(Status.FAILED, failed_until=1030.0, load_s=1.0)
    snapshot = fleet(
        {"gpu1": Host(2), "gpu2": Host(2)}, {"chat": asked(1)}, {("gpu1", "chat"): failed}
    )
    assert loads(decide(snapshot, now=1000.0)) == [("gpu2", "chat")]
    assert loads(decide(snapshot, now=1030.0)) == [("gpu1", "chat")]


def test_a_model_idle_past_idle_unload_is_unloaded_with_its_idle_time_as_the_reason() -> None:
    snapshot = fleet(
        {"gpu1": Host(2)},
        {"chat": asked(0, idle_unload=300.0)},
        {("gpu1", "chat"): ModelOnHost(Status.LOADED, last_used=400.0)},
    )
    assert decide(snapshot, now=1000.0) == [
        Unload("gpu1", "chat", "idle 600 s past idle_unload 300 s"),
    ]


def test_a_pinned_model_is_never_unloaded_for_idleness_or_room() -> None:
    snapshot = fleet(
        {"gpu1": Host(1)},
        {"chat": asked(0, idle_unload=300.0, pinned={"gpu1"}), "coder": asked(1)},
        {("gpu1", "chat"): ModelOnHost(Status.LOADED, last_used=0.0)},
    )
    assert unloads(decide(snapshot, now=1000.0)) == []


def test_a_pinned_model_that_is_not_loaded_where_it_is_pinned_is_loaded_there() -> None:
    snapshot = fleet({"gpu1": Host(2), "gpu2": Host(2)}, {"chat": asked(0, pinned={"gpu2"})})
    assert decide(snapshot, now=1000.0) == [Load("gpu2", "chat", "pinned")]


def test_a_model_pinned_on_two_hosts_gets_one_load_per_decision() -> None:
    snapshot = fleet(
        {"gpu1": Host(2), "gpu2": Host(2)}, {"chat": asked(0, pinned={"gpu1", "gpu2"})}
    )
    assert loads(decide(snapshot, now=1000.0)) == [("gpu1", "chat")]


def test_a_pinned_load_counts_toward_min_loaded_in_the_same_decision() -> None:
    rules = {"min_loaded": 2, "pinned": {"gpu2"}}
    snapshot = fleet({"gpu1": Host(2), "gpu2": Host(2)}, {"chat": asked(0, **rules)})
    assert decide(snapshot, now=1000.0) == [Load("gpu2", "chat", "pinned")]


def test_min_loaded_loads_a_model_nobody_asks_for_and_keeps_it_from_idle_unload() -> None:
    rules = {"min_loaded": 1, "idle_unload": 300.0}
    snapshot = fleet({"gpu1": Host(2)}, {"chat": asked(0, **rules)})
    assert decide(snapshot, now=1000.0) == [Load("gpu1", "chat", "min_loaded 1")]
    idle = fleet({"gpu1": Host(2)}, {"chat": asked(0, **rules)}, {("gpu1", "chat"): LOADED})
    assert decide(idle, now=9000.0) == []


def test_max_loaded_stops_a_long_line_from_taking_another_host() -> None:
    snapshot = fleet(
        {"gpu1": Host(2), "gpu2": Host(2)},
        {"chat": Model(Demand(waiting=100), ModelRules(max_loaded=1))},
        {("gpu1", "chat"): ModelOnHost(Status.LOADED, waiting=100)},
    )
    assert decide(snapshot, now=1000.0) == []


def test_an_unmeasured_load_is_priced_at_the_default() -> None:
    snapshot = fleet(
        {"gpu1": Host(2), "gpu2": Host(2)},
        {"chat": Model(Demand(waiting=1, running=1), service_s=DEFAULT_LOAD_S + 1.0)},
        {("gpu1", "chat"): ModelOnHost(Status.LOADED, running=1, waiting=1)},
    )
    assert loads(decide(snapshot, now=1000.0)) == [("gpu2", "chat")]


def test_requests_its_loaded_copies_have_free_slots_for_get_no_copy_more() -> None:
    """Waiting for a load that has just ended, say: they go to the copy's free slots now."""
    free = fleet(
        {"gpu1": Host(2), "gpu2": Host(2)},
        {"chat": Model(Demand(waiting=2, running=1), service_s=100.0)},
        {("gpu1", "chat"): ModelOnHost(Status.LOADED, running=1, slots=3, load_s=1.0)},
    )
    assert decide(free, now=1000.0) == []
    full = fleet(
        {"gpu1": Host(2), "gpu2": Host(2)},
        {"chat": Model(Demand(waiting=3, running=1), service_s=100.0)},
        {("gpu1", "chat"): ModelOnHost(Status.LOADED, running=1, slots=3, load_s=1.0)},
    )
    assert loads(decide(full, now=1000.0)) == [("gpu2", "chat")]


# -- the decisions applied, in virtual time --------------------------------------------------

HOSTS = ("h0", "h1", "h2")
MODELS = ("m0", "m1", "m2", "m3")
BUDGET = 2
RESIDENCY = 30.0
BACK_OFF = 45.0


class FleetModel(RuleBasedStateMachine):
    """Three hosts with room for two of four models; demand arrives in bursts at random models,
    requests start and end, loads end or fail, time passes, the operator pins and unpins; after
    each `decide` its actions are applied and checked."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 1000.0
        self.pairs = {(h, m): ModelOnHost() for h in HOSTS for m in MODELS}
        self.pool: defaultdict[str, int] = defaultdict(int)  # waiting for a load
        self.load_times: defaultdict[str, list[float]] = defaultdict(list)
        self.rules_of: dict[str, ModelRules] = {}
        self.sizes = {"m0": 10.0, "m1": 10.0, "m2": 25.0, "m3": 5.0}

    @initialize(data=st.data())
    def operator_rules(self, data: st.DataObject) -> None:
        for model in MODELS:
            allowed = data.draw(st.none() | st.frozensets(st.sampled_from(HOSTS), min_size=1))
            self.rules_of[model] = ModelRules(
                min_loaded=data.draw(st.integers(0, 1)),
                max_loaded=data.draw(st.none() | st.integers(1, 2)),
                hosts=allowed,
                idle_unload=data.draw(st.sampled_from([None, 20.0, 120.0])),
            )

    # -- the world ------------------------------------------------------------------------

    def loaded_on(self, model: str) -> list[str]:
        return [h for h in HOSTS if self.pairs[h, model].status is Status.LOADED]

    def set(self, host: str, model: str, **changes: Any) -> None:
        self.pairs[host, model] = replace(self.pairs[host, model], **changes)

    @rule(model=st.sampled_from(MODELS), count=st.integers(1, 12))
    def requests_arrive(self, model: str, count: int) -> None:
        hosts = self.loaded_on(model)
        if not hosts:
            self.pool[model] += count
            return
        host = hosts[0]
        self.set(host, model, waiting=self.pairs[host, model].waiting + count)

    @rule(data=st.data(), count=st.integers(1, 12))
    def requests_start(self, data: st.DataObject, count: int) -> None:
        lines = [p for p, s in self.pairs.items() if s.waiting and s.status is Status.LOADED]
        if lines:
            host, model = data.draw(st.sampled_from(sorted(lines)))
            state = self.pairs[host, model]
            count = min(count, state.waiting)
            self.set(host, model, waiting=state.waiting - count, running=state.running + count,
                     last_used=self.now)  # fmt: skip

    @rule(data=st.data(), count=st.integers(1, 12))
    def requests_end(self, data: st.DataObject, count: int) -> None:
        busy = sorted(p for p, s in self.pairs.items() if s.running)
        if busy:
            host, model = data.draw(st.sampled_from(busy))
            running = self.pairs[host, model].running - min(count, self.pairs[host, model].running)
            self.set(host, model, running=running, last_used=self.now)

    @rule(data=st.data(), fails=st.booleans())
    def a_load_ends(self, data: st.DataObject, fails: bool) -> None:
        loading = sorted(p for p, s in self.pairs.items() if s.status is Status.LOADING)
        if not loading:
            return
        host, model = data.draw(st.sampled_from(loading))
        if fails:
            self.set(host, model, status=Status.FAILED, failed_until=self.now + BACK_OFF)
            return
        self.set(host, model, status=Status.LOADED, since=self.now, last_used=self.now,
                 waiting=self.pool.pop(model, 0))  # fmt: skip

    @rule(seconds=st.sampled_from([1.0, 10.0, 40.0, 200.0]))
    def time_passes(self, seconds: float) -> None:
        self.now += seconds

    @rule(data=st.data())
    def the_operator_pins_or_unpins(self, data: st.DataObject) -> None:
        host, model = data.draw(st.sampled_from(sorted(self.pairs)))
        rules = self.rules_of[model]
        pinned = rules.pinned ^ {host}
        self.rules_of[model] = replace(rules, pinned=frozenset(pinned))

    # -- the decision, applied and checked ------------------------------------------------

    def snapshot(self) -> Snapshot:
        models = {}
        for model in MODELS:
            waiting = self.pool[model] + sum(self.pairs[h, model].waiting for h in HOSTS)
            running = sum(self.pairs[h, model].running for h in HOSTS)
            demand = Demand(rate=float(waiting), waiting=waiting, running=running)
            models[model] = Model(demand, self.rules_of[model], self.sizes[model], service_s=4.0)
        hosts = {
            h: Host(
                2,
                memory_gb=30.0,
                swap_budget=BUDGET,
                min_residency=RESIDENCY,
                recent_loads=tuple(self.load_times[h]),
            )  # fmt: skip
            for h in HOSTS
        }
        return Snapshot(hosts, models, dict(self.pairs))

    @rule()
    def decide_and_apply(self) -> None:
        before = self.snapshot()
        actions = decide(before, self.now)
        models_loaded = [a.model for a in actions if isinstance(a, Load)]
        assert len(models_loaded) == len(set(models_loaded)), actions
        for action in actions:
            if isinstance(action, Unload):
                self.check_unload(before, action)
                self.set(action.host, action.model, status=Status.UNLOADED)
            elif isinstance(action, Load):
                self.check_load(before, action)
                self.set(action.host, action.model, status=Status.LOADING, since=self.now)
                self.load_times[action.host].append(self.now)
        after = self.snapshot()
        for model in MODELS:
            self.check_placed_or_explained(after, model, actions)

    def check_unload(self, before: Snapshot, action: Unload) -> None:
        state = before.pairs[action.host, action.model]
        assert state.status is Status.LOADED, action
        assert state.running == 0 and state.waiting == 0, action
        assert before.models[action.model].demand.waiting == 0, action
        assert action.host not in self.rules_of[action.model].pinned, action
        assert self.now - state.since >= RESIDENCY, action
        assert len(self.held_by(action.model)) > self.rules_of[action.model].min_loaded, action

    def check_load(self, before: Snapshot, action: Load) -> None:
        state = self.pairs[action.host, action.model]
        assert state.status in (Status.UNLOADED, Status.FAILED), action
        assert state.status is Status.UNLOADED or state.failed_until <= self.now, action
        allowed = self.rules_of[action.model].hosts
        assert allowed is None or action.host in allowed | self.rules_of[action.model].pinned
        if action.reason.startswith("demand"):
            # One load in flight per model for the same demand.
            assert all(self.pairs[h, action.model].status is not Status.LOADING for h in HOSTS)

    def held_by(self, model: str) -> list[str]:
        return [h for h in HOSTS if self.pairs[h, model].status in (Status.LOADED, Status.LOADING)]

    def check_placed_or_explained(self, after: Snapshot, model: str, actions: list[Action]) -> None:
        """A model with demand, or below min_loaded, is loaded or loading somewhere, or was
        said to be unplaced: and then no allowed host could take it (checked here plainly)."""
        rules = self.rules_of[model]
        needs = after.models[model].demand.waiting > 0 and not self.held_by(model)
        below_min = len(self.held_by(model)) < rules.min_loaded
        if not (needs or below_min):
            return
        if any(isinstance(a, Load) and a.model == model for a in actions):
            return
        assert Unplaced in {type(a) for a in actions if a.model == model}, (model, actions)
        assert not self.could_take(after, model), (model, actions)

    def could_take(self, after: Snapshot, model: str) -> bool:
        rules = self.rules_of[model]
        if rules.max_loaded is not None and len(self.held_by(model)) >= rules.max_loaded:
            return False
        return any(self.host_could_take(after, host, model) for host in HOSTS)

    def host_could_take(self, after: Snapshot, host: str, model: str) -> bool:
        rules, state = self.rules_of[model], self.pairs[host, model]
        if rules.hosts is not None and host not in rules.hosts | rules.pinned:
            return False
        if state.status in (Status.LOADED, Status.LOADING):
            return False
        if state.status is Status.FAILED and state.failed_until > self.now:
            return False
        if sum(1 for t in self.load_times[host] if self.now - t < SWAP_WINDOW) >= BUDGET:
            return False
        held = [m for m in MODELS if self.pairs[host, m].status in (Status.LOADED, Status.LOADING)]
        keep = [m for m in held if not self.may_go(after, host, m)]
        return len(keep) + 1 <= 2 and sum(self.sizes[m] for m in keep) + self.sizes[model] <= 30.0

    def may_go(self, after: Snapshot, host: str, model: str) -> bool:
        state = self.pairs[host, model]
        return (
            state.status is Status.LOADED
            and state.running == 0
            and state.waiting == 0
            and after.models[model].demand.waiting == 0
            and host not in self.rules_of[model].pinned
            and self.now - state.since >= RESIDENCY
            and len(self.held_by(model)) > self.rules_of[model].min_loaded
        )

    # -- what holds after every step ------------------------------------------------------

    @invariant()
    def no_host_holds_more_than_its_room(self) -> None:
        for host in HOSTS:
            held = [
                m for m in MODELS if self.pairs[host, m].status in (Status.LOADED, Status.LOADING)
            ]
            assert len(held) <= 2, (host, held)
            assert sum(self.sizes[m] for m in held) <= 30.0, (host, held)

    @invariant()
    def no_host_loads_more_than_its_budget_in_any_window(self) -> None:
        for times in self.load_times.values():
            for t in times:
                assert sum(1 for s in times if t - SWAP_WINDOW < s <= t) <= BUDGET, times

    @invariant()
    def max_loaded_is_never_exceeded(self) -> None:
        for model, rules in self.rules_of.items():
            if rules.max_loaded is not None:
                assert len(self.held_by(model)) <= rules.max_loaded, model

    @invariant()
    def no_request_runs_or_waits_where_its_model_was_unloaded(self) -> None:
        for pair, state in self.pairs.items():
            if state.status is not Status.LOADED:
                assert state.running == 0 and state.waiting == 0, pair


FleetModel.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_the_decisions_keep_their_promises_whatever_the_demand = FleetModel.TestCase
