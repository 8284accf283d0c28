"""A share of the CPU for each llama-server of bench/bench_cache.py, as a machine of its own.

Three hosts on a two-core machine share its cores: a request that one host evaluates slows the
others, a cost no figure of crossbar's can see and one separate machines do not have. A host
capped at a share of a core (a CPU cgroup's quota: `cpu.max` on cgroup v2, `cpu.cfs_quota_us`
on v1) runs no faster when the others are idle and no slower when they are busy, as long as
the caps together leave the gateway and the bench room. Needs root (or a delegated cgroup).
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["CpuCap", "CpuCapError", "cpu_caps"]

ROOT = Path("/sys/fs/cgroup")
PERIOD_US = 10_000  # a short period: a capped prefill waits at most 10 ms for its next turn


class CpuCapError(Exception):
    """The machine cannot cap a process's CPU (no writable cgroup): the message says why."""


class CpuCap:
    """A cgroup named `name` that holds its processes to `cores` (a fraction of one, or more).

    `wrapper` is a command that moves itself into the group and then runs the one it is given,
    for tests/e2e/llama/server.py's `running_llama_server(..., wrapper=...)`. `remove` deletes
    the group once its processes are gone.
    """

    def __init__(self, name: str, cores: float) -> None:
        if cores <= 0:
            raise CpuCapError(f"a CPU cap must be above 0 cores, not {cores:g}")
        quota = max(1_000, round(cores * PERIOD_US))
        unified = (ROOT / "cgroup.controllers").exists()
        self.group = (ROOT if unified else ROOT / "cpu") / f"crossbar-bench-{name}-{os.getpid()}"
        try:
            if unified:
                (ROOT / "cgroup.subtree_control").write_text("+cpu")
                self.group.mkdir(exist_ok=True)
                (self.group / "cpu.max").write_text(f"{quota} {PERIOD_US}")
            else:
                self.group.mkdir(exist_ok=True)
                (self.group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
                (self.group / "cpu.cfs_quota_us").write_text(str(quota))
        except OSError as exc:
            raise CpuCapError(
                f"cannot cap a host's CPU at {self.group}: {exc.strerror or exc} (needs root and "
                "a cgroup CPU controller: cgroup v2's cpu.max or v1's cpu.cfs_quota_us)"
            ) from exc

    @property
    def wrapper(self) -> tuple[str, ...]:
        procs = self.group / "cgroup.procs"
        return ("sh", "-c", f'echo $$ > {procs} && exec "$@"', "sh")

    def remove(self) -> None:
        try:
            self.group.rmdir()
        except OSError:
            pass  # a process still in it (a kill not yet reaped): the kernel keeps it empty


def cpu_caps(names: list[str], cores: float) -> list[CpuCap]:
    """A cap of `cores` for each of `names`; if one cannot be made, those made are removed
    before the error goes on, so a failed start leaves no group behind."""
    caps: list[CpuCap] = []
    try:
        for name in names:
            caps.append(CpuCap(name, cores))
    except CpuCapError:
        for cap in caps:
            cap.remove()
        raise
    return caps
