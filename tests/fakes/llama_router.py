"""The models of a fake llama-server in router mode (`--models-dir`, `--models-max N`).

Like llama-server's `server-models.cpp`: each model is "unloaded", "loading" or "loaded"; a
load evicts the least recently used running model when `models_max` are running (0: no
limit) and takes `load_delay` seconds; a load that fails leaves the model "unloaded" with a
non-zero exit code (`/models` then shows `failed: true`). POST requests count as a use.
Everything here runs on the fake's event loop.

Simplified: unloading or evicting a model does not cut the requests it is answering (the real
child process exits), and answers go out as a single server's would (the real router
re-sends each child's body chunked).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from tests.fakes.llama_docs import RouterEntry

RUNNING = ("loading", "loaded")


class ModelNotFound(LookupError):
    pass


class LoadFailed(RuntimeError):
    pass


@dataclass(slots=True)
class _Model:
    name: str
    status: str = "unloaded"
    exit_code: int = 0
    last_used: float = 0.0
    loaded: asyncio.Event = field(default_factory=asyncio.Event)  # set when not loading
    task: asyncio.Task[None] | None = None


class ModelTable:
    """The router's models, in the order they were given."""

    def __init__(self, names: Iterable[str]) -> None:
        self._models = {name: _Model(name) for name in names}
        for model in self._models.values():
            model.loaded.set()

    def __contains__(self, name: object) -> bool:
        return name in self._models

    def entries(self) -> list[RouterEntry]:
        return [RouterEntry(m.name, m.status, m.exit_code) for m in self._models.values()]

    def status(self, name: str) -> str:
        return self._get(name).status

    def is_running(self, name: str) -> bool:
        return self._get(name).status in RUNNING

    def touch(self, name: str) -> None:
        self._get(name).last_used = time.monotonic()

    def load(self, name: str, *, models_max: int, load_delay: float, fails: bool) -> None:
        """Start loading `name` unless it is running; done at once when `load_delay` is 0."""
        model = self._get(name)
        if model.status != "unloaded":
            return
        self._evict_lru(models_max)
        model.status, model.exit_code = "loading", 0
        model.last_used = time.monotonic()
        model.loaded.clear()
        if load_delay <= 0:
            self._finish(model, fails)
        else:
            model.task = asyncio.get_running_loop().create_task(
                self._load_later(model, load_delay, fails)
            )

    def unload(self, name: str) -> None:
        """Stop a running model (a load in progress is abandoned)."""
        model = self._get(name)
        if model.task is not None:
            model.task.cancel()
            model.task = None
        model.status, model.exit_code = "unloaded", 0
        model.loaded.set()

    async def ensure_loaded(
        self, name: str, *, models_max: int, load_delay: float, fails: bool
    ) -> None:
        """Load `name` if needed and wait until it is loaded; LoadFailed if it could not be."""
        model = self._get(name)
        if model.status == "loaded":
            return
        if model.status == "unloaded":
            self.load(name, models_max=models_max, load_delay=load_delay, fails=fails)
        await model.loaded.wait()
        if model.status != "loaded":
            raise LoadFailed(f"model name={name} failed to load")

    def stop(self) -> None:
        for model in self._models.values():
            if model.task is not None:
                model.task.cancel()

    def _get(self, name: str) -> _Model:
        try:
            return self._models[name]
        except KeyError:
            raise ModelNotFound(name) from None

    def _evict_lru(self, models_max: int) -> None:
        if models_max <= 0:
            return
        running = [m for m in self._models.values() if m.status in RUNNING]
        if len(running) >= models_max:
            self.unload(min(running, key=lambda m: m.last_used).name)

    async def _load_later(self, model: _Model, delay: float, fails: bool) -> None:
        await asyncio.sleep(delay)
        model.task = None
        self._finish(model, fails)

    @staticmethod
    def _finish(model: _Model, fails: bool) -> None:
        if fails:
            model.status, model.exit_code = "unloaded", 1
        else:
            model.status = "loaded"
        model.loaded.set()
