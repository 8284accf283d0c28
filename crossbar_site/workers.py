"""Several gateway processes on one port: `CROSSBAR_WORKERS=N make run`, on either server.

One process (the supervisor) holds the port and starts N workers, each `manage.py
crossbar_serve` on the same server (`CROSSBAR_SERVER`), each listening on a socket of its own
bound to that port with SO_REUSEPORT: the kernel spreads new connections evenly over the
workers (by a hash of each connection's addresses), where with one shared socket the worker
that happens to be waiting in `accept` takes it. A worker that dies loses only the connections
it had, and the kernel hands new ones to the others until it is replaced. The supervisor keeps
a socket bound to the port without listening on it (it gets no connections): the port stays
this gateway's while a worker restarts, and port 0 names one port for all. It serves nothing:

- a worker that exits on its own is replaced (a worker that keeps dying at start stops them
  all, exit 1, instead of looping);
- SIGTERM or SIGINT: it passes SIGTERM on; each worker stops as one process does
  (crossbar_site/lifecycle.py: `/health` draining while its requests finish within the grace,
  then it stops listening and writes their rows); a second signal is passed on too (cut now).
  It exits 0 when every worker stopped cleanly (exit 0, or still starting when the signal
  came);
- workers sit in their own process group, so Ctrl-C reaches them once, through the
  supervisor; and each holds one end of a pipe whose other end only the supervisor holds, so
  a supervisor killed with SIGKILL makes them stop gracefully rather than linger.

Workers share nothing in memory: N > 1 needs CROSSBAR_REDIS_URL, where they share their state
(routing/shared/, docs/replicas.md), and should share a PostgreSQL database: on SQLite the
supervisor says so at start (the workers' row writers and config reads then take turns on one
file's lock).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

from django.conf import settings
from django.core.management.base import CommandError

log = logging.getLogger("crossbar.workers")

LIFELINE = "CROSSBAR_WORKER_LIFELINE"  # in a worker: reads end-of-file once the supervisor is gone
MOST = 64
_EARLY = 10.0  # seconds: a worker exiting sooner than this after its start "dies at start"


def count() -> int:
    """The number of processes CROSSBAR_WORKERS asks for (default 1).

    Raises CommandError, one line saying why, for a bad value or for N > 1 without Redis."""
    raw = os.environ.get("CROSSBAR_WORKERS", "").strip() or "1"
    try:
        workers = int(raw)
    except ValueError:
        workers = 0
    if not 1 <= workers <= MOST:
        raise CommandError(
            f"CROSSBAR_WORKERS must be a whole number of processes from 1 to {MOST}, not {raw!r}"
        )
    if workers > 1 and not settings.REDIS_URL:
        raise CommandError(
            f"CROSSBAR_WORKERS={workers} needs CROSSBAR_REDIS_URL: several gateway processes "
            "share their slots, queues and leases through Redis (docs/replicas.md)"
        )
    return workers


def lifeline() -> int | None:
    """In a worker: the pipe end that reads end-of-file once its supervisor is gone; else None."""
    fd = os.environ.get(LIFELINE)
    return None if fd is None else int(fd)


def supervise(host: str, port: int, workers: int, *, grace: float, server: str) -> int:
    """Hold host:port, run `workers` worker processes of `server` on it until a signal; the
    exit code. Raises CommandError when the port is another program's."""
    from crossbar_site.serve import family

    held = socket.socket(family(host), socket.SOCK_STREAM)
    held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        held.bind((host.strip("[]"), port))
    except OSError as exc:
        held.close()
        raise CommandError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    if settings.DATABASES["default"]["ENGINE"].endswith("sqlite3"):
        log.warning(
            "CROSSBAR_WORKERS=%d on SQLite: the workers take turns on one database file; "
            "use PostgreSQL (DATABASE_URL) for several processes (docs/replicas.md)",
            workers,
        )
    with held:
        return _Supervisor(held, workers, grace, server).run()


@dataclass(slots=True)
class _Worker:
    process: subprocess.Popen[bytes]
    started: float = field(default_factory=time.monotonic)


class _Supervisor:
    def __init__(self, held: socket.socket, workers: int, grace: float, server: str) -> None:
        self.host, self.port = held.getsockname()[:2]
        self.wanted = workers
        self.grace = grace
        self.server = server
        # Workers get the read end; only this process holds the write end.
        self.lifeline, self._lifeline_kept = os.pipe()
        self.workers: dict[int, _Worker] = {}
        self.signals: list[str] = []
        self.stopping = False
        self.failed = False
        self.early_exits = 0

    def run(self) -> int:
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._on_signal)
        log.info(
            "serving http://%s:%s with %d %s worker processes",
            self.host, self.port, self.wanted, self.server,
        )  # fmt: skip
        for index in range(1, self.wanted + 1):
            self._start(index)
        handled = 0
        codes: list[int] = []
        while self.workers:
            while handled < len(self.signals):
                self._stop(self.signals[handled], again=handled > 0)
                handled += 1
            for index, worker in list(self.workers.items()):
                code = worker.process.poll()
                if code is None:
                    continue
                del self.workers[index]
                if self.stopping:
                    codes.append(code)
                else:
                    self._replace(index, worker, code)
            time.sleep(0.1)  # a supervisor's pace: it only watches its children
        os.close(self._lifeline_kept)
        os.close(self.lifeline)
        # A worker ended by SIGTERM's default action was still starting (a serving worker
        # handles the signal and exits 0): it had nothing to finish.
        ok = not self.failed and all(code in (0, -signal.SIGTERM) for code in codes)
        log.info("all workers stopped" if ok else "workers stopped; some did not exit cleanly")
        return 0 if ok else 1

    def _on_signal(self, signum: int, frame: object) -> None:
        self.signals.append(signal.Signals(signum).name)  # handled by the loop, not in here

    def _start(self, index: int) -> None:
        process = subprocess.Popen(
            [sys.executable, str(settings.BASE_DIR / "manage.py"), "crossbar_serve",
             "--bind", self.host, "--port", str(self.port), "--server", self.server,
             "--grace", repr(self.grace)],
            env={**os.environ, LIFELINE: str(self.lifeline), "CROSSBAR_WORKER": str(index)},
            pass_fds=(self.lifeline,),
            process_group=0,
        )  # fmt: skip
        self.workers[index] = _Worker(process)
        log.info("worker %d started (pid %d)", index, process.pid)

    def _replace(self, index: int, worker: _Worker, code: int) -> None:
        how = f"signal {signal.Signals(-code).name}" if code < 0 else f"status {code}"
        lived = time.monotonic() - worker.started
        log.warning(
            "worker %d (pid %d) exited with %s after %.0f s; starting another",
            index, worker.process.pid, how, lived,
        )  # fmt: skip
        self.early_exits = self.early_exits + 1 if lived < _EARLY else 0
        if self.early_exits >= 3:
            log.error("worker processes keep exiting at start (see above): stopping")
            self.failed = True
            self._stop("failing workers", again=False)
            return
        self._start(index)

    def _stop(self, why: str, *, again: bool) -> None:
        if again:
            log.warning("%s again: the workers cut their requests now", why)
        elif not self.stopping:
            self.stopping = True
            log.warning("%s: stopping %d worker processes", why, len(self.workers))
        for worker in self.workers.values():
            with contextlib.suppress(ProcessLookupError):
                worker.process.send_signal(signal.SIGTERM)
