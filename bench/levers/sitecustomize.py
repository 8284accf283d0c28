"""Bench-only changes to crossbar, for measuring what a change would save without making it.

`bench_gateway.py --targets crossbar+LEVER` starts crossbar with this directory (and bench/)
first in PYTHONPATH and `CROSSBAR_BENCH_LEVERS=LEVER,...`; Python imports this module at start
(`sitecustomize`), before crossbar's own code, and each lever patches one module right after it
is first imported. Nothing under routing/ or crossbar_site/ changes, and no other process (the
tests, `make run`) sees any of it: only a process started with that environment does.

Levers (crossbar's `aiohttp` lever is its own setting, CROSSBAR_UPSTREAM_TRANSPORT=aiohttp):
- `notee`: the tee does not look at chunks (no token counts in the rows).
- `noaccounting`: no row to the recorder and no Prometheus series per request (the log line
  stays, as the log level decides).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Callable
from types import ModuleType, SimpleNamespace
from typing import Any


def _notee(module: ModuleType) -> None:
    module.Tee.feed = lambda self, chunk: None


def _noaccounting(module: Any) -> None:
    class _NoRecorder:
        def record(self, row: object) -> None:
            pass

    module.get_recorder = lambda: _NoRecorder()
    module.metrics = SimpleNamespace(observe=lambda record: None)


# lever -> (the module it patches, the patch)
LEVERS: dict[str, tuple[str, Callable[[ModuleType], None]]] = {
    "notee": ("routing.core.tee", _notee),
    "noaccounting": ("routing.proxy.record", _noaccounting),
}


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Finds the patched modules as usual, then runs their patch once they have executed."""

    def __init__(self, patches: dict[str, list[Callable[[ModuleType], None]]]) -> None:
        self.patches = patches

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in self.patches:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        execute = loader.exec_module
        patches = self.patches.pop(name)

        def exec_module(module: ModuleType) -> None:
            execute(module)
            for patch in patches:
                patch(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]  # this loader runs the patches
        return spec


def _install() -> None:
    wanted = [name for name in os.environ.get("CROSSBAR_BENCH_LEVERS", "").split(",") if name]
    unknown = [name for name in wanted if name not in LEVERS]
    if unknown:
        raise SystemExit(f"unknown bench levers {unknown}: known are {', '.join(LEVERS)}")
    patches: dict[str, list[Callable[[ModuleType], None]]] = {}
    for name in wanted:
        module, patch = LEVERS[name]
        patches.setdefault(module, []).append(patch)
    if patches:
        sys.meta_path.insert(0, _PatchAfterImport(patches))
        print(f"bench levers: {', '.join(wanted)}", file=sys.stderr, flush=True)


_install()
