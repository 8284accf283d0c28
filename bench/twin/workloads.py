"""The twin's workloads: seeded generators of conversations, sized to the fleet they run on.

Each generator is `name(seed, scale) -> Workload`, drawn only from `random.Random`s derived
from the seed (one for the arrivals, one per conversation), so the same seed and `Scale` give
the same conversations, byte for byte, and conversation n is made without making the others:
`Workload.conversations()` yields them lazily, in order of `start`, afresh at each call.

Segment ids say which tokens are equal: a segment shared by many conversations (a system
prompt, a model's instructions) has a small id of its own (below `OWN_IDS`); conversation n's
own segments (its task, its document, each turn's message) are numbered from
`(n + 1) * OWN_IDS` up, so that ids never collide however lazily they are made.

`Scale.load` is the fraction of the fleet's slots meant to be busy on average. A request
holds its slot while its new tokens are read and its answer is written; the generators reckon
that at `Scale.prefill_tps` and `Scale.decode_tps` (nominal speeds: a host of other speeds
is busier or idler than `load` says), counting a shared segment as read from cache, and set
their arrival rates from it, so one workload makes sense on 2 hosts of 2 slots and on 2,000.

Calibration: `calibration` is `make bench-cache`'s workload, whose messages are text. Their
tokens are reckoned, not counted: a token per run of letters (the bench's words are common
English, one token each in llama's SPM vocab, the tiny model's), per digit (numbers are split
into digits), per one or two other characters (the vocab has tokens for most pairs of JSON's
punctuation), plus ChatML's markup as llama.cpp tokenizes it. Against llama.cpp's tokenizer on
that vocab (the SPM merge run over ggml-vocab-llama-spm.gguf, which gives the vocab's own test
tokens), seed 0's 144 prompts reckon 0.1-0.7% short (420,239 tokens for 422,146); what every
conversation shares, its system message and the next message's `<|im_start|>user\nTask`,
reckons 1,672 where the two first prompts share 1,676 (bench/README.md's figure). A task's
number is shared too, digit by digit (`_bench_opening`).
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from bench_cache import parse_args, shape_of
from cache_workload import Conversation as BenchConversation
from cache_workload import Shape, make_workload

from .shapes import Conversation, HostProfile, Restart, Segment, Turn, Workload

__all__ = [
    "CALIBRATION_NUMBERS", "OWN_IDS", "WORKLOADS", "Chat", "Scale", "backlogged",
    "interactive_alone", "sized",
]  # fmt: skip

OWN_IDS = 1_000_000  # conversation n's own segments: (n + 1) * OWN_IDS and up

# The shared segments' ids, each the same tokens wherever it appears.
AGENT_SYSTEM = 1  # an agent's instructions and tool definitions
BURST_SYSTEM = 2
SHARED_SYSTEM = 3
FEW_SYSTEM = 4
INTERACTIVE_SYSTEM = 5
STANDARD_SYSTEM = 6
CALIBRATION_SYSTEM = 7  # bench-cache's system message and its task's `<|im_start|>user\nTask`
CALIBRATION_NUMBERS = 10_000  # + int("1" + digits): a task number's digits so far (below)
MODEL_SYSTEMS = 100  # + the model's number: each model's own system prompt

# Names given to the models `models_shift` needs beyond those of the scale.
MORE_MODELS = ("code", "reason", "small", "vision")

Range = tuple[int, int]

BENCH_SHAPE = shape_of(parse_args([]))  # `make bench-cache`'s workload, by default

# A token per run of letters, per digit, per one or two other characters: llama's SPM vocab
# (the tiny model's) has one token for each common English word, splits numbers into digits,
# and has tokens for most pairs of JSON's punctuation.
PIECES = re.compile(r"[A-Za-z]+|\d|[^\sA-Za-z\d]{1,2}")
# ChatML's markup in that vocab, as llama.cpp tokenizes it: `<|im_start|>{role}\n` by role,
# and `<|im_end|>\n` after a message's text.
STARTS = {"system": 9, "user": 9, "assistant": 10, "tool": 9}
END = 8


@dataclass(frozen=True, slots=True)
class Scale:
    """The fleet a workload is sized for: `hosts` of `slots` each, arrivals for `minutes`,
    `load` of the slots busy on average, reckoned at `prefill_tps` and `decode_tps` (tokens
    per second a request reads and writes at in its slot), for `models`."""

    hosts: int
    slots: int
    minutes: float
    load: float = 0.3
    models: tuple[str, ...] = ("chat",)
    prefill_tps: float = 2000.0
    decode_tps: float = 40.0

    @property
    def capacity(self) -> int:
        return self.hosts * self.slots

    @property
    def seconds(self) -> float:
        return self.minutes * 60.0


def sized(
    preset: HostProfile, hosts: int, minutes: float, models: tuple[str, ...] = ("chat",)
) -> Scale:
    """The scale of `hosts` hosts of `preset` (its first model's speeds, at its slots' decode
    speed) for `minutes` of arrivals."""
    speeds = next(iter(preset.models.values()))
    return Scale(
        hosts=hosts, slots=preset.slots, minutes=minutes, prefill_tps=speeds.prefill_tps,
        decode_tps=speeds.decode_tps[min(preset.slots, len(speeds.decode_tps)) - 1],
        models=models,
    )  # fmt: skip


@dataclass(frozen=True, slots=True)
class Chat:
    """A kind of conversation: its opening's `shared` segments then its `own` segments (a
    task; a document and a question), `turns` requests, each later one after a `pause` and
    adding an `added`-token message; each answer `answer` tokens (max_tokens), kept."""

    shared: tuple[Segment, ...]
    own: tuple[Range, ...]
    turns: Range
    pause: tuple[float, float]
    added: Range
    answer: Range

    def busy(self, scale: Scale) -> float:
        """Seconds a conversation holds a slot on average: its own and added tokens read,
        its answers written (the shared segments found in cache)."""
        turns = sum(self.turns) / 2
        read = sum(sum(own) / 2 for own in self.own) + (turns - 1) * sum(self.added) / 2
        return read / scale.prefill_tps + turns * sum(self.answer) / 2 / scale.decode_tps


# An arrival: when, the conversation's kind, its model and its client.
Arrival = tuple[float, Chat, str, str]


def agent(seed: int, scale: Scale) -> Workload:
    """Agents: a shared system prompt with tool definitions (3,000-6,000 tokens), a task of
    their own, then turn after turn the model's tool call (the answer, kept) and the tool's
    result, after the tool's run; Poisson arrivals at `scale.load`."""
    opening = random.Random(f"{seed}/agent/opening").randint(3000, 6000)
    kind = Chat((Segment(AGENT_SYSTEM, opening),), ((100, 400),), (4, 16), (1.0, 20.0),
                (100, 1000), (50, 300))  # fmt: skip
    return _steady("agent", seed, scale, kind)


