"""Prefix affinity: which host to try first for a prompt some host's KV cache already holds.

The ranking (routing/core/ranking.py) orders a route's hosts by load alone. A prompt that
opens the way others did (a system prompt, tool definitions, a document, a conversation whose
lease expired while its host kept the cache) is cheaper where its opening is cached: that host
evaluates only the rest. `prefer` puts that host first, unless its load (for the model: its
requests in flight and queued, and the conversations leased to it, which will be back) is
more than `margin` above the ranking's best host's. A cache saves one prefill; a busier host
costs every request behind it. So conversations sharing one system prompt do not pile onto
the host that first held it: once it is `margin` ahead, the next goes to the best-ranked
host, which then holds the prompt too, and the ranking spreads them again
(docs/architecture.md, "Prefix affinity", says how the default was measured).

Nor does a host go first when every slot it has is spoken for by a conversation leased there
while the first ranked host has room (`room`: fewer conversations leased than slots). A
llama-server keeps one prompt per slot and gives a request the idle slot sharing the most
with it, which with a shared opening is any of them: one more conversation there overwrites a
leased one, whose whole history is then read again at its next turn, to save reading an
opening once. Measured (bench/README.md, "the prefix margin"): five conversations on three
two-slot hosts evaluated the one host's tokens when no host held more than two, and 1.14-1.27x
when prefix affinity put a third on one.

Placement takes a free slot before a place in a line, so a host put first only takes the
request when it has a slot free or when every host is full and its line is the choice. In
that case (neither it nor the best-ranked host has a free slot) it goes first only holding
no more conversations than the best-ranked host: the cache saves one prefill, but each
conversation there comes back to its line every turn, and a burst of new conversations
sharing a system prompt would otherwise pile into the line of the host that held it first.

Pure: standard library only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from routing.core.prefixes import PrefixIndex
from routing.core.state import FleetState

__all__ = ["Affinity", "prefer", "prefer_in"]


@dataclass(slots=True, frozen=True)
class Affinity:
    """The host to try first, and how many leading blocks of the prompt it is believed to
    hold (more than the ranking's best host does)."""

    host: str
    blocks: int


def prefer(
    order: Sequence[str],
    model: str,
    chain: tuple[int, ...],
    index: PrefixIndex,
    load: Callable[[str], int],
    margin: int,
    room: Callable[[str], bool],
    lines: Callable[[str], int | None],
    places: Mapping[str, Any] | None = None,
) -> Affinity | None:
    """The host of `order` (a ranking's hosts, best first) holding more of `chain` than
    `order[0]` does, when its `load` is at most `margin` above `order[0]`'s and it has `room`
    for one more conversation's cache, or `order[0]` has none either; None when no host holds
    more, or the one that does is too busy or too full. `lines(host)`: the conversations
    leased to a host without a free slot (a request there joins its line), None for a host
    with one; of two such hosts, the one holding more does not go first. `places`: each
    host's place in `order`, when known (`PrefixIndex.deepest`)."""
    if not chain or not order:
        return None
    first = order[0]
    beyond = index.match(first, model, chain)
    found = index.deepest(order, model, chain, beyond, places)
    if found is None:
        return None
    host, blocks = found
    if load(host) > load(first) + margin:
        return None
    if not room(host) and room(first):
        return None
    held, held_first = lines(host), lines(first)
    if held is not None and held_first is not None and held > held_first:
        return None
    return Affinity(host, blocks)


def prefer_in(
    state: FleetState,
    order: Sequence[str],
    model: str,
    chain: tuple[int, ...],
    index: PrefixIndex,
    margin: int,
    places: Mapping[str, Any] | None = None,
) -> Affinity | None:
    """`prefer`, with each host's load, room and line read from the fleet's `state` as it is
    now: load is the model's requests in flight and queued there and the conversations
    leased there; room, fewer conversations leased than its slots."""
    return prefer(
        order,
        model,
        chain,
        index,
        lambda host: (
            state.in_flight(host, model)
            + state.queued(host, model)
            + state.leases_held(host, model)
        ),
        margin,
        lambda host: (
            state.leases_held(host, model)
            < state.in_flight(host, model) + state.free_for(host, model)
        ),
        lambda host: None if state.free_for(host, model) else state.leases_held(host, model),
        places,
    )
