"""The twin's values: what a workload is made of, and what a host is like (its preset).

A prompt is a chain of `Segment`s: runs of tokens that are the same token for token wherever
the same segment appears (a shared system prompt, a tool's definitions, one conversation's
document, one turn's message). Two prompts share exactly the tokens of their common leading
segments, which is what a KV cache can reuse; the twin never tokenizes text.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Segment:
    """A run of `tokens` tokens, named by `id`: equal ids are equal tokens."""

    id: int
    tokens: int


@dataclass(frozen=True, slots=True)
class Turn:
    """One request of a conversation.

    `pause`: seconds after the previous turn's answer ended (the first turn's is 0: it starts
    at the conversation's `start`). `added`: the segments this turn appends to the prompt (a
    user message, a tool's result; for a turn after the first, the assistant message comes
    first: the previous answer itself when `keeps_answer`, else a segment of the workload's
    own, as a client that rewrites the answer sends). `max_tokens`: tokens the host generates.
    """

    pause: float
    added: tuple[Segment, ...]
    max_tokens: int
    keeps_answer: bool = True


@dataclass(frozen=True, slots=True)
class Conversation:
    """A conversation of `client` with `model`, opened at `start` (seconds of virtual time)."""

    id: int
    start: float
    model: str
    client: str
    opening: tuple[Segment, ...]  # its first prompt's segments (system, tools, first message)
    turns: tuple[Turn, ...]


@dataclass(frozen=True, slots=True)
class Restart:
    """Host number `host` (of the fleet, in order) restarts at `at`: down for `down` seconds,
    its caches (slots and host memory) lost."""

    at: float
    host: int
    down: float = 5.0


@dataclass(frozen=True, slots=True)
class Workload:
    """A seeded workload: `conversations()` yields them in order of `start`, lazily (a million
    conversations are never all in memory at once)."""

    name: str
    seed: int
    conversations: Callable[[], Iterator[Conversation]]
    models: tuple[str, ...]
    clients: tuple[str, ...] = ("default",)
    restarts: tuple[Restart, ...] = ()


@dataclass(frozen=True, slots=True)
class ModelProfile:
    """One model as served by one kind of host: its speeds, its size, its load time.

    `decode_tps[n - 1]`: tokens per second each stream gets while n streams decode together
    (a batch of n; past the tuple's end, the last entry's aggregate shared among them).
    `restore_tps`: tokens per second a prompt comes back from the host-memory cache into a
    slot (`--cache-ram`). `source`: where the figures come from.
    """

    name: str
    size_gb: float
    load_s: float
    prefill_tps: float
    decode_tps: tuple[float, ...]
    restore_tps: float
    kv_bytes_per_token: int
    source: str = ""


@dataclass(frozen=True, slots=True)
class HostProfile:
    """A kind of host: its slots per model, host-memory prompt cache, memory and models."""

    name: str
    slots: int
    cache_ram_mib: int  # llama-server's --cache-ram (0: none)
    memory_gb: float  # what models loaded at once may take (router mode)
    models_max: int  # llama-server's --models-max (router mode)
    models: Mapping[str, ModelProfile] = field(default_factory=dict)
    source: str = ""
    # llama-server's --slot-prompt-similarity: docs/config.md advises 0.95 behind crossbar (its
    # own default is 0.1), so that a conversation whose slot moved on comes back from host
    # memory; `make bench-cache` runs its hosts so.
    similarity: float = 0.95
