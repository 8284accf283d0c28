"""What a benchmark run measures: targets, named `KIND[#REV][@SERVER][+LEVER...]`.

Kinds:
- `crossbar`: the gateway from the source tree (or `--rev`), as `make run` serves it;
  `crossbar#REV` is commit REV's (exported with `git archive`), in the same run: e.g.
  `crossbar crossbar#59c3c43` compares a change with the code before it, side by side.
- `floor`: bench/floor_app.py, a bare pass-through with crossbar's client settings.
- `floor-django`: the same pass-through as a Django view behind crossbar's proxy handler.
- `litellm`: LiteLLM's proxy (`make bench-compare` installs it); no server or lever applies.

`@SERVER` is a key of processes.SERVERS (default: the run's `--server`). Levers:
- `aiohttp` (any but litellm): the httpx-aiohttp transport instead of httpcore; in crossbar
  through bench/levers (a patch at start, nothing under routing/ changes).
- `notee`, `noaccounting` (crossbar only): bench/levers' other patches.
- `log-info` (crossbar only): `CROSSBAR_LOG_LEVEL=INFO`, the default of `make run` (one line per
  request), instead of the benchmark's WARNING.

Examples: `crossbar`, `floor@uvicorn`, `floor+aiohttp`, `crossbar@uvicorn+aiohttp+notee`,
`crossbar#HEAD~1`.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

from processes import BENCH, SERVERS, Server, crossbar, floor, litellm

KINDS = ("crossbar", "floor", "floor-django", "litellm")
LEVERS = {
    "crossbar": ("aiohttp", "notee", "noaccounting", "log-info"),
    "floor": ("aiohttp",),
    "floor-django": ("aiohttp",),
    "litellm": (),
}
PATCHES = ("aiohttp", "notee", "noaccounting")  # crossbar's levers made by bench/levers


@dataclass(frozen=True)
class Target:
    kind: str
    server: str  # a key of SERVERS; "" for litellm
    levers: tuple[str, ...]
    label: str  # how tables name it: the spec, with the server only when not the run's
    rev: str | None = None  # crossbar#REV: that commit instead of the run's source

    @property
    def is_gateway(self) -> bool:
        """crossbar itself, with or without levers: what the issue's targets judge."""
        return self.kind == "crossbar"


def parse(spec: str, default_server: str) -> Target:
    """A target from `KIND[#REV][@SERVER][+LEVER...]`. Raises ValueError saying what is wrong."""
    head, *levers = spec.strip().split("+")
    kind, _, server = head.partition("@")
    kind, _, rev = kind.partition("#")
    if rev and kind != "crossbar":
        raise ValueError(f"target {spec!r}: only crossbar takes a #REV")
    if kind not in KINDS:
        raise ValueError(f"target {spec!r}: the kind is one of {', '.join(KINDS)}, not {kind!r}")
    if kind == "litellm":
        if server or levers:
            raise ValueError(f"target {spec!r}: litellm takes no @server and no lever")
        return Target(kind, "", (), kind)
    if server and server not in SERVERS:
        raise ValueError(f"target {spec!r}: the server is one of {', '.join(SERVERS)}")
    for lever in levers:
        if lever not in LEVERS[kind]:
            known = ", ".join(LEVERS[kind])
            raise ValueError(f"target {spec!r}: {kind}'s levers are {known}, not {lever!r}")
    if len(set(levers)) != len(levers):
        raise ValueError(f"target {spec!r}: a lever named twice")
    server = server or default_server
    label = kind + (f"#{rev}" if rev else "") + (f"@{server}" if server != default_server else "")
    label += "".join(f"+{lever}" for lever in levers)
    return Target(kind, server, tuple(levers), label, rev or None)


def parse_all(specs: list[str], default_server: str) -> list[Target]:
    targets = [parse(spec, default_server) for spec in specs]
    labels = [target.label for target in targets]
    if len(set(labels)) != len(labels):
        raise ValueError(f"a target named twice: {' '.join(labels)}")
    return targets


def start(
    target: Target, work: Path, upstream: Server, source: Path, index: int
) -> contextlib.AbstractContextManager[Server]:
    """Start one target; its log is work/<kind>-<index>.log."""
    name = f"{target.kind}-{index}"
    if target.kind == "litellm":
        return litellm(work, upstream)
    if target.kind == "crossbar":
        env: dict[str, str] = {}
        patches = [lever for lever in target.levers if lever in PATCHES]
        if patches:
            env["PYTHONPATH"] = os.pathsep.join([str(BENCH / "levers"), str(BENCH)])
            env["CROSSBAR_BENCH_LEVERS"] = ",".join(patches)
        if "log-info" in target.levers:
            env["CROSSBAR_LOG_LEVEL"] = "INFO"
        return crossbar(work, upstream, source, target.server, name=name, env=env)
    transport = "aiohttp" if "aiohttp" in target.levers else "httpcore"
    django = target.kind == "floor-django"
    return floor(work, upstream, source, target.server, django=django, transport=transport,
                 name=name)  # fmt: skip


def reference_floor(target: Target, targets: list[Target]) -> Target | None:
    """The floor a target is judged against: the bare floor on the same server with the same
    client (`+aiohttp` or not), else none."""
    client = tuple(lever for lever in target.levers if lever in LEVERS["floor"])
    for other in targets:
        if other.kind == "floor" and other.server == target.server and other.levers == client:
            return other
    return None
