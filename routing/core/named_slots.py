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
conversation's request names the slot where its previous answer on this host ended, and the
host reports that not one token came from cache, not even the chat template's opening. Then
that slot was emptied in between. A restart does that once: the health poller usually sees
one and reads the host anew, but a quick one it may miss, and then the conversation's next
turn finds its slot warm again. A unified host does it every time: when the same
conversation's next turn finds its slot emptied again, crossbar stops naming that host's
slots until the host is read anew. (Stopping at the first, an unseen restart cost the host
its slot names for good: bench-cache's restarted host, 4 Dec 2026.)
"""

from __future__ import annotations

from dataclasses import dataclass

from routing.core.leases import LeaseKey
from routing.core.state import Held

__all__ = ["NamedSlot", "found_emptied"]


@dataclass(slots=True, eq=False)
class NamedSlot:
    """The slot `number` of `slot`'s host, named for one request of the conversation `key`."""

    number: int
    key: LeaseKey
    slot: Held  # the request's hold on its host: the number is busy until it is released
    # The host's description when the slot was named (identity, not value). A host that went
    # down and came back up is read anew, so this value marks out the time since that start.
    described: object
    # The conversation's previous request on this host named this slot too, and its answer
    # ended there. So the slot should still hold that answer's prompt.
    returning: bool
    # ... and that answer found the slot emptied since the one before it (`found_emptied`).
    emptied_before: bool = False
    answered: bool = False  # this request's answer ended, with the host's token counts
    emptied: bool = False  # ... and found the slot emptied since the conversation's last

    @property
    def host(self) -> str:
        return self.slot.host


def found_emptied(named: NamedSlot, prompt_tokens: int | None, cached_tokens: int | None) -> bool:
    """Whether the answer to `named` says its slot had been emptied since the conversation's
    previous answer ended there: a returning request, a prompt, and no token from cache."""
    return named.returning and bool(prompt_tokens) and cached_tokens == 0