def long_docs(seed: int, scale: Scale) -> Workload:
    """A person and a document of their own (2,000-8,000 tokens) and a question, then 3-10
    short questions after 10-60 s of reading; answers of 100-500 tokens, kept. Nothing shared."""
    kind = Chat((), ((2000, 8000), (20, 100)), (4, 11), (10.0, 60.0), (20, 100), (100, 500))
    return _steady("long_docs", seed, scale, kind)


def shared_opening(seed: int, scale: Scale) -> Workload:
    """Conversations that all open with the same 4,000-token system prompt and diverge after
    it: a first message of their own, 2-5 turns."""
    kind = Chat((Segment(SHARED_SYSTEM, 4000),), ((50, 300),), (2, 5), (5.0, 30.0), (20, 200),
                (100, 300))  # fmt: skip
    return _steady("shared_opening", seed, scale, kind)


def restart(seed: int, scale: Scale) -> Workload:
    """`agent`'s conversations, and a host restarted at 40% of the arrivals' time; on more
    than 2 hosts another one at 70%."""
    hosts = random.Random(f"{seed}/restart").sample(range(scale.hosts), min(2, scale.hosts))
    restarts = [Restart(0.4 * scale.seconds, hosts[0])]
    if scale.hosts > 2:
        restarts.append(Restart(0.7 * scale.seconds, hosts[1]))
    base = agent(seed, scale)
    return Workload("restart", seed, base.conversations, base.models, restarts=tuple(restarts))


