"""Multi-model runs on router-mode twin hosts (bench/twin/run.py `run_models`, layouts.py):
crossbar's own ranking in front of hosts that load and unload models, as the poller sees them."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

from twin.layouts import Layout, autoload, fleet, static
from twin.presets import GPU_MIXED
from twin.run import run_models, run_models_logged
from twin.shapes import Conversation, HostProfile, ModelProfile, Segment, Turn, Workload
from twin.workloads import Scale, models_shift

from routing.core.model_placement import Load, Unload


def model(name: str, load_s: float) -> ModelProfile:
    return ModelProfile(
        name, size_gb=5.0, load_s=load_s, prefill_tps=2000.0, decode_tps=(50.0, 45.0),
        restore_tps=100_000.0, kv_bytes_per_token=1024 * 1024,
    )  # fmt: skip


ROUTER = HostProfile(
    "router", slots=2, cache_ram_mib=10_000, memory_gb=48.0, models_max=2,
    models={m.name: m for m in (model("a", 4.0), model("b", 6.0), model("c", 3.0))},
)  # fmt: skip
MODELS = ("chat", "code", "reason")  # a, b and c


def conversation(number: int, start: float, name: str, turns: int = 2) -> Conversation:
    opening = (Segment(MODELS.index(name) + 1, 1000), Segment(1000 * number, 200))
    later = tuple(Turn(5.0, (Segment(1000 * number + k, 100),), 20) for k in range(1, turns))
    return Conversation(number, start, name, "default", opening, (Turn(0.0, (), 20), *later))


def workload(*conversations: Conversation) -> Workload:
    def made() -> Iterator[Conversation]:
        return iter(conversations)

    return Workload("test", 3, made, MODELS)


def test_crossbar_sends_a_request_to_the_host_where_its_model_is_loaded_not_one_that_would_load_it(
) -> None:  # fmt: skip
    # Both hosts serve every model and load on demand; only the second has `code` loaded. Alike
    # in all else, route order would pick the first: the poller's word that the model is
    # loaded there is what sends it to the second.
    hosts = ("h0000", "h0001")
    layout = Layout("test", {h: MODELS for h in hosts}, {"h0001": ("code",)}, autoload=True)

    figures = run_models(workload(conversation(1, 0.0, "code", turns=3)), ROUTER, layout)

    assert (figures.served, figures.refused) == (3, 0)
    assert figures.shares == (0.0, 1.0)
    assert figures.loads == 0


def test_crossbar_learns_of_a_load_at_the_hosts_next_poll_and_sends_the_model_there() -> None:
    # The first conversation loads `code` on the first host; the second, 30 s later, would go
    # to the other (fewer leases) had the poller not found `code` loaded on the first since.
    # (Their openings share nothing, or the prefix index would send the second there anyway.)
    second = conversation(2, 30.0, "code")
    second = replace(second, opening=(Segment(77, 1000), *second.opening[1:]))
    talks = workload(conversation(1, 0.0, "code", turns=1), second)

    figures = run_models(talks, ROUTER, autoload(("h0000", "h0001"), MODELS, 2))

    assert figures.shares == (1.0, 0.0)
    assert figures.loads == 1


def test_with_autoload_a_request_for_a_model_loaded_nowhere_waits_for_its_load() -> None:
    layout = autoload(("h0000", "h0001"), MODELS, 2)

    figures = run_models(workload(conversation(1, 0.0, "code", turns=1)), ROUTER, layout)

    (_, code, _) = figures.by_model
    assert (code.model, code.served, code.loads, code.loading_s) == ("code", 1, 1, 6.0)
    assert code.ttfb[0] >= 6.0  # b's load, then its prompt


def test_the_static_layout_deals_each_hosts_models_out_in_turn() -> None:
    layout = static(("h0", "h1", "h2"), ("chat", "code", "reason", "small"), 2)

    assert dict(layout.serves) == {
        "h0": ("chat", "code"), "h1": ("reason", "small"), "h2": ("chat", "code"),
    }  # fmt: skip
    assert layout.loaded == layout.serves and not layout.autoload


def test_the_static_layout_never_loads_after_the_start_and_serves_every_model() -> None:
    hosts = ("h0000", "h0001")
    talks = workload(*(conversation(n, n * 2.0, MODELS[n % 3], turns=3) for n in range(12)))

    fixed = run_models(talks, ROUTER, static(hosts, MODELS, 2))
    loading = run_models(talks, ROUTER, autoload(hosts, MODELS, 2))

    assert (fixed.served, fixed.refused) == (36, 0)
    assert [m.served for m in fixed.by_model] == [12, 12, 12]
    assert (fixed.loads, fixed.loading_s) == (0, 0.0)
    assert loading.loads >= 3  # the same requests, each model loaded somewhere at least once


def test_a_models_run_gives_the_same_figures_every_time() -> None:
    scale = Scale(hosts=3, slots=GPU_MIXED.slots, minutes=4.0,
                  models=("chat", "code", "reason", "small"))  # fmt: skip
    shift = models_shift(5, scale)
    layout = autoload(("h0000", "h0001", "h0002"), shift.models, GPU_MIXED.models_max)

    first = run_models(shift, GPU_MIXED, layout)
    again = run_models(shift, GPU_MIXED, layout)

    assert first == again
    assert first.loads > 0 and first.served > 0


def test_the_fleet_layout_loads_a_model_on_its_first_request_and_serves_it_after_the_load(
) -> None:  # fmt: skip
    layout = fleet(("h0000", "h0001"), MODELS, 2)

    figures, actor = run_models_logged(
        workload(conversation(1, 0.0, "code", turns=1)), ROUTER, layout
    )

    (_, code, _) = figures.by_model
    assert (code.served, code.refused, code.loads, code.loading_s) == (1, 0, 1, 6.0)
    assert code.ttfb[0] >= 6.0  # held for b's load, then its prompt
    assert actor is not None
    assert [(d.at, type(d.action), d.action.model) for d in actor.log] == [(0.0, Load, "code")]


def test_the_fleet_layout_never_loads_more_on_a_host_than_its_room() -> None:
    # One host with room for 2, asked for all three models in turn: the third waits for an
    # unload of an idle one (past its residency), never a third load beside them.
    talks = workload(*(conversation(n, n * 70.0, MODELS[n % 3]) for n in range(6)))

    figures, actor = run_models_logged(talks, ROUTER, fleet(("h0000",), MODELS, 2))

    assert actor is not None
    assert actor.most_held == {"h0000": 2}
    assert (figures.served, figures.refused) == (12, 0)
    assert figures.loads >= 3


def test_the_fleet_layout_unloads_an_idle_model_only_past_idle_unload() -> None:
    layout = replace(fleet(("h0000", "h0001"), MODELS, 2), idle_unload=100.0)
    # `code` last used at 5 s (its second turn); a `chat` conversation keeps the run going.
    talks = workload(conversation(1, 0.0, "code"), conversation(2, 0.0, "chat", turns=40))

    _, actor = run_models_logged(talks, ROUTER, layout)

    assert actor is not None
    unloads = [d for d in actor.log if isinstance(d.action, Unload)]
    code = [d.at for d in unloads if d.action.model == "code"]
    assert code, "code unloaded once idle"
    assert code[0] >= 100.0 + 5.0
    assert all(d.action.model != "chat" for d in unloads)  # in use all along


def test_a_fleet_run_gives_the_same_figures_every_time() -> None:
    scale = Scale(hosts=3, slots=GPU_MIXED.slots, minutes=4.0,
                  models=("chat", "code", "reason", "small"))  # fmt: skip
    shift = models_shift(5, scale)
    layout = fleet(("h0000", "h0001", "h0002"), shift.models, GPU_MIXED.models_max)

    first, actor = run_models_logged(shift, GPU_MIXED, layout)
    again, other = run_models_logged(shift, GPU_MIXED, layout)

    assert first == again
    assert actor is not None and other is not None and actor.log == other.log
    assert first.loads > 0 and first.served > 0
