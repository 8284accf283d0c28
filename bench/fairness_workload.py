"""The workloads of `make bench-fairness` (bench/bench_fairness.py), made from a seed: the
twin's fair-sharing clients (bench/twin/workloads.py `clients`, `interactive_alone`,
`backlogged`) as text a real llama-server reads, sized for the tiny model's 4,096-token slots.

- `interactive`: short chats, multi-turn (so a conversation's cache matters), a system
  message every one of them shares;
- `batch`, `light`, `heavy`: document summaries, one turn each, a long document of its own
  and a long answer.

Each client's conversations arrive as a Poisson stream at the rate that keeps its share of
the fleet's slots busy (`rate`): the share over a conversation's slot time, which a short
calibration measures on the fleet itself (`Calibration`), not the twin's nominal speeds. Pure:
the same arguments give the same workload, byte for byte. Words are common English, about a
token each in the tiny model's vocab (bench/cache_workload.py `WORDS`).
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from cache_workload import WORDS

__all__ = [
    "INTERACTIVE", "SUMMARY", "Calibration", "Conversation", "Kind", "Turn", "conversations",
    "rate", "workload",
]  # fmt: skip

Range = tuple[int, int]


@dataclass(frozen=True, slots=True)
class Kind:
    """A kind of conversation: a `system` message of `system_words` shared by all of its kind
    (0: none), its own first message of `own` words, `turns` requests, each later one after a
    `pause` (seconds) adding an assistant message the bench writes (`answer` // 2 words) and a
    user message of `added` words; every answer `answer` tokens (max_tokens)."""

    name: str
    system_words: int
    own: Range
    turns: Range
    pause: tuple[float, float]
    added: Range
    answer: Range

    @property
    def mean_turns(self) -> float:
        return sum(self.turns) / 2


# The twin's INTERACTIVE_CHAT and BATCH_SUMMARY, scaled to fit a 4,096-token slot and a
# 2-minute case: a summary's prompt is still 15-30x an interactive turn's.
INTERACTIVE = Kind("chat", 250, (20, 120), (2, 5), (2.0, 8.0), (15, 80), (32, 96))
SUMMARY = Kind("summary", 0, (1500, 2800), (1, 1), (0.0, 0.0), (0, 0), (300, 500))


@dataclass(frozen=True, slots=True)
class Calibration:
    """Seconds a request holds a slot with every slot of the fleet busy, by kind (its first
    turn's, for a chat): measured by bench_fairness.py `calibrate`."""

    slots: int
    request_s: Mapping[str, float]

    def conversation_s(self, kind: Kind) -> float:
        return kind.mean_turns * self.request_s[kind.name]


def rate(share: float, kind: Kind, calibration: Calibration) -> float:
    """Conversations of `kind` a second that keep `share` of the fleet's slots busy."""
    return share * calibration.slots / calibration.conversation_s(kind)


@dataclass(frozen=True, slots=True)
class Turn:
    messages: tuple[dict[str, str], ...]  # the whole request's messages
    max_tokens: int
    pause_after: float  # seconds before the conversation's next turn (0 after the last)


@dataclass(frozen=True, slots=True)
class Conversation:
    client: str
    number: int
    start: float  # seconds after the case began
    turns: tuple[Turn, ...]


def conversations(seed: int, client: str, kind: Kind, every: float) -> Iterator[Conversation]:
    """A client's conversations of `kind`, arriving as a Poisson stream of `every` a second,
    without end. A client's stream depends on its name, kind and rate only, so `interactive`
    is the same conversations alone and beside a flood."""
    arrivals = random.Random(f"{seed}/{client}/arrivals")
    at = arrivals.expovariate(every)
    for number in itertools.count():
        rng = random.Random(f"{seed}/{client}/{number}")
        yield _conversation(client, number, round(at, 3), kind, rng)
        at += arrivals.expovariate(every)


def workload(
    seed: int,
    seconds: float,
    clients: Mapping[str, tuple[Kind, float]],
    calibration: Calibration,
) -> list[Conversation]:
    """Each client's (name: its kind and its share of the slots) conversations arriving over
    `seconds`, merged in order of their start."""
    streams = [
        itertools.takewhile(
            lambda conversation: conversation.start < seconds,
            conversations(seed, client, kind, rate(share, kind, calibration)),
        )
        for client, (kind, share) in clients.items()
    ]
    return list(heapq.merge(*streams, key=lambda conversation: conversation.start))


def _words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(count))


def _system(kind: Kind) -> list[dict[str, str]]:
    if not kind.system_words:
        return []
    text = _words(random.Random(f"system/{kind.name}"), kind.system_words)
    return [{"role": "system", "content": f"You are a helpful assistant. {text}."}]


def _conversation(
    client: str, number: int, start: float, kind: Kind, rng: random.Random
) -> Conversation:
    own = _words(rng, rng.randint(*kind.own))
    opening = f"Summarize this document: {own}." if kind is SUMMARY else f"{own}?"
    messages = [*_system(kind), {"role": "user", "content": opening}]
    count = rng.randint(*kind.turns)
    turns = []
    for index in range(count):
        answer = rng.randint(*kind.answer)
        pause = round(rng.uniform(*kind.pause), 3) if index < count - 1 else 0.0
        turns.append(Turn(tuple(messages), answer, pause))
        messages.append({"role": "assistant", "content": _words(rng, answer // 2)})
        messages.append({"role": "user", "content": f"{_words(rng, rng.randint(*kind.added))}?"})
    return Conversation(client, number, start, tuple(turns))