def bursts(seed: int, scale: Scale, gap: float = 180.0, spread: float = 2.0) -> Workload:
    """Every `gap` seconds a burst of 2-4x the fleet's slots of new conversations, arriving
    within about `spread` seconds: a shared 2,000-token opening, their own message, 2-5 turns."""
    kind = Chat((Segment(BURST_SYSTEM, 2000),), ((200, 1000),), (2, 5), (2.0, 15.0),
                (50, 300), (100, 400))  # fmt: skip
    model = scale.models[0]

    def arrivals() -> Iterator[Arrival]:
        rng = random.Random(f"{seed}/bursts/arrivals")
        for at in itertools.takewhile(lambda t: t < scale.seconds, itertools.count(0.0, gap)):
            size = rng.randint(2 * scale.capacity, 4 * scale.capacity)
            for start in itertools.islice(_poisson(rng, size / spread, at, math.inf), size):
                yield start, kind, model, "default"

    return _workload("bursts", seed, arrivals, (model,))


def models_shift(seed: int, scale: Scale, phase: float = 180.0, focus: float = 0.8) -> Workload:
    """Chats with several models (those of the scale, at least 3): for `phase` seconds `focus`
    of the arrivals go to one model, then to another, the rest spread over all of them."""
    models = (*scale.models, *[m for m in MORE_MODELS if m not in scale.models])
    models = models[: max(3, len(scale.models))]
    kinds = [Chat((Segment(MODEL_SYSTEMS + n, 1000),), ((50, 500),), (2, 6), (5.0, 30.0),
                  (20, 300), (100, 400)) for n in range(len(models))]  # fmt: skip
    rate = _rate(scale, scale.load, kinds[0])

    def arrivals() -> Iterator[Arrival]:
        rng = random.Random(f"{seed}/models_shift/arrivals")
        order = rng.sample(range(len(models)), len(models))
        for start in _poisson(rng, rate, 0.0, scale.seconds):
            favoured = order[int(start // phase) % len(order)]
            n = favoured if rng.random() < focus else rng.randrange(len(models))
            yield start, kinds[n], models[n], "default"

    return _workload("models_shift", seed, arrivals, models)


# The `clients` workload's kinds of conversation.
INTERACTIVE_CHAT = Chat((Segment(INTERACTIVE_SYSTEM, 300),), ((20, 200),), (2, 6), (5.0, 20.0),
                        (20, 150), (50, 200))  # fmt: skip
BATCH_SUMMARY = Chat((), ((3000, 10000), (30, 60)), (1, 1), (0.0, 0.0), (0, 0), (500, 1000))
STANDARD_CHAT = Chat((Segment(STANDARD_SYSTEM, 1500),), ((100, 600),), (2, 6), (5.0, 30.0),
                     (50, 400), (100, 400))  # fmt: skip


def clients(seed: int, scale: Scale) -> Workload:
    """Three clients: `interactive` (short chats, 30% of the fleet's capacity), `batch`
    (document summaries: a long prompt of its own, one turn, a long answer; 4x the capacity)
    and `standard` (chats taking the rest of `scale.load`, at least 10%)."""
    shares = {"interactive": (INTERACTIVE_CHAT, 0.3), "batch": (BATCH_SUMMARY, 4.0),
              "standard": (STANDARD_CHAT, max(0.1, scale.load - 0.3))}  # fmt: skip
    return _clients("clients", seed, scale, shares)


def interactive_alone(seed: int, scale: Scale) -> Workload:
    """`clients`' interactive conversations alone, the same ones (the others never come):
    what its client sees with the fleet to itself."""
    both = clients(seed, scale)

    def conversations() -> Iterator[Conversation]:
        return (c for c in both.conversations() if c.client == "interactive")

    return Workload("interactive_alone", seed, conversations, both.models, ("interactive",))


def backlogged(seed: int, scale: Scale, each: float = 2.0) -> Workload:
    """Two clients, `light` and `heavy`, each sending `clients`' batch summaries at `each`
    times the fleet's capacity: both always have requests waiting."""
    shares = {"light": (BATCH_SUMMARY, each), "heavy": (BATCH_SUMMARY, each)}
    return _clients("backlogged", seed, scale, shares)


def _clients(name: str, seed: int, scale: Scale, shares: dict[str, tuple[Chat, float]]) -> Workload:
    """Each client's own Poisson stream of its kind, keeping its share of the slots busy."""
    model = scale.models[0]

    def stream(client: str, kind: Chat, share: float) -> Iterator[Arrival]:
        rng = random.Random(f"{seed}/{name}/{client}")
        for start in _poisson(rng, _rate(scale, share, kind), 0.0, scale.seconds):
            yield start, kind, model, client

    def arrivals() -> Iterator[Arrival]:
        streams = [stream(client, kind, share) for client, (kind, share) in shares.items()]
        return heapq.merge(*streams, key=lambda arrival: arrival[0])

    return _workload(name, seed, arrivals, (model,), tuple(shares))


def few(seed: int, scale: Scale, over: float = 30.0) -> Workload:
    """Half as many conversations as the fleet has slots, arriving over `over` seconds, each
    going on with turn after turn (5-30 s apart) until the arrivals' time is over."""
    count = max(1, scale.capacity // 2)
    kind = Chat((Segment(FEW_SYSTEM, 1000),), ((100, 500),), (1, 1), (5.0, 30.0), (50, 300),
                (100, 300))  # fmt: skip
    # Turns enough to last the run: its seconds over a turn's pause and nominal time in a slot.
    per_turn = sum(kind.pause) / 2 + kind.busy(scale)
    turns = max(2, math.ceil(scale.seconds / per_turn))
    kind = Chat(kind.shared, kind.own, (turns, turns), kind.pause, kind.added, kind.answer)
    model = scale.models[0]

    def arrivals() -> Iterator[Arrival]:
        rng = random.Random(f"{seed}/few/arrivals")
        starts = _poisson(rng, count / over, 0.0, math.inf)
        return ((start, kind, model, "default") for start in itertools.islice(starts, count))

    return _workload("few", seed, arrivals, (model,))


def _steady(name: str, seed: int, scale: Scale, kind: Chat) -> Workload:
    """Conversations of `kind` arriving as a Poisson process that keeps `scale.load` busy."""
    model, rate = scale.models[0], _rate(scale, scale.load, kind)

    def arrivals() -> Iterator[Arrival]:
        starts = _poisson(random.Random(f"{seed}/{name}/arrivals"), rate, 0.0, scale.seconds)
        return ((start, kind, model, "default") for start in starts)

    return _workload(name, seed, arrivals, (model,))


def _workload(
    name: str,
    seed: int,
    arrivals: Callable[[], Iterator[Arrival]],
    models: tuple[str, ...],
    clients: tuple[str, ...] = ("default",),
) -> Workload:
    def conversations() -> Iterator[Conversation]:
        for index, (start, kind, model, client) in enumerate(arrivals()):
            rng = random.Random(f"{seed}/{name}/{index}")
            yield _conversation(kind, index, start, model, client, rng)

    return Workload(name, seed, conversations, models, clients)


def _conversation(
    kind: Chat, index: int, start: float, model: str, client: str, rng: random.Random
) -> Conversation:
    ids = itertools.count((index + 1) * OWN_IDS)
    opening = kind.shared + tuple(Segment(next(ids), rng.randint(*own)) for own in kind.own)
    turns = [Turn(0.0, (), rng.randint(*kind.answer))]
    for _ in range(rng.randint(*kind.turns) - 1):
        added = (Segment(next(ids), rng.randint(*kind.added)),)
        turns.append(Turn(round(rng.uniform(*kind.pause), 3), added, rng.randint(*kind.answer)))
    return Conversation(index, start, model, client, opening, tuple(turns))


def _rate(scale: Scale, share: float, kind: Chat) -> float:
    """Conversations per second of `kind` that keep `share` of the fleet's slots busy."""
    return share * scale.capacity / kind.busy(scale)


def _poisson(rng: random.Random, rate: float, begin: float, end: float) -> Iterator[float]:
    """Arrival times of a Poisson process of `rate` per second from `begin` until `end`."""
    at = begin + rng.expovariate(rate)
    while at < end:
        yield round(at, 3)
        at += rng.expovariate(rate)


def calibration(seed: int, scale: Scale) -> Workload:
    """`make bench-cache`'s main phase (bench/cache_workload.py at bench_cache.py's default
    options, drawn from `seed`), message for message, with its starts and pauses; the scale
    gives only the model. Not sized by the scale: the bench sends the same workload to every
    policy and fleet. The bench writes each assistant message itself, so a turn adds it as a
    segment of its own (`keeps_answer` False), then the tool's result."""
    return _calibration("calibration", seed, scale, BENCH_SHAPE)


def _calibration(name: str, seed: int, scale: Scale, shape: Shape) -> Workload:
    model = scale.models[0]

    def conversations() -> Iterator[Conversation]:
        # The bench's 24 conversations are small; it makes them all at once, and so does this.
        made = sorted(make_workload(shape, seed).conversations, key=lambda c: c.start)
        for conversation in made:
            yield _bench_conversation(conversation, model)

    return Workload(name, seed, conversations, (model,))


def _bench_conversation(conversation: BenchConversation, model: str) -> Conversation:
    """Each message a segment of the tokens `_tokens` reckons it renders to in ChatML (the tiny
    model's template); the generation prompt that ends each request (`<|im_start|>assistant`)
    goes with the message before it, since the next request's assistant message begins so."""
    ids = itertools.count((conversation.number + 1) * OWN_IDS)
    messages = conversation.turns[-1].messages
    opening = _bench_opening(messages[0], messages[1], next(ids))
    turns = [Turn(0.0, (), BENCH_SHAPE.max_tokens)]
    for before, turn in itertools.pairwise(conversation.turns):
        call, result = turn.messages[len(before.messages) :]
        called = Segment(next(ids), _tokens(call) - STARTS["assistant"])
        answered = Segment(next(ids), _tokens(result) + STARTS["assistant"])
        turns.append(Turn(before.pause_after, (called, answered), BENCH_SHAPE.max_tokens, False))
    return Conversation(conversation.number, conversation.start, model, "default",
                        opening, tuple(turns))  # fmt: skip


def _bench_opening(system: dict[str, str], task: dict[str, str], own: int) -> tuple[Segment, ...]:
    """The system message and the task (`Task <n>: ...`) as llama.cpp's tokens share them
    between conversations: every one shares the system message and the task's
    `<|im_start|>user\nTask` (the 1,676 tokens bench/README.md measured); then the number, a
    token a digit, shared digit by digit with every conversation whose number starts so (task 1,
    10 and 11 share `1`); then its own words. That one token counts: llama-server restores a
    saved prompt that keeps more of a request than its slot does, however little more, and
    takes it out of host memory (`PromptCache.load`): task 10's opening, in a slot that holds
    task 3's history, can take task 1's, and task 1's next turn then finds only the system
    message."""
    number = re.match(r"Task (\d+)", task["content"])
    if number is None:
        raise ValueError(f"a bench task opens with `Task <n>`, not {task['content'][:20]!r}")
    digits = number[1]
    head = STARTS[task["role"]] + 1  # `<|im_start|>user\n` and `Task`
    shared = Segment(CALIBRATION_SYSTEM, 1 + _tokens(system) + head)  # 1: the BOS token
    numbered = tuple(
        Segment(CALIBRATION_NUMBERS + int("1" + digits[: at + 1]), 1) for at in range(len(digits))
    )
    rest = _tokens(task) - head - len(digits) + STARTS["assistant"]
    return (shared, *numbered, Segment(own, rest))


def _tokens(message: dict[str, str]) -> int:
    """Tokens of `message` rendered in ChatML, reckoned (module docstring: "Calibration")."""
    return STARTS[message["role"]] + len(PIECES.findall(message["content"])) + END


WORKLOADS: dict[str, Callable[[int, Scale], Workload]] = {
    "agent": agent,
    "long_docs": long_docs,
    "bursts": bursts,
    "restart": restart,
    "models_shift": models_shift,
    "clients": clients,
    "shared_opening": shared_opening,
    "few": few,
    "calibration": calibration,
}
