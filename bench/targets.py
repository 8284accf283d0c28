"""What a benchmark run measures: targets, named `KIND[#REV][@SERVER][+LEVER...]`.

Kinds:
- `crossbar`: the gateway from the source tree (or `--rev`), as `make run` serves it;
  `crossbar#REV` is commit REV's (exported with `git archive`), in the same run: e.g.
  `crossbar crossbar#59c3c43` compares a change with the code before it, side by side.
- `floor`: bench/floor_app.py, a bare pass-through with crossbar's client settings.
- `floor-django`: the same pass-through as a Django view behind crossbar's proxy handler.
- `litellm`: LiteLLM's proxy (`make bench-compare` installs it); no server or lever applies.

`@SERVER` is a key of processes.SERVERS (default: the run's `--server`). Levers:
- `httpcore` (the floors): httpx's own transport instead of httpx-aiohttp's, crossbar's only
  one; `aiohttp` names the default explicitly.
- `notee`, `noaccounting` (crossbar only): bench/levers' other patches.
- `stages` (crossbar and the floors): bench/levers' timestamps of each request's way to its
  first token, read after the run (bench/stages.py); it costs a little CPU per chunk.
- `gctime` (crossbar and the floors): the garbage collector's passes and their time, per
  generation, in the target's log at its exit.
- `log-warning` (crossbar only): `CROSSBAR_LOG_LEVEL=WARNING` (no line per request) instead of
  INFO, the default of `make run`, at which every target runs.
- `redis` (crossbar only): `CROSSBAR_REDIS_URL` at a redis-server the bench starts for this
  target alone (processes.redis_server: a free port, `--save "" --appendonly no`, in the run's
  temporary directory, stopped after the target): slots, queues, leases and client counts in
  Redis (routing/shared/). The results add what Redis did per request and what it holds at the
  end.
- `workers2` (crossbar on crossbar_serve's daphne or uvicorn): `CROSSBAR_WORKERS=2`, a
  supervisor and two worker processes, each with its own socket on the port (SO_REUSEPORT);
  implies `redis` (workers need it). Its CPU, RSS and threads are those of the whole process
  tree.

Examples: `crossbar`, `floor@uvicorn`, `floor+httpcore`, `crossbar@uvicorn+notee`,
`crossbar#HEAD~1`, `crossbar+redis`, `crossbar+workers2`, `crossbar@uvicorn+workers2`,
`crossbar+stages floor+stages`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from processes import (
    BENCH,
    SERVERS,
    Server,
    crossbar,
    floor,
    gateway_processes,
    litellm,
    redis_server,
)

KINDS = ("crossbar", "floor", "floor-django", "litellm")
LEVERS = {
    "crossbar": ("notee", "noaccounting", "stages", "gctime", "log-warning", "redis", "workers2"),
    "floor": ("aiohttp", "httpcore", "stages", "gctime"),
    "floor-django": ("aiohttp", "httpcore", "stages", "gctime"),
    "litellm": (),
}  # fmt: skip
PATCHES = ("notee", "noaccounting", "stages", "gctime")  # the levers made by bench/levers
# The servers that crossbar_serve runs itself, whose CROSSBAR_WORKERS it supervises.
WORKER_SERVERS = ("crossbar_serve", "uvicorn")
WORKERS = {"workers2": 2}  # lever -> CROSSBAR_WORKERS
READY_TIMEOUT = 60.0  # seconds for every worker's runtime to appear in Redis


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

    @property
    def workers(self) -> int:
        """The gateway processes it runs (CROSSBAR_WORKERS; 1 without a workers lever)."""
        return max([1, *(WORKERS[lever] for lever in self.levers if lever in WORKERS)])

    @property
    def has_redis(self) -> bool:
        return "redis" in self.levers or self.workers > 1


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
    if {"aiohttp", "httpcore"} <= set(levers):
        raise ValueError(f"target {spec!r}: one transport, aiohttp or httpcore")
    if len(set(levers)) != len(levers):
        raise ValueError(f"target {spec!r}: a lever named twice")
    server = server or default_server
    workers = [lever for lever in levers if lever in WORKERS]
    if workers and server not in WORKER_SERVERS:
        raise ValueError(f"target {spec!r}: CROSSBAR_WORKERS is crossbar_serve's (not {server})")
    if len(workers) > 1:
        raise ValueError(f"target {spec!r}: one workers lever at most")
    if workers and "stages" in levers:
        raise ValueError(f"target {spec!r}: stages follow one process, not workers")
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
    env: dict[str, str] = {}
    patches = [lever for lever in target.levers if lever in PATCHES]
    if patches:
        env["PYTHONPATH"] = os.pathsep.join([str(BENCH / "levers"), str(BENCH)])
        env["CROSSBAR_BENCH_LEVERS"] = ",".join(patches)
    stages = work / f"{name}-stages.jsonl" if "stages" in target.levers else None
    if stages is not None:
        env["CROSSBAR_BENCH_STAGES"] = str(stages)
    if target.kind == "crossbar":
        if "log-warning" in target.levers:
            env["CROSSBAR_LOG_LEVEL"] = "WARNING"
        if target.has_redis:
            return _with_redis(target, work, upstream, source, name, env)
        started = crossbar(work, upstream, source, target.server, name=name, env=env)
    else:
        django = target.kind == "floor-django"
        started = floor(work, upstream, source, target.server, django=django,
                        transport=transport_of(target), name=name, env=env)  # fmt: skip
    return _noting_stages(started, stages)


@contextlib.contextmanager
def _noting_stages(
    started: contextlib.AbstractContextManager[Server], stages: Path | None
) -> Iterator[Server]:
    """The started target, saying where its `+stages` lever writes (once it has stopped)."""
    with started as server:
        yield dataclasses.replace(server, stages=stages)


@contextlib.contextmanager
def _with_redis(
    target: Target, work: Path, upstream: Server, source: Path, name: str, env: dict[str, str]
) -> Iterator[Server]:
    """crossbar with a Redis of its own (started first, stopped last) and CROSSBAR_WORKERS;
    ready once every gateway process has its liveness key in that Redis, since /health
    answers as soon as one worker does."""
    with redis_server(work, name) as url:
        env = {**env, "CROSSBAR_REDIS_URL": url}
        if target.workers > 1:
            env["CROSSBAR_WORKERS"] = str(target.workers)
        with crossbar(work, upstream, source, target.server, name=name, env=env) as main:
            deadline = time.monotonic() + READY_TIMEOUT
            while (found := gateway_processes(url)) < target.workers:
                if time.monotonic() > deadline:
                    sys.exit(
                        f"{target.label}: {found} of {target.workers} gateway processes"
                        f" registered in Redis within {READY_TIMEOUT:g} s (does this code read"
                        f" CROSSBAR_REDIS_URL and CROSSBAR_WORKERS?); see {main.log}"
                    )
                time.sleep(0.1)
            yield dataclasses.replace(
                main, tree=target.workers > 1, redis_url=url, redis_log=work / f"{name}-redis.log"
            )


def transport_of(target: Target) -> str:
    """The upstream transport a target's httpx client runs on: aiohttp unless `+httpcore`."""
    return "httpcore" if "httpcore" in target.levers else "aiohttp"


def reference_floor(target: Target, targets: list[Target]) -> Target | None:
    """The floor a target is judged against: the bare floor on the same server with the same
    transport, else none."""
    for other in targets:
        if (
            other.kind == "floor"
            and other.server == target.server
            and transport_of(other) == transport_of(target)
        ):
            return other
    return None
