"""Priced patience: wait in line for the host that holds the conversation, or start cold on
another host with a free slot, whichever costs less delay (a route's `lease_patience =
"auto"`).

Both ways are priced in seconds of delay: to the request's first token, and, for a spill, to
the next tokens of the requests it runs beside:

- **stay** at place `p` in the line of host `h`, which has `s` slots:
  `line_wait(p) x lateness(h) + prefill(h)`. Each request running there is expected to end
  once it has held its slot `service(h)` seconds, so the `p`-th slot to free comes as the
  running requests end (after `p x service / s` where how far they have got is unknown:
  `line_wait`); then `h` still evaluates what it does not hold of the prompt (the new turn, at
  home). `lateness(h)` closes the loop: each request that stayed compares the wait it was
  priced as it joined the line with the wait it had, and the recent ratio corrects the next
  prices. On bench-cache (bench/README.md, "5 Dec 2026") staying was priced 21-420 ms where
  the requests waited 47-903 ms.
- **spill** to host `g` with a free slot now: `prefill(g) x (1 + r)`, the prompt less what
  `g` holds, evaluated while `r` requests known to this process run there. llama-server
  evaluates a prompt in the same batches as the running requests' next tokens, so each of them
  waits as long as the spilled request does: a spill is taken only where it saves this request
  more than it costs them. On bench-cache with 96-token answers (bench/README.md, "5 Dec
  2026") the spills priced by the request's own wait alone cost more than they saved: more
  tokens and a worse TTFB p95 than never spilling. Plus `displaced(g)`: the spill holds `g`'s
  slot a whole `service(g)` while the conversations leased to `g` between turns may come back
  for it; with as many of them as `g` has free slots one waits up to a service, with fewer
  the share of the free slots they may need (the spill cascade's cause; bench/README.md,
  "The fleet twin").

`prefill(h) = (prompt tokens - tokens h holds) / h's prompt speed`. The prompt's tokens are its
length in the prefix index's units (canonical characters, or token ids) over the model's
measured units per token; the tokens a host holds are its matched blocks
(`PrefixIndex.match`), converted the same way.

The figures (`Figures`) come from the answers themselves: per host and model the seconds a slot
was held (service) and the waits in line over their prices (lateness), per host the prompt
tokens it evaluated per second (llama-server's `timings.prompt_n` over `prompt_ms`), per model
and unit the prompt's units per token. Each is a decayed ratio of sums: an answer adds its own
numbers and the earlier ones keep `DECAY` of their weight, so a figure follows a change within
a handful of answers, and a small evaluation (one token after a cache hit, its time mostly
overhead) weighs little in a speed.

The choice (`decide`): a free slot elsewhere is taken when it is priced lower than staying
and no other host with a free slot now is priced lower. Without a figure it needs (a host
that has not answered yet, an engine that reports no `timings`), the fixed default applies
to that slot: it may take the request once the request has waited `DEFAULT_PATIENCE`.

Pure: standard library only; no I/O, no event loop. Not thread-safe: call from one loop.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Generic, TypeVar

from routing.core.pairs import Pair
from routing.core.prefixes import Prefix, PrefixIndex

__all__ = [
    "DEFAULT_PATIENCE",
    "Choice",
    "Figures",
    "Priced",
    "Pricing",
    "decide",
    "line_wait",
    "prefill",
]

DEFAULT_PATIENCE = 2.0  # seconds: the fixed patience that applies while a figure is missing
# The weight the earlier answers keep at each new one: the newest carries a quarter, and
# after five more answers one carries less than a quarter of that.
DECAY = 0.75
# How far the waits that followed may correct the line's price (`Figures.lateness`): a few
# requests that waited behind a stall do not make every wait look four times as long.
LATENESS_BOUNDS = (0.5, 4.0)
# Keys per table (hosts x models, hosts, models): hosts and models come from configuration,
# so this is a bound against mistakes, not a cache size.
MAX_ENTRIES = 1024

K = TypeVar("K", bound=Hashable)


def line_wait(position: int, service: float, slots: int, running: Sequence[float] = ()) -> float:
    """Seconds until the slot for place `position` (1-based) of a line frees, on a host with
    `slots` slots, each held `service` seconds on average.

    `running`: how long each request known to hold a slot there has held it so far; each is
    expected to end once it has held it `service` seconds (one past that, now). A busy slot
    not known so (another process's) is taken as the slots are when nothing is known: freeing
    one after another, evenly through a service time, the k-th after `k x service / slots`.
    Place `p` gets the slot that frees ((p - 1) mod slots)-th, after (p - 1) // slots full
    services of the places ahead of it on that slot. Known to be near their end, the running
    requests free a slot sooner than the even spread says: on bench-cache with 96-token
    answers, the spread alone priced a wait at 180-420 ms, where the requests that waited at
    patience 600 waited 120 ms at the median (bench/README.md, "5 Dec 2026")."""
    slots = max(1, slots)
    if position <= 0:
        return 0.0
    # More running than slots (a parallel lowered since): a slot frees as the last `slots` end.
    ends = sorted(max(0.0, service - held) for held in running)[-slots:]
    ends += [k * service / slots for k in range(1, slots - len(ends) + 1)]
    ends.sort()
    return ends[(position - 1) % slots] + (position - 1) // slots * service


def prefill(tokens: float, held: float, speed: float) -> float:
    """Seconds a host evaluating `speed` tokens a second takes for a prompt of `tokens` of
    which it holds `held` already."""
    return max(0.0, tokens - held) / speed


class Choice(StrEnum):
    """What priced patience chose for a request that waits: the row's `patience`."""

    STAY = "stay"  # staying costs less (or no other host had a free slot)
    SPILL = "spill"  # the cold start elsewhere costs less
    DEFAULT = "default"  # a figure was missing: the fixed default patience decided


@dataclass(slots=True, frozen=True)
class Priced:
    """One decision: the prices it compared, in seconds (None: a figure was missing, or for
    `spill`, no other host had a free slot), and whether the request takes the slot."""

    choice: Choice
    stay: float | None
    spill: float | None
    takes: bool = False


def decide(
    stay: float | None, spill: float | None, rivals: Iterable[float | None], spent: bool
) -> Priced:
    """Whether a waiting request priced `stay` takes a free slot priced `spill` on another host.

    `rivals`: the prices of the other hosts with a free slot now (None: unknown, ignored);
    `spent`: the request has waited `DEFAULT_PATIENCE`, which decides when a price is missing.
    A slot priced no sooner than a rival is left for the rival (`stay` for this slot).
    """
    if stay is None or spill is None:
        return Priced(Choice.DEFAULT, stay, spill, spent)
    if spill < stay and all(rival is None or spill <= rival for rival in rivals):
        return Priced(Choice.SPILL, stay, spill, True)
    return Priced(Choice.STAY, stay, spill)


class _Ratio:
    """A decayed ratio of sums: `top / bottom` over the answers added, the older fading."""

    __slots__ = ("top", "bottom")

    def __init__(self) -> None:
        self.top = 0.0
        self.bottom = 0.0

    def add(self, top: float, bottom: float) -> None:
        self.top = self.top * DECAY + top
        self.bottom = self.bottom * DECAY + bottom


class _Table(Generic[K]):
    """Ratios by key, at most `max_entries`, the least recently added to going first."""

    __slots__ = ("max_entries", "_ratios")

    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self._ratios: OrderedDict[K, _Ratio] = OrderedDict()

    def add(self, key: K, top: float, bottom: float) -> None:
        ratio = self._ratios.get(key)
        if ratio is None:
            ratio = self._ratios[key] = _Ratio()
            if len(self._ratios) > self.max_entries:
                self._ratios.popitem(last=False)
        else:
            self._ratios.move_to_end(key)
        ratio.add(top, bottom)

    def get(self, key: K) -> float | None:
        ratio = self._ratios.get(key)
        return None if ratio is None else ratio.top / ratio.bottom  # `add`ed bottoms are > 0

    def drop(self, gone: Callable[[K], bool]) -> None:
        for key in [key for key in self._ratios if gone(key)]:
            del self._ratios[key]


class Figures:
    """What the hosts' answers say about them: service times, prompt speeds, units per token.

    Fed at the end of each request (`held`, `prompted`), read when a request waits. Bounded:
    `max_entries` keys per kind of figure. Each process keeps its own.
    """

    __slots__ = ("_service", "_speed", "_units", "_lateness")

    def __init__(self, max_entries: int = MAX_ENTRIES) -> None:
        self._service: _Table[Pair] = _Table(max_entries)
        self._lateness: _Table[Pair] = _Table(max_entries)
        self._speed: _Table[str] = _Table(max_entries)
        self._units: _Table[tuple[str, int]] = _Table(max_entries)

    def held(self, host: str, model: str, seconds: float) -> None:
        """A slot of (host, model) was held `seconds`, from the grant to its release."""
        if seconds >= 0:
            self._service.add(Pair(host, model), seconds, 1.0)

    def waited(self, host: str, model: str, priced: float, actual: float) -> None:
        """A request priced to wait `priced` seconds in the line of (host, model), before
        `lateness` corrected the price, was given a slot there after `actual` seconds."""
        if priced > 0 and actual >= 0:
            self._lateness.add(Pair(host, model), actual, priced)

    def prompted(
        self,
        host: str,
        model: str,
        prefix: Prefix,
        prompt_tokens: int | None,
        cached_tokens: int | None,
        prompt_ms: float | None,
    ) -> None:
        """An answer's prompt counts: `prompt_tokens` in all, `cached_tokens` of them from the
        cache, the rest evaluated in `prompt_ms`; `prefix` is the prompt as the index cut it.
        Unknown counts teach nothing."""
        if prompt_tokens is None or prompt_tokens <= 0:
            return
        if prefix.length > 0:
            self._units.add((model, prefix.block_size), prefix.length, prompt_tokens)
        if cached_tokens is None or prompt_ms is None or prompt_ms <= 0:
            return
        evaluated = prompt_tokens - cached_tokens
        if evaluated > 0:
            self._speed.add(host, evaluated, prompt_ms / 1000)

    def forget(self, hosts: Iterable[str]) -> None:
        """Forget what the hosts' answers said (gone, or another machine under the same name).
        Costs a pass over every figure: for a reload, not for a request."""
        gone = set(hosts)
        if gone:
            self._service.drop(lambda key: key[0] in gone)
            self._lateness.drop(lambda key: key[0] in gone)
            self._speed.drop(lambda key: key in gone)

    def service(self, host: str, model: str) -> float | None:
        """Recent seconds a slot of (host, model) is held; None before any answer."""
        return self._service.get(Pair(host, model))

    def lateness(self, host: str, model: str) -> float:
        """The recent waits in the line of (host, model) over what they were priced
        (`waited`), within `LATENESS_BOUNDS`; 1 before any."""
        ratio = self._lateness.get(Pair(host, model))
        if ratio is None:
            return 1.0
        low, high = LATENESS_BOUNDS
        return min(max(ratio, low), high)

    def speed(self, host: str) -> float | None:
        """Recent prompt tokens the host evaluates a second; None before any timings."""
        return self._speed.get(host)

    def units_per_token(self, model: str, block_size: int) -> float | None:
        """Recent prompt units (characters, or token ids: told by the block size) per token of
        the model; None before any answer with a prompt of that unit."""
        return self._units.get((model, block_size))


class Pricing:
    """One request's prices on its route's hosts, from the figures and the prefix index as
    they are when asked. `slots(host)`: the host's slots for the model."""

    __slots__ = (
        "figures", "index", "model", "prefix", "slots", "default", "running", "owners", "free",
    )  # fmt: skip

    def __init__(
        self,
        figures: Figures,
        index: PrefixIndex,
        model: str,
        prefix: Prefix,
        slots: Callable[[str], int],
        default: float = DEFAULT_PATIENCE,
        running: Callable[[str], Sequence[float]] = lambda host: (),
        owners: Callable[[str], int] = lambda host: 0,
        free: Callable[[str], int] = lambda host: 1,
    ) -> None:
        self.figures = figures
        self.index = index
        self.model = model
        self.prefix = prefix
        self.slots = slots
        self.default = default  # the fixed patience while a figure is missing
        # `running(host)`: the seconds each request known to hold a slot of the host for the
        # model has held it (`line_wait`).
        self.running = running
        # `owners(host)`: the conversations leased to the host for the model with no request
        # running there now (they may come back for a slot); `free(host)`: its free slots.
        self.owners = owners
        self.free = free

    def stay(self, host: str, position: int) -> float | None:
        """Seconds to the first token staying at place `position` of the host's line: the
        wait, corrected by how the recent waits there compared with their prices
        (`Figures.lateness`), then the host's prefill."""
        wait = self.line(host, position)
        evaluate = self.prefill_on(host)
        if wait is None or evaluate is None:
            return None
        return wait * self.figures.lateness(host, self.model) + evaluate

    def line(self, host: str, position: int) -> float | None:
        """Seconds until the slot for place `position` of the host's line frees, from the
        service time and the running requests alone (`line_wait`): what `Figures.waited`
        compares the wait that follows with."""
        service = self.figures.service(host, self.model)
        if service is None:
            return None
        return line_wait(position, service, self.slots(host), self.running(host))

    def spill(self, host: str) -> float | None:
        """The delay a spill to a free slot of the host costs: its prefill of the prompt, which
        this request waits for its first token, and so does each request running there
        (llama-server evaluates a prompt in the same batches as their next tokens); and the
        wait of the host's own conversations that come back while it holds the slot
        (`displaced`)."""
        evaluate = self.prefill_on(host)
        if evaluate is None:
            return None
        return evaluate * (1 + len(self.running(host))) + self.displaced(host)

    def displaced(self, host: str) -> float:
        """What holding a free slot of the host for a whole service costs the conversations
        leased there: with as many of them between turns as it has free slots, one that comes
        back finds none and waits up to a service; with fewer, the share of the free slots
        they may need. 0 before the host has a service figure."""
        service = self.figures.service(host, self.model)
        owners = self.owners(host)
        if service is None or owners <= 0:
            return 0.0
        return service * min(1.0, owners / max(self.free(host), 1))

    def prefill_on(self, host: str) -> float | None:
        """Seconds the host takes to evaluate what it does not hold of the prompt."""
        prefix = self.prefix
        speed = self.figures.speed(host)
        per_token = self.figures.units_per_token(self.model, prefix.block_size)
        if not speed or not per_token or prefix.length <= 0:
            return None
        held = self.index.match(host, self.model, prefix.blocks) * prefix.block_size
        return prefill(prefix.length / per_token, held / per_token, speed)
