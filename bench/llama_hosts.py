"""Real llama-servers for bench/bench_cache.py, each restartable on its own port.

The binary, the tiny model and the way a server is started and stopped are the end-to-end
tests' own (tests/e2e/llama: locate.py, tiny_model.py, server.py), imported from there rather
than copied; the repository's root must be on sys.path.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

from tests.e2e.llama.server import ALIAS, LlamaServer, free_port, running_llama_server

__all__ = ["CTX_PER_SLOT", "MODEL", "Host", "Launch"]

MODEL = ALIAS  # the model name the servers answer to (--alias)
# A slot's context: the tiny model's training context, above the longest prompt of the
# default workload (about 3,300 tokens at the last turn).
CTX_PER_SLOT = 4096


@dataclass(frozen=True)
class Launch:
    """How the bench runs llama-server: the binary, the model, where the logs go, and the
    arguments added to every host's (`--slot-prompt-similarity`, then `--llama-args`)."""

    binary: Path
    model: Path
    work: Path
    extra: tuple[str, ...] = ()


class Host:
    """One llama-server with `slots` slots, `threads` threads and `cache_ram_mib` of prompt
    cache in memory (--cache-ram) on a port it keeps for the whole run, so that a restart
    (`stop`, then `start`) brings it back where crossbar and the bench know it; every other
    setting is llama-server's default. `wrapper`: a command it runs under (`taskset -c 1`, a
    CPU cap: bench/cpu_caps.py). One caller at a time (a restart runs in a thread while nothing
    else starts or stops the host)."""

    def __init__(
        self,
        name: str,
        slots: int,
        threads: int,
        cache_ram_mib: int,
        launch: Launch,
        wrapper: tuple[str, ...] = (),
    ) -> None:
        self.name = name
        self.slots = slots
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._args = ["-np", str(slots), "-t", str(threads), "-tb", str(threads),
                      "-c", str(slots * CTX_PER_SLOT), "--cache-ram", str(cache_ram_mib),
                      "--no-ui", *launch.extra]  # fmt: skip
        self._launch = launch
        self._wrapper = wrapper
        self._running: contextlib.ExitStack | None = None
        self._server: LlamaServer | None = None

    def start(self) -> None:
        """Started and healthy; raises tests.e2e.llama.server.LlamaServerError if not."""
        stack = contextlib.ExitStack()
        launch = self._launch
        self._server = stack.enter_context(running_llama_server(
            launch.binary, launch.model, launch.work, base=self._args, port=self.port,
            wrapper=self._wrapper,
        ))  # fmt: skip
        self._running = stack

    def stop(self) -> None:
        """Stopped (SIGTERM, then SIGKILL after 15 s); nothing when it is not running."""
        if self._running is not None:
            self._running.close()
            self._running = None

    def cold(self) -> None:
        """Restarted: nothing of any earlier request in its slots or its prompt cache."""
        self.stop()
        self.start()

    def crash(self) -> None:
        """Killed (SIGKILL, as a crash or the OOM killer would) and started again. Not a
        SIGTERM: with streams in flight llama-server (build 11434) did not exit within 15 s,
        which made the restart an outage of that long."""
        if self._server is not None:
            self._server.process.kill()
        self.cold()
