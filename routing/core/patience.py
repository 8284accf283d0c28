"""Priced patience: wait in line for the host that holds the conversation, or start cold on
another host with a free slot, whichever costs less delay (a route's `lease_patience =
"auto"`).

Both ways are priced in seconds of delay: to the request's first token, and, for a spill, to
the next tokens of the requests it runs beside:

- **stay** at place `p` in the line of host `h`, which has `s` slots:
  `line_wait(p) x lateness(h) + prefill(h)`. A request running there is expected to hold its
  slot what the recent holds there that lasted longer than it has so far had left at that
  point (their mean residual: `Figures.left`), so the `p`-th slot to free comes as the running
  requests end (after `p x service / s` where how far they have got is unknown: `line_wait`);
  then `h` still evaluates what it does not hold of the prompt (the new turn, at home).
  `lateness(h)` closes the loop: each request that stayed compares the wait it was
  priced as it joined the line with the wait it had, and the recent ratio corrects the next
  prices. On bench-cache (bench/README.md, "5 Dec 2026") staying was priced 21-420 ms where
  the requests waited 47-903 ms.
- **spill** to host `g` with a free slot now: `prefill(g) x (1 + r)`, the prompt less what
  `g` holds, evaluated while `r` requests known to this process run there. llama-server
  evaluates a prompt in the same batches as the running requests' next tokens, so each of them
  waits as long as the spilled request does: a spill is taken only where it saves this request
  more than it costs them. On bench-cache with 96-token answers (bench/README.md, "5 Dec
  2026") the spills priced by the request's own wait alone cost more than they saved: more
  tokens and a worse TTFB p95 than never spilling.

`prefill(h) = (prompt tokens - tokens h holds) / h's prompt speed`. The prompt's tokens are its
length in the prefix index's units (canonical characters, or token ids) over the model's
measured units per token; the tokens a host holds are its matched blocks
(`PrefixIndex.match`), converted the same way.

The figures (`Figures`) come from the answers themselves: per host and model the seconds a slot
was held (the recent holds: service, and what a running request has left) and the waits in
line over their prices (lateness), per host the prompt
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

from bisect import bisect_right
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Generic, TypeVar

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
# The holds kept per host and model (`_Holds`): at DECAY the 17th newest weighs under 1% of
# the newest, so older ones would change nothing but the memory.
HOLDS_KEPT = 32

K = TypeVar("K", bound=Hashable)


def line_wait(position: int, service: float, slots: int, left: Sequence[float] = ()) -> float:
    """Seconds until the slot for place `position` (1-based) of a line frees, on a host with
    `slots` slots, each held `service` seconds on average.

    `left`: the seconds each request known to hold a slot there is expected to hold it still
    (`Figures.left`). A busy slot not known so (another process's) is taken as the slots are
    when nothing is known: freeing one after another, evenly through a service time, the k-th
    after `k x service / slots`. Place `p` gets the slot that frees ((p - 1) mod slots)-th,
    after (p - 1) // slots full services of the places ahead of it on that slot."""
    slots = max(1, slots)
    if position <= 0:
        return 0.0
    # More running than slots (a parallel lowered since): a slot frees as the last `slots` end.
    ends = sorted(max(0.0, seconds) for seconds in left)[-slots:]
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


F = TypeVar("F")


class _Ratio:
    """A decayed ratio of sums: `top / bottom` over the answers added, the older fading."""

    __slots__ = ("top", "bottom")

    def __init__(self) -> None:
        self.top = 0.0
        self.bottom = 0.0

    def add(self, top: float, bottom: float) -> None:
        self.top = self.top * DECAY + top
        self.bottom = self.bottom * DECAY + bottom

    @property
    def value(self) -> float:
        return self.top / self.bottom  # `add`ed bottoms are > 0


class _Holds:
    """The last `HOLDS_KEPT` seconds a slot was held, each weighing DECAY times the next one:
    their mean is the service time, and the mean residual (`left`) what a request still
    running is expected to hold its slot for."""

    __slots__ = ("_recent", "_ends", "_weights", "_weighted")

    def __init__(self) -> None:
        self._recent: deque[float] = deque(maxlen=HOLDS_KEPT)
        # Built on the first read after an add: the holds sorted, and from each one on, the
        # sums of their weights and of their weighted seconds.
        self._ends: list[float] = []
        self._weights: list[float] = []
        self._weighted: list[float] = []

    def add(self, seconds: float) -> None:
        self._recent.append(seconds)
        self._ends = []

    def mean(self) -> float:
        self._sums()
        return self._weighted[0] / self._weights[0]

    def left(self, held: float) -> float:
        """Seconds a request that has held its slot `held` is expected to hold it still: the
        weighted mean of what the recent holds longer than that had left at `held`. One held
        past every recent hold is running slower than any of them; it is taken to have half
        a service left, not to end now: so priced, the line behind a host slowed down (a cold
        prompt in its batches) cost nothing, and requests waited there 4-5x what they were
        priced (bench/README.md, "5 Dec 2026, 20:30 UTC")."""
        self._sums()
        longer = bisect_right(self._ends, held)
        if longer == len(self._ends):
            return self.mean() / 2
        return self._weighted[longer] / self._weights[longer] - held

    def _sums(self) -> None:
        if self._ends:
            return
        count = len(self._recent)
        pairs = sorted((s, DECAY ** (count - 1 - n)) for n, s in enumerate(self._recent))
        weights, weighted = [0.0] * (count + 1), [0.0] * (count + 1)
        for n in range(count - 1, -1, -1):
            seconds, weight = pairs[n]
            weights[n] = weights[n + 1] + weight
            weighted[n] = weighted[n + 1] + weight * seconds
        self._ends = [seconds for seconds, _ in pairs]
        self._weights, self._weighted = weights, weighted


class _Table(Generic[K, F]):
    """Figures by key, at most `max_entries`, the least recently fed going first."""

    __slots__ = ("max_entries", "make", "_figures")

    def __init__(self, max_entries: int, make: Callable[[], F]) -> None:
        self.max_entries = max_entries
        self.make = make
        self._figures: OrderedDict[K, F] = OrderedDict()

    def feed(self, key: K) -> F:
        """The key's figure, to add to: made if new, and now the most recently fed."""
        figure = self._figures.get(key)
        if figure is None:
            figure = self._figures[key] = self.make()
            if len(self._figures) > self.max_entries:
                self._figures.popitem(last=False)
        else:
            self._figures.move_to_end(key)
        return figure

    def get(self, key: K) -> F | None:
        return self._figures.get(key)

    def drop(self, gone: Callable[[K], bool]) -> None:
        for key in [key for key in self._figures if gone(key)]:
            del self._figures[key]


class Figures:
    """What the hosts' answers say about them: service times, prompt speeds, units per token.

    Fed at the end of each request (`held`, `prompted`), read when a request waits. Bounded:
    `max_entries` keys per kind of figure. Each process keeps its own.
    """

    __slots__ = ("_holds", "_speed", "_units", "_lateness")

    def __init__(self, max_entries: int = MAX_ENTRIES) -> None:
        self._holds: _Table[tuple[str, str], _Holds] = _Table(max_entries, _Holds)
        self._lateness: _Table[tuple[str, str], _Ratio] = _Table(max_entries, _Ratio)
        self._speed: _Table[str, _Ratio] = _Table(max_entries, _Ratio)
        self._units: _Table[tuple[str, int], _Ratio] = _Table(max_entries, _Ratio)

    def held(self, host: str, model: str, seconds: float) -> None:
        """A slot of (host, model) was held `seconds`, from the grant to its release."""
        if seconds >= 0:
            self._holds.feed((host, model)).add(seconds)

    def waited(self, host: str, model: str, priced: float, actual: float) -> None:
        """A request priced to wait `priced` seconds in the line of (host, model), before
        `lateness` corrected the price, was given a slot there after `actual` seconds."""
        if priced > 0 and actual >= 0:
            self._lateness.feed((host, model)).add(actual, priced)

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
            self._units.feed((model, prefix.block_size)).add(prefix.length, prompt_tokens)
        if cached_tokens is None or prompt_ms is None or prompt_ms <= 0:
            return
        evaluated = prompt_tokens - cached_tokens
        if evaluated > 0:
            self._speed.feed(host).add(evaluated, prompt_ms / 1000)

    def forget(self, hosts: Iterable[str]) -> None:
        """Forget what the hosts' answers said (gone, or another machine under the same name).
        Costs a pass over every figure: for a reload, not for a request."""
        gone = set(hosts)
        if gone:
            self._holds.drop(lambda key: key[0] in gone)
            self._lateness.drop(lambda key: key[0] in gone)
            self._speed.drop(lambda key: key in gone)

    def service(self, host: str, model: str) -> float | None:
        """Recent seconds a slot of (host, model) is held; None before any answer."""
        holds = self._holds.get((host, model))
        return None if holds is None else holds.mean()

    def left(self, host: str, model: str, held: float) -> float | None:
        """Seconds a request that has held a slot of (host, model) `held` seconds is expected
        to hold it still (`_Holds.left`); None before any answer."""
        holds = self._holds.get((host, model))
        return None if holds is None else holds.left(held)

    def lateness(self, host: str, model: str) -> float:
        """The recent waits in the line of (host, model) over what they were priced
        (`waited`), within `LATENESS_BOUNDS`; 1 before any."""
        ratio = self._lateness.get((host, model))
        if ratio is None:
            return 1.0
        low, high = LATENESS_BOUNDS
        return min(max(ratio.value, low), high)

    def speed(self, host: str) -> float | None:
        """Recent prompt tokens the host evaluates a second; None before any timings."""
        speed = self._speed.get(host)
        return None if speed is None else speed.value

    def units_per_token(self, model: str, block_size: int) -> float | None:
        """Recent prompt units (characters, or token ids: told by the block size) per token of
        the model; None before any answer with a prompt of that unit."""
        units = self._units.get((model, block_size))
        return None if units is None else units.value


class Pricing:
    """One request's prices on its route's hosts, from the figures and the prefix index as
    they are when asked. `slots(host)`: the host's slots for the model."""

    __slots__ = ("figures", "index", "model", "prefix", "slots", "default", "running")

    def __init__(
        self,
        figures: Figures,
        index: PrefixIndex,
        model: str,
        prefix: Prefix,
        slots: Callable[[str], int],
        default: float = DEFAULT_PATIENCE,
        running: Callable[[str], Sequence[float]] = lambda host: (),
    ) -> None:
        self.figures = figures
        self.index = index
        self.model = model
        self.prefix = prefix
        self.slots = slots
        self.default = default  # the fixed patience while a figure is missing
        # `running(host)`: the seconds each request known to hold a slot of the host for the
        # model has held it (what each has left: `Figures.left`).
        self.running = running

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
        figures, model = self.figures, self.model
        service = figures.service(host, model)
        if service is None:
            return None
        left = [figures.left(host, model, held) or 0.0 for held in self.running(host)]
        return line_wait(position, service, self.slots(host), left)

    def spill(self, host: str) -> float | None:
        """The delay a spill to a free slot of the host costs: its prefill of the prompt, which
        this request waits for its first token, and so does each request running there
        (llama-server evaluates a prompt in the same batches as their next tokens)."""
        evaluate = self.prefill_on(host)
        if evaluate is None:
            return None
        return evaluate * (1 + len(self.running(host)))

    def prefill_on(self, host: str) -> float | None:
        """Seconds the host takes to evaluate what it does not hold of the prompt."""
        prefix = self.prefix
        speed = self.figures.speed(host)
        per_token = self.figures.units_per_token(self.model, prefix.block_size)
        if not speed or not per_token or prefix.length <= 0:
            return None
        held = self.index.match(host, self.model, prefix.blocks) * prefix.block_size
        return prefill(prefix.length / per_token, held / per_token, speed)
