"""The slots this process has named on each host (llama-server's `id_slot`), and what their
answers said of the hosts: which slot to name for a request, and when to name none.

`SlotNames` keeps, per slot of the fleet (`SlotKey`), the last request named there
(`NamedSlot`, routing/core/named_slots.py): what it holds once its answer ended, who runs in it
now and who waits behind them. From that it decides whether a request is told its
conversation's number (`name`) and learns from each answer that named a slot (`answered`):
a host found emptying its idle slots (a unified KV cache) is named no more until it is read
anew, and a slot another conversation left as it was is counted. The rules themselves, as
plain functions of the figures, are in `routing.core.named_slots`; the number a conversation
keeps is its lease's (`LeaseTable.slot_number`); whether a host is named at all (its slots,
its description) is the live fleet's to say (`routing.live_fleet.LiveFleet.id_slot`).

A host's description (`described`) is compared by identity: a host read anew (it was down,
or its `/props` changed) has a new one, which marks out the time since that reading.

What runs in a slot is known in this process only: with shared state, two processes may each
name it. Pure: standard library only. Not thread-safe: use it on its event loop.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

from routing.core.leases import LeaseKey
from routing.core.named_slots import (
    NamedSlot,
    chooses_the_empty_slot,
    common_blocks,
    found_emptied,
    kept_only_shared,
    waits_for_its_slot,
)
from routing.core.pairs import Pair
from routing.core.patience import Figures, prefill
from routing.core.prefixes import Prefix, PrefixIndex
from routing.core.state import Held

__all__ = ["SlotKey", "SlotNames"]

log = logging.getLogger("crossbar.slots")


class SlotKey(NamedTuple):
    """One slot of the fleet: slot `number` of `model` on `host` (a tuple, as `Pair` is)."""

    host: str
    model: str
    number: int

    @property
    def pair(self) -> Pair:
        return Pair(self.host, self.model)


class SlotNames:
    """The slots named on each host and what their answers said. `figures` and `prefixes` price
    waiting for a busy slot; `similarity` is the hosts' `--slot-prompt-similarity` as the
    operator says they run (`chooses_the_empty_slot`)."""

    def __init__(self, figures: Figures, prefixes: PrefixIndex, similarity: float) -> None:
        self.figures = figures
        self.prefixes = prefixes
        self.similarity = similarity
        # The last request that named each slot: one entry per slot of the fleet at most.
        self._named: dict[SlotKey, NamedSlot] = {}
        # The host's description when a slot was last found emptied between two named
        # requests, and, per model on a host, when one slot was found so twice: named no
        # more until the host is read anew.
        self._emptied: dict[SlotKey, object] = {}
        self._emptying: dict[Pair, object] = {}
        # Answers that found only what they share with the slot's last conversation, and the
        # host's description when that was last logged.
        # The answers that kept only what they share, counted since the host was last read
        # (its description then).
        self._shared_lost: dict[Pair, tuple[object, int]] = {}
        self._shared_logged: dict[Pair, object] = {}

    def emptying(self, host: str, model: str, described: object) -> bool:
        """Whether the host, as `described`, was found emptying its slots (`answered`)."""
        return self._emptying.get(Pair(host, model)) is described

    def name(
        self,
        number: int,
        key: LeaseKey,
        slot: Held,
        prefix: Prefix,
        slots: int,
        described: object,
        in_flight: int,
    ) -> NamedSlot | None:
        """The slot `number` named for a request of the conversation `key` holding `slot`,
        whose prompt is `prefix`, on a host with `slots` slots for the model, `described` as
        it was last read, running `in_flight` requests of the model (this one among them).
        None, and llama-server chooses as for a request that names none, while another
        request runs in that slot and waiting for it is not priced sooner (`_waits_for`), or
        while a request runs there in a slot llama-server chose (`_unplaced_by_us`)."""
        where = SlotKey(slot.host, key.model, number)
        last = self._named.get(where)
        running = last if last is not None and not last.slot.released else None
        if running is None and self._unplaced_by_us(where.pair, slots, in_flight):
            return None
        if running is not None and not self._waits_for(running, prefix, slots):
            return None
        # An answer ended there since the host was read: the slot holds its prompt, and what
        # came after it. Where the request before named none (`told`), only as foreseen, so a
        # turn finding nothing there does not say the host empties its slots.
        holds = last is not None and last.answered and last.described is described
        filled = holds and last is not None and last.told
        told = (
            holds
            or running is not None
            or not self._lands_in_empty(where, prefix, slots, described)
        )
        took = last.prefix if last is not None and holds and last.key != key else None
        named = NamedSlot(
            number, key, slot, described, filled, prefix, running, took=took, told=told
        )
        self._named[where] = named
        return named

    def answered(
        self,
        named: NamedSlot,
        prompt_tokens: int | None,
        cached_tokens: int | None,
        predicted: int | None,
        reported: int | None,
        cache_lost: bool,
    ) -> None:
        """What the host reported for a request that named a slot, once its answer ended well.
        `predicted` and `reported`: the blocks of its prompt the prefix index expected there
        and the host reported cached; `cache_lost`: whether that is a lost cache, by the rule
        the rows count it with. A request to a filled slot that took no token from cache
        found it emptied; a slot found so a second time since the host was read says the host
        empties its idle slots (a unified KV cache), and its slots are named no more until it
        is read anew. Found once, it may have been a restart the poller did not see. A lost
        cache that found only what it shares with the conversation that used the slot last
        (`kept_only_shared`) is counted (`shared_lost`), and the first since the host was
        read is logged with the setting that keeps it. An answer without counts says nothing."""
        if cached_tokens is None:
            return
        named.answered = True
        if cache_lost and kept_only_shared(named, predicted, reported):
            self._kept_shared(named)
        if not found_emptied(named, prompt_tokens, cached_tokens):
            return
        where = SlotKey(named.host, named.key.model, named.number)
        if self._emptied.get(where) is not named.described:
            self._emptied[where] = named.described  # one entry per slot of the fleet at most
            return
        if self._emptying.get(where.pair) is not named.described:
            log.warning(
                "host=%s model=%s emptied slot %d twice between named requests (a unified KV "
                "cache: llama-server's default without -np, or --kv-unified): its slots are "
                "no longer named, and llama-server chooses them from its --cache-ram",
                named.host, named.key.model, named.number,
            )  # fmt: skip
        self._emptying[where.pair] = named.described

    def shared_lost(self, host: str, model: str, described: object) -> int:
        """How many answers on `host` for `model` found only what they share with the
        conversation that used their named slot last (`answered`), since the host was read as
        `described` (its health table's description now): 0 once it was read anew."""
        since, count = self._shared_lost.get(Pair(host, model), (None, 0))
        return count if since is not None and since is described else 0

    def _kept_shared(self, named: NamedSlot) -> None:
        pair = Pair(named.host, named.key.model)
        since, count = self._shared_lost.get(pair, (named.described, 0))
        if since is not named.described:  # read anew since: what was counted is of the past
            count = 0
        self._shared_lost[pair] = (named.described, count + 1)  # one per (host, model)
        if self._shared_logged.get(pair) is named.described:
            return
        self._shared_logged[pair] = named.described
        log.warning(
            "host=%s model=%s gave a conversation back only what it shares with the one that "
            "used its named slot %d last, where its own history was expected: start "
            "llama-server with --slot-prompt-similarity 0.95 so that it loads each "
            "conversation back from --cache-ram (or give it a larger --cache-ram)",
            named.host, named.key.model, named.number,
        )  # fmt: skip

    def _holders(self, pair: Pair, slots: int) -> list[NamedSlot | None]:
        """The last request named in each slot of `pair`, by number (None: never named)."""
        return [self._named.get(SlotKey(pair.host, pair.model, n)) for n in range(slots)]

    def _unplaced_by_us(self, pair: Pair, slots: int, in_flight: int) -> bool:
        """Whether a request runs on the pair in a slot llama-server chose (one spilled there,
        or told no slot), besides the one being named: it may be in any slot not known busy.
        A request naming a busy slot waits for it in llama-server however idle the others are
        (its task is deferred until that slot is free), so a slot is named free only when the
        slots of every other request there are known. The slots' holders named here, and
        those waiting behind them, are known; the rest of `in_flight` (the other processes'
        too, with shared state) is not."""
        known = 0
        for named in self._holders(pair, slots):
            while named is not None and not named.slot.released:
                known += named.told
                named = named.behind
        return in_flight - 1 > known

    def _lands_in_empty(
        self, where: SlotKey, prefix: Prefix, slots: int, described: object
    ) -> bool:
        """Whether a request for the slot `where`, which holds nothing this process knows of,
        would be put there by llama-server if it named none (`chooses_the_empty_slot`).

        Only where every other slot of the host is known here: busy (llama-server passes it
        by), or idle with the prompt of the answer that ended in it since the host was read. An
        unknown one may be empty too, and of two empty slots llama-server takes the one with
        the higher number (its least recently used, on a tie, is the last it looks at)."""
        idle: list[Prefix] = []
        for n, other in enumerate(self._holders(where.pair, slots)):
            if n == where.number:
                continue
            if other is not None and not other.slot.released:
                continue
            if other is None or not other.answered or other.described is not described:
                return False
            idle.append(other.prefix)
        return chooses_the_empty_slot(prefix, idle, self.similarity)

    def _waits_for(self, running: NamedSlot, prefix: Prefix, slots: int) -> bool:
        """Whether a request with the prompt `prefix` should wait for its slot, which
        `running` holds (`waits_for_its_slot`). Naming a busy slot holds the request inside
        llama-server until the slot is free, while another slot may sit idle: a
        conversation's parallel request, or one whose slot another conversation is using,
        waits only when reading its prompt in another slot, and what that slot's conversation
        would lose there, would take longer. Never behind a request that is itself waiting,
        and never without the figures to price it (a host that has not answered yet, an
        engine without `timings`)."""
        host, model, size = running.host, running.key.model, prefix.block_size
        service = self.figures.service(host, model)
        speed = self.figures.speed(host)
        per_token = self.figures.units_per_token(model, size)
        waiting = running.behind is not None and not running.behind.slot.released
        if waiting or not service or not speed or not per_token or not prefix.blocks:
            return False
        tokens = prefix.length / per_token
        at_home = self.prefixes.match(host, model, prefix.blocks) * size / per_token
        # The free slot that holds the most of the prompt, of those named here: llama-server
        # puts an unnamed request in the one whose prompt it shares the most of. A slot not
        # named here (or whose prompt is counted in other units) is taken to hold nothing of
        # it, and nothing to lose.
        free = [
            other.prefix
            for other in self._holders(Pair(host, model), slots)
            if other is not None and other.slot.released and other.prefix.block_size == size
        ]
        shared, there = max(
            ((common_blocks(prefix.blocks, other.blocks), other) for other in free),
            key=lambda found: found[0],
            default=(0, None),
        )
        held = shared * size / per_token
        # What the free slot's own conversation loses there, and reads again on its next turn.
        lost = 0.0 if there is None else prefill(there.length / per_token, held, speed)
        return waits_for_its_slot(
            service, prefill(tokens, at_home, speed), prefill(tokens, held, speed) + lost
        )
