"""Running a real llama-server on a free 127.0.0.1 port, for tests and captures."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

# -np 2 slots, one thread, 512 tokens of context per slot: enough for every test prompt, small
# enough to start in a second on a busy 2-core machine.
BASE_ARGS = ("-np", "2", "-t", "1", "-tb", "1", "-c", "1024", "--no-ui")
ALIAS = "crossbar-tiny"


class LlamaServerError(RuntimeError):
    """llama-server exited or never became healthy; the message carries its log's tail."""


@dataclass(frozen=True)
class LlamaServer:
    url: str
    port: int
    process: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _tail(path: Path, lines: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def wait_healthy(server: LlamaServer, timeout: float) -> None:
    """Wait for /health to answer 200 (503 while the model loads); raise with the log if not."""
    deadline = time.monotonic() + timeout
    while True:
        if server.process.poll() is not None:
            raise LlamaServerError(
                f"llama-server exited with {server.process.returncode}:\n{_tail(server.log_path)}"
            )
        try:
            if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise LlamaServerError(
                f"llama-server not healthy after {timeout} s:\n{_tail(server.log_path)}"
            )
        time.sleep(0.1)


@contextlib.contextmanager
def running_llama_server(
    binary: Path,
    model: Path,
    log_dir: Path,
    extra: Sequence[str] = (),
    *,
    base: Sequence[str] = BASE_ARGS,
    alias: str | None = ALIAS,
    timeout: float = 120,
    port: int | None = None,
    wrapper: Sequence[str] = (),
) -> Iterator[LlamaServer]:
    """llama-server serving `model` with `base` + `extra` arguments, healthy, then stopped.

    `alias=None` leaves the model's id to llama-server (its file name). `port`: a free one
    unless given (bench/bench_cache.py restarts a host where it was). `wrapper`: a command that
    runs the server in its own process (`taskset -c 1`: the bench pins a host to a core). The
    server's output is appended to `log_dir/llama-server-<port>.log`.
    """
    port = port or free_port()
    args = [*wrapper, str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port)]
    args += base
    if alias:
        args += ["--alias", alias]
    args += list(extra)
    with _serving(args, port, log_dir, timeout) as server:
        yield server


@contextlib.contextmanager
def running_router(
    binary: Path, models_dir: Path, log_dir: Path, extra: Sequence[str] = (), timeout: float = 120
) -> Iterator[LlamaServer]:
    """llama-server in router mode over the *.gguf files of `models_dir` (each a model, named
    by its file), with `BASE_ARGS` for each model it loads and `extra`, healthy, then stopped
    with the models it runs."""
    port = free_port()
    args = [str(binary), "--models-dir", str(models_dir), "--host", "127.0.0.1"]
    args += ["--port", str(port), *BASE_ARGS, *extra]
    with _serving(args, port, log_dir, timeout) as server:
        yield server


@contextlib.contextmanager
def _serving(args: list[str], port: int, log_dir: Path, timeout: float) -> Iterator[LlamaServer]:
    """The server `args` start, on `port`, healthy, then stopped; its output appended to
    `log_dir/llama-server-<port>.log`."""
    log_path = log_dir / f"llama-server-{port}.log"
    with log_path.open("ab") as log_file:
        process = subprocess.Popen(args, stdout=log_file, stderr=subprocess.STDOUT)
    server = LlamaServer(url=f"http://127.0.0.1:{port}", port=port, process=process,
                         log_path=log_path)  # fmt: skip
    try:
        wait_healthy(server, timeout)
        yield server
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=15)
