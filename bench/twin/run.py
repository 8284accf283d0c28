"""One run of the twin: a workload on a fleet of one preset, the route placing by one policy,
in virtual time, to its figures. The same arguments give the same figures."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Mapping
from dataclasses import replace

from routing.core.clients import ClientSpec
from twin.clock import in_virtual_time
from twin.fleet import FleetActor
from twin.gateway import Policy, TwinAsk, TwinGateway, message
from twin.host import TwinHost
from twin.layouts import Layout
from twin.router import RouterHost
from twin.shapes import Conversation, HostProfile, Segment, Workload
from twin.tally import Figures, ModelFigures, with_waits

# The reference is asked directly, naming no slot: at llama-server's own default similarity it
# picks the slot holding most of each prompt. (At 0.95, which crossbar's hosts are advised,
# a turn adding more than 5% goes to the least recently used slot and is evaluated whole
# again: bench/twin/README.md.)
ONE_HOST_SIMILARITY = 0.1
QUEUE_PER_SLOT = 8  # each host's queue_max, per slot: room enough that a burst queues


def run(
    workload: Workload,
    preset: HostProfile,
    hosts: int,
    policy: Policy,
    clients: Mapping[str, ClientSpec] | None = None,
    by_client: bool = False,
) -> Figures:
    """The figures of `workload` on `hosts` hosts of `preset`, placed by `policy`; with
    `clients`, the workload's clients present those keys (`TwinGateway`), and with
    `by_client` the figures have each client's part."""
    random.seed(workload.seed)  # the prefix index's salts: the same run, the same table
    return in_virtual_time(_run(workload, preset, hosts, policy, clients, by_client))


async def _run(
    workload: Workload,
    preset: HostProfile,
    hosts: int,
    policy: Policy,
    clients: Mapping[str, ClientSpec] | None,
    by_client: bool,
) -> Figures:
    model = workload.models[0]
    preset = serving(preset, model)
    if policy.one_host:
        similarity = ONE_HOST_SIMILARITY if policy.similarity is None else policy.similarity
        preset, hosts = one_host(preset, hosts, model, similarity, policy.compute), 1
    names = [f"h{number:04d}" for number in range(hosts)]
    twins = {name: TwinHost(name, preset, model) for name in names}
    gateway = TwinGateway(
        twins, model, policy.patience, queue_max=QUEUE_PER_SLOT * preset.slots,
        seed=workload.seed, name_slots=not policy.one_host, clients=clients, by_client=by_client,
    )  # fmt: skip
    loop = asyncio.get_running_loop()
    for restart in () if policy.one_host else workload.restarts:
        name = names[restart.host % hosts]
        loop.call_at(restart.at, gateway.restart, name, restart.down)
    await _talk(gateway, workload, by_model=False)
    return with_waits(gateway.tally.figures(names), gateway.learnt.waits)


def run_models(
    workload: Workload, preset: HostProfile, layout: Layout, patience: float | None = None
) -> Figures:
    """The figures of `workload`, every one of its models served, on router-mode hosts of
    `preset` laid out as `layout` says (one host a name of it), crossbar's route over them all
    placing with `patience` (None: auto). The workload's models are the preset's, in order."""
    return run_models_logged(workload, preset, layout, patience)[0]


def run_models_logged(
    workload: Workload, preset: HostProfile, layout: Layout, patience: float | None = None
) -> tuple[Figures, FleetActor | None]:
    """`run_models`' figures, and the fleet actor when the layout is placed (its decisions,
    `log`, and the most models each host held, `most_held`)."""
    random.seed(workload.seed)
    return in_virtual_time(_run_models(workload, preset, layout, patience))


