"""A host's `parallel` against the slots it says it has (its `/props` `total_slots`, its `-np`).

The gateway lets each model of a host run `parallel` requests at once, so the host gets up to
their sum. Above its slots, the extra requests wait inside llama-server, where the gateway can
neither see them nor send them to a host with a free slot: an error. Below, slots stay idle: a
warning. `crossbar_config check` and `load`, the host admin's save and its "Read models and
slots" judge by `slot_fit()`, so the rule and its words are the same in each.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from hosts.describe import Unreachable, read_props

# Why a router-mode host is not compared: its /props says no total_slots.
ROUTER_SAYS_NO_SLOTS = "a router-mode host says no slot count (each model it loads has its own)"

# Seconds to wait for a host (to connect, then to answer) when checking: an answer from a host
# on the network takes milliseconds, and a check must not hang on a host that is down.
CHECK_TIMEOUT = 2.0


@dataclass(frozen=True, slots=True)
class SlotFit:
    """A `parallel` that does not fit the host's slots: an error (above) or a warning (below)."""

    error: bool
    message: str
    said: str  # what was seen, without what follows: "parallel 4 (llama3), but the host has 1 slot"


def slot_fit(parallel: Mapping[str, int], slots: int) -> SlotFit | None:
    """How the models' `parallel` ({model name: parallel}) fits the host's `slots`; None when
    their sum is exactly the slots, or there are no models."""
    total = sum(parallel.values())
    if not parallel or total == slots:
        return None
    each = " + ".join(f"{count} ({name})" for name, count in parallel.items())
    seen = (
        f"parallel {each}{f' = {total}' if len(parallel) > 1 else ''}, but the host has "
        f"{slots} slot{'s' * (slots != 1)}"
    )
    said = f"{seen} (its /props total_slots)"
    if total > slots:
        fix = f"set parallel to {slots}" if len(parallel) == 1 else f"share its {slots} among them"
        return SlotFit(
            True,
            f"{said}: {total - slots} of the requests the gateway lets run there would wait "
            f"inside the host, where the gateway cannot see them or send them to a free host; "
            f"{fix}.",
            seen,
        )
    return SlotFit(
        False,
        f"{said}: {slots - total} of its slots {'stays' if slots - total == 1 else 'stay'} "
        f"idle; raise parallel to {slots}"
        f"{' in all' if len(parallel) > 1 else ''} to use them.",
        seen,
    )


def slots_or_why(url: str, api_key: str = "", timeout: float = CHECK_TIMEOUT) -> int | str:
    """The slots the host at `url` says it has (its `/props`), or why there are none to
    compare with (it did not answer, it is a router, it said none). Blocking I/O."""
    try:
        described = read_props(url, api_key, timeout)
    except Unreachable as exc:
        return f"it did not answer ({exc})"
    if described.router:
        return ROUTER_SAYS_NO_SLOTS
    return described.slots or "its /props says no total_slots"
