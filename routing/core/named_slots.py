"""A slot named for one request (llama-server's `id_slot`), and what its answer says of the host.

A llama-server with a unified KV cache (`--kv-unified`, which is its default when `-np` is
not given) saves each idle slot to its prompt cache (`--cache-ram`) and empties it whenever
a task starts (`--cache-idle-slots`, on by default). A request then finds its prompt again only
when the server chooses the slot itself: it takes the least recently used one and loads the
best prompt from its cache into it. A request that names an empty slot loads nothing and is
evaluated whole (build 11434, `get_available_slot`). Measured on the real server with two slots
and another request in between: the second turn of a conversation took 518 tokens from cache
unnamed and 0 named. With `-np 2` alone, it took 518 either way.

A host's `/props` and `/slots` look the same either way, so its answers have to tell us. Say a
request names a slot where an earlier named request's answer ended (since the host was last
read), and the host reports that not one token came from cache, not even the chat template's
opening that every chat shares. Then that slot was emptied in between. A restart does that
once to each slot: the health poller usually sees one and reads the host anew, but a quick
one it may miss. A unified host does it again and again. So when one slot is found emptied a
second time since the host was read, crossbar stops naming that host's slots until the host
is read anew. (Stopping at the first, an unseen restart cost the host its slot names for
good: bench-cache's restarted host, 4 Dec 2026.) A unified host keeps a slot that another
request used last: only an idle one is emptied, so the findings come from some turns, not
all of them.

A slot another request is running in is named only when waiting for it is priced sooner
than reading the prompt in another slot (`waits_for_its_slot`): llama-server holds a request
that names a busy slot until the slot is free, while another slot may sit idle.
"""

from __future__ import annotations

from dataclasses import dataclass

from routing.core.leases import LeaseKey
from routing.core.prefixes import Prefix
from routing.core.state import Held

__all__ = [
    "NamedSlot",
    "chooses_the_empty_slot",
    "common_blocks",
    "found_emptied",
    "kept_only_shared",
    "waits_for_its_slot",
]


@dataclass(slots=True, eq=False)
class NamedSlot:
    """The slot `number` of `slot`'s host, named for one request of the conversation `key`."""

    number: int
    key: LeaseKey
    slot: Held  # the request's hold on its host: the number is busy until it is released
    # The host's description when the slot was named (identity, not value). A host that went
    # down and came back up is read anew, so this value marks out the time since that start.
    described: object
    # The request named here before this one, since the host was read, had its answer end
    # here. So the slot should still hold that answer's prompt, or what came after it.
    filled: bool
    prefix: Prefix  # the request's prompt in blocks: what the slot holds once it has run
    # The request that was running in the slot when this one was named, which it waits for
    # inside llama-server; None when the slot was free.
    behind: NamedSlot | None = None
    answered: bool = False  # this request's answer ended, with the host's token counts
    # The prompt of another conversation whose answer ended in the slot last (since the host
    # was read), which this request finds there; None when the slot was this conversation's
    # own, or empty, or unknown.
    took: Prefix | None = None
    # Whether the request names the slot (`id_slot`). Not for a slot still empty that
    # llama-server would give the request itself (`chooses_the_empty_slot`): the number is
    # where it should land, not a fact seen, so its answer does not make the slot filled.
    told: bool = True

    @property
    def host(self) -> str:
        return self.slot.host


def found_emptied(named: NamedSlot, prompt_tokens: int | None, cached_tokens: int | None) -> bool:
    """Whether the answer to `named` says its slot had been emptied since the previous named
    answer ended there: a slot filled, a prompt, and no token from cache."""
    return named.filled and bool(prompt_tokens) and cached_tokens == 0


def chooses_the_empty_slot(prefix: Prefix, idle: list[Prefix], similarity: float) -> bool:
    """Whether a request with the prompt `prefix`, for a slot still empty, should name none
    and let llama-server choose: then it gets a slot from `--cache-ram` (the best prompt saved
    there loaded into it), where a named empty slot loads nothing (build 11434: the share of
    the slot it would keep is 0/0, so the test that loads it fails) and reads the whole prompt,
    a shared opening included.

    llama-server gives a request that names no slot an idle slot holding more than
    `similarity` (its `--slot-prompt-similarity`, as the operator says it runs) of the prompt,
    else the least recently used one, which an empty slot always is. So the request lands in
    an empty slot when none of the `idle` slots' prompts (those with an answer ended in
    them) holds more than that of it: counted a block over what their chains share, as a
    block's hash covers only its whole characters. At llama-server's default 0.1 a shared
    system prompt is more, and the request names its empty slot as before."""
    if not prefix.length:
        return False
    for other in idle:
        if other.block_size != prefix.block_size:
            return False  # counted in other units: how much it holds is unknown
        held = (common_blocks(prefix.blocks, other.blocks) + 1) * prefix.block_size
        if held / prefix.length > similarity:
            return False
    return True


def kept_only_shared(named: NamedSlot, predicted: int | None, reported: int | None) -> bool:
    """Whether the answer to `named` says its host took the slot as another conversation had
    left it: the slot held another conversation's prompt (`took`), the prefix index expected
    the host to hold more of this one's than the two share (`predicted` blocks: its own
    history, there or in `--cache-ram`), and the host reported (`reported` blocks) no more
    than what they share. llama-server does so with a named slot that holds more than its
    `--slot-prompt-similarity` of the prompt, 0.1 by default, which a shared system prompt
    is; at 0.95 it loads the conversation back from `--cache-ram` (docs/config.md). A block
    either way is the chat template's and the blocks' edges. Whether the answer lost its
    cache at all (more than a block under the prediction) is the caller's to judge, by the
    rule the rows and metrics count it with (`accounting.report.is_cache_lost`)."""
    if named.took is None or predicted is None or reported is None:
        return False
    shared = common_blocks(named.prefix.blocks, named.took.blocks)
    return predicted > shared + 1 and reported <= shared + 1


def common_blocks(one: tuple[int, ...], other: tuple[int, ...]) -> int:
    """How many leading blocks two prompts' chains share (a block's hash is chained on every
    block before it, so the first difference ends the match)."""
    shared = 0
    for mine, theirs in zip(one, other, strict=False):  # the shorter chain ends it
        if mine != theirs:
            break
        shared += 1
    return shared


def waits_for_its_slot(remaining: float, at_home: float, elsewhere: float) -> bool:
    """Whether a request whose slot another request runs in should be told that slot anyway.

    Priced in seconds of prefill and wait, as priced patience prices hosts
    (routing/core/patience.py): waiting, the `remaining` time of the request in the slot
    then `at_home`, the prefill of what the slot will not hold of the prompt; not waiting,
    `elsewhere`: the prefill in the free slot that holds the most of it, and of what that
    slot's own conversation loses there and reads again on its next turn. (Measured on
    bench-cache, 4 Dec 2026: a request left to llama-server while its slot was busy went into
    another conversation's slot, and that one's next turn was read whole too.) Equal prices
    leave the request to the host, which keeps its slots working.

    `remaining` is the host's recent service time, as priced patience takes it for a line's
    first place: how far the running request has got says little of how far it has to go (an
    answer's length is unknown until it ends), and one that has run past the mean may run as
    long again."""
    return remaining + at_home < elsewhere