async def _run_models(
    workload: Workload, preset: HostProfile, layout: Layout, patience: float | None
) -> tuple[Figures, FleetActor | None]:
    upstream = dict(zip(workload.models, preset.models, strict=False))
    names = sorted(layout.serves)
    twins = {
        name: RouterHost(name, preset, autoload=layout.autoload,
                         loaded=(upstream[m] for m in layout.loaded.get(name, ())))
        for name in names
    }  # fmt: skip
    gateway = TwinGateway(
        twins, workload.models[0], patience, queue_max=QUEUE_PER_SLOT * preset.slots,
        seed=workload.seed, serves={n: {m: upstream[m] for m in layout.serves[n]} for n in names},
    )  # fmt: skip
    actor = None
    if layout.placed:
        idle = {} if layout.idle_unload is None else {"idle_unload": layout.idle_unload}
        actor = FleetActor(gateway, twins, upstream, **idle)
    else:
        await gateway.place_no_models()
    await _talk(gateway, workload, by_model=True)
    if actor is not None:
        actor.close()
    figures = gateway.tally.figures(names)
    by_model = {model.model: model for model in figures.by_model}
    return replace(figures, by_model=tuple(
        replace(by_model.get(model, ModelFigures(model, 0, 0, 0, (0.0, 0.0))),
                loads=sum(twin.loads[name] for twin in twins.values()),
                loading_s=sum(twin.loading_s.get(name, 0.0) for twin in twins.values()))
        for model, name in upstream.items()
    )), actor  # fmt: skip


async def _talk(gateway: TwinGateway, workload: Workload, by_model: bool) -> None:
    """The workload's conversations, each from its start (naming its model when `by_model`,
    else the route's default), until the last has ended; then the gateway closes."""
    loop = asyncio.get_running_loop()
    talks: set[asyncio.Task[None]] = set()
    for conversation in workload.conversations():
        delay = conversation.start - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        model = conversation.model if by_model else ""
        talk = asyncio.create_task(_converse(gateway, conversation, model))
        talks.add(talk)
        talk.add_done_callback(talks.discard)
    while talks:
        await asyncio.gather(*talks)
    gateway.tally.elapsed_s = loop.time()
    await gateway.aclose()


def serving(preset: HostProfile, model: str) -> HostProfile:
    """`preset` serving its (first) model under the workload's name for it."""
    return replace(preset, models={model: next(iter(preset.models.values()))})


def one_host(
    preset: HostProfile,
    hosts: int,
    model: str,
    similarity: float = ONE_HOST_SIMILARITY,
    compute: int | None = None,
) -> HostProfile:
    """One host with the slots and host memory of `hosts` hosts of `preset`, and the compute
    of `compute` of them (all, by default): every conversation's cache in one place, the
    reference for prompt tokens evaluated."""
    speeds = preset.models[model]
    per_stream = speeds.decode_tps
    times = hosts if compute is None else compute
    scaled = replace(
        speeds,
        prefill_tps=speeds.prefill_tps * times,
        restore_tps=speeds.restore_tps * times,
        decode_tps=tuple(per_stream[min(-(-n // times), len(per_stream)) - 1]
                         for n in range(1, len(per_stream) * times + 1)),
    )  # fmt: skip
    return replace(
        preset, slots=preset.slots * hosts, cache_ram_mib=preset.cache_ram_mib * hosts,
        models={model: scaled}, similarity=similarity,
    )  # fmt: skip


async def _converse(gateway: TwinGateway, conversation: Conversation, model: str) -> None:
    """The conversation's turns, one after the other, each after its pause. Its opening is
    system messages and then its first user message (what names the conversation)."""
    prompt = conversation.opening
    last = len(prompt) - 1
    messages = [message(s, "user" if at == last else "system") for at, s in enumerate(prompt)]
    answer: Segment | None = None
    for number, turn in enumerate(conversation.turns):
        if number:
            await asyncio.sleep(turn.pause)
            if turn.keeps_answer and answer is not None:
                prompt = (*prompt, answer)
                messages = [*messages, message(answer, "assistant")]
        prompt = (*prompt, *turn.added)
        messages = [*messages, *(message(segment, "user") for segment in turn.added)]
        # Answers' ids are negative: no workload segment has one.
        made = Segment(-(conversation.id * 4096 + number + 1), turn.max_tokens)
        ask = TwinAsk(prompt, messages, turn.max_tokens, made, model)
        outcome = await gateway.ask(ask, conversation.client)
        answer = made if outcome.status < 400 else None
