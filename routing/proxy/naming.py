"""The slot a request names on its host (llama-server's `id_slot`), if any: the conversation's
own there, when it is served on its lease's host and the host keeps one for it
(`LiveFleet.id_slot`, docs/architecture.md "A slot of its own")."""

from __future__ import annotations

from routing.core.leases import LeaseKey, LeaseOutcome
from routing.core.named_slots import NamedSlot
from routing.core.placement import Placement
from routing.proxy.ask import Ask
from routing.runtime import Runtime

# The leases that keep the conversation on the host serving it (a spill serves it elsewhere).
_AT_HOME = frozenset({LeaseOutcome.NEW, LeaseOutcome.REUSED, LeaseOutcome.MOVED})


async def slot_to_name(runtime: Runtime, ask: Ask, placement: Placement) -> NamedSlot | None:
    """The slot to name for `ask` on its placement's host; None for a request with no
    conversation, one served off its lease's host, one that does not name slots, and one
    that names its own `id_slot` (which goes as sent)."""
    if (
        not ask.fingerprint
        or placement.lease not in _AT_HOME
        or placement.fallback
        or not ask.names_slot
        or "id_slot" in (ask.payload or ())
    ):
        return None
    key = LeaseKey(placement.route, ask.fingerprint, placement.model)
    return await runtime.live.id_slot(key, placement.slot, ask.prefix)
