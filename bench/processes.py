"""The processes a benchmark runs: the fake upstream, crossbar, the floors, LiteLLM, Redis.

Each is a context manager that starts one server on a free port of 127.0.0.1, yields once it
answers its readiness path, and stops it (SIGTERM, then SIGKILL after 15 s) when the block ends,
its output kept in a log file of the work directory. A target with a Redis (`+redis`,
`+workers2`) gets a redis-server of its own (`redis_server`), started before it and stopped
after it.
"""

from __future__ import annotations

import contextlib
import io
import os
import platform
import shutil
import socket
import subprocess
import sys
import tarfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
RESULTS = BENCH / "results"
LITELLM = BENCH / ".venv-litellm" / "bin" / "litellm"
PYTHON = sys.executable
TOKEN_DELAY = 0.002  # 500 tokens/s per stream: faster than any GPU, so the gateway dominates
APP_DIRS = ("crossbar_site", "routing", "hosts", "accounting")
APP = "crossbar_site.asgi:application"
# The ASGI servers `--server` can put an application behind: how each is started on
# 127.0.0.1:PORT (APP: the application), and the package whose version the results record.
# crossbar_serve's two servers write no access log of their own (the proxy logs one line per
# request at INFO, as `make run` does); the others' access logs are off.
SERVERS: dict[str, tuple[list[str], str]] = {
    # What `make run` serves: crossbar_serve on daphne (crossbar_site/daphne_server.py:
    # backpressure, capped bodies). Floors get the same server from bench/floor_serve.py.
    "crossbar_serve": ([PYTHON, "manage.py", "crossbar_serve", "--port", "PORT"], "daphne"),
    # What `CROSSBAR_SERVER=uvicorn make run` serves: crossbar_serve on uvicorn
    # (crossbar_site/uvicorn_server.py); floors again from bench/floor_serve.py.
    "uvicorn": ([PYTHON, "manage.py", "crossbar_serve", "--server", "uvicorn", "--port", "PORT"],
                "uvicorn"),
    # The servers' own command lines, without crossbar_serve's guards or graceful stop.
    "daphne": (["daphne", "-v", "0", "-b", "127.0.0.1", "-p", "PORT", APP], "daphne"),
    # daphne's loop made by uvloop: the policy set before daphne builds its loop at import.
    "daphne-uvloop": ([PYTHON, str(BENCH / "daphne_uvloop.py"), "-v", "0",
                       "-b", "127.0.0.1", "-p", "PORT", APP], "daphne"),
    # uvicorn[standard] picks uvloop and httptools by itself; no lifespan: no rows at exit here.
    "uvicorn-cli": (["uvicorn", APP, "--host", "127.0.0.1", "--port", "PORT", "--no-access-log",
                     "--lifespan", "off"], "uvicorn"),
    # One worker process (a child of granian's main process); it picks uvloop by itself.
    "granian": (["granian", "--interface", "asgi", "--host", "127.0.0.1", "--port", "PORT",
                 "--workers", "1", "--no-access-log", APP], "granian"),
}  # fmt: skip
# crossbar_serve's servers, for floors: bench/floor_serve.py serves the floor with the same one.
FLOOR_SERVE = {
    "crossbar_serve": [PYTHON, str(BENCH / "floor_serve.py"), "--port", "PORT", APP],
    "uvicorn": [PYTHON, str(BENCH / "floor_serve.py"), "--server", "uvicorn", "--port", "PORT",
                APP],
}  # fmt: skip
# The log level `make run` serves at (crossbar_site/settings.py's default): one line per
# proxied request.
LOG_LEVEL = "INFO"

FLEET_TOML = """\
[[hosts]]
name = "fake"
url = "{upstream}"
notes = "bench/fake_upstream.py"

  [[hosts.models]]
  name = "test-model"
  parallel = 1024
  queue_max = 1024

[[routes]]
name = "bench"
default_model = "test-model"
hosts = ["fake"]
"""

LITELLM_YAML = """\
model_list:
  - model_name: test-model
    litellm_params:
      model: openai/test-model
      api_base: {upstream}/v1
      api_key: x
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for(
    url: str, process: subprocess.Popen[bytes], name: str, log: Path, timeout: float
) -> None:
    """Wait until `url` answers 200; exit when the process (`name`) ends first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            sys.exit(f"{name} exited at start; its log ({log}):\n{log.read_text()}")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(url, timeout=1) as response:
                if response.status == 200:
                    return
        time.sleep(0.1)
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
    sys.exit(f"{url} did not answer within {timeout:g} s; the end of its log:\n{tail}")


@dataclass(frozen=True)
class Server:
    url: str  # the base URL, without a path
    pid: int  # the process that serves (whose CPU is measured)
    log: Path
    tree: bool = False  # its CPU is that of pid and all its descendants (a supervisor, workers)
    redis_url: str = ""  # the target's own Redis, if it has one
    redis_log: Path | None = None
    stages: Path | None = None  # where its `+stages` lever writes its timestamps at exit


@contextlib.contextmanager
def serving(
    command: list[str],
    port: int,
    ready_path: str,
    log: Path,
    *,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    timeout: float = 60.0,
) -> Iterator[Server]:
    """Run a server until the block ends; ready once `ready_path` answers 200."""
    url = f"http://127.0.0.1:{port}"
    with log.open("wb") as output:
        process = subprocess.Popen(
            command, cwd=cwd or log.parent, env=env, stdout=output, stderr=subprocess.STDOUT
        )
        try:
            wait_for(url + ready_path, process, command[0], log, timeout)
            yield Server(url, process.pid, log)
        finally:
            stop(process)


def stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL after 15 s."""
    process.terminate()
    try:
        process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        process.kill()


# redis-server as docs/replicas.md says is enough: no persistence, nothing written to disk.
REDIS_ARGS = ["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]


@contextlib.contextmanager
def redis_server(work: Path, name: str, timeout: float = 15.0) -> Iterator[str]:
    """A redis-server of one target's own on a free port, its files in work/NAME-redis/ and its
    log in work/NAME-redis.log, until the block ends; yields its URL."""
    import redis  # the bench driver's own client (synchronous); only targets with a Redis

    binary = shutil.which("redis-server")
    if binary is None:
        sys.exit(
            "redis-server is not installed (Debian: apt-get install redis-server): the levers"
            " +redis and +workers2 start one for their target"
        )
    directory = work / f"{name}-redis"
    directory.mkdir(exist_ok=True)
    port = free_port()
    log = work / f"{name}-redis.log"
    command = [binary, "--port", str(port), *REDIS_ARGS, "--dir", str(directory)]
    url = f"redis://127.0.0.1:{port}/0"
    with log.open("wb") as output:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT)
        try:
            client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=1)
            deadline = time.monotonic() + timeout
            while True:
                if process.poll() is not None:
                    sys.exit(f"redis-server exited at start; its log ({log}):\n{log.read_text()}")
                try:
                    if client.ping():
                        break
                except redis.ConnectionError:
                    pass
                if time.monotonic() > deadline:
                    sys.exit(f"redis-server did not answer within {timeout:g} s; see {log}")
                time.sleep(0.05)
            client.close()
            yield url
        finally:
            stop(process)


def redis_state(url: str) -> dict[str, object]:
    """What a Redis holds: used_memory (INFO memory), its keys (DBSIZE) and how many of each
    kind (the key with its ids replaced by `*`)."""
    import redis

    client = redis.Redis.from_url(url, socket_timeout=5, decode_responses=True)
    try:
        memory = client.info("memory")
        kinds: dict[str, int] = {}
        for key in client.scan_iter(count=1000):
            kind = key_kind(key)
            kinds[kind] = kinds.get(kind, 0) + 1
        return {
            "used_memory": int(memory["used_memory"]),
            "used_memory_peak": int(memory["used_memory_peak"]),
            "keys": int(client.dbsize()),
            "key_kinds": dict(sorted(kinds.items())),
        }
    finally:
        client.close()


def key_kind(key: str) -> str:
    """`crossbar:held:fake/test-model` -> itself; `crossbar:proc:3fa9c1d2e4b5` ->
    `crossbar:proc:*`: each part with a digit in it stands for an id."""
    return ":".join("*" if any(c.isdigit() for c in part) else part for part in key.split(":"))


def gateway_processes(url: str) -> int:
    """How many gateway processes have a liveness key in this Redis (routing/shared/state.py:
    `<prefix>proc:<id>`, written once a process's runtime has started)."""
    import redis

    client = redis.Redis.from_url(url, socket_timeout=5, decode_responses=True)
    try:
        return sum(1 for _ in client.scan_iter(match="*proc:*", count=1000))
    finally:
        client.close()


def fake_upstream(
    work: Path, token_delay: float = TOKEN_DELAY
) -> contextlib.AbstractContextManager[Server]:
    port = free_port()
    command = [PYTHON, str(BENCH / "fake_upstream.py"), "--port", str(port)]
    command += ["--token-delay", str(token_delay)]
    return serving(command, port, "/health", work / "upstream.log")


def _server_command(template: list[str], port: int, app: str) -> list[str]:
    command = [str(port) if arg == "PORT" else app if arg == APP else arg for arg in template]
    if not command[0].startswith("/"):
        command[0] = str(Path(PYTHON).parent / command[0])
    if not Path(command[0]).exists():
        sys.exit(f"{command[0]} is not installed (bench/README.md says which versions)")
    return command


def _site_env(work: Path) -> dict[str, str]:
    """crossbar's settings as the benchmark runs it: its own database, DEBUG off, the log level
    of `make run`; the server and the workers only as the target says (not inherited)."""
    inherited = {
        name: value
        for name, value in os.environ.items()
        if name not in ("CROSSBAR_SERVER", "CROSSBAR_WORKERS")
    }
    return {
        **inherited,
        "DATABASE_URL": f"sqlite:///{work / 'bench.sqlite3'}",
        "CROSSBAR_VAR_DIR": str(work),
        "DEBUG": "false",
        "CROSSBAR_LOG_LEVEL": LOG_LEVEL,
        "PYTHONUNBUFFERED": "1",
    }


@contextlib.contextmanager
def crossbar(
    work: Path,
    upstream: Server | None,
    source: Path,
    server: str,
    fleet_toml: str = FLEET_TOML,
    *,
    name: str = "crossbar",
    env: dict[str, str] | None = None,
    commands: Sequence[Sequence[str]] = (),
) -> Iterator[Server]:
    """crossbar from `source` behind `server` (a key of SERVERS), on a new SQLite database
    (`work/NAME.sqlite3`) with `fleet_toml` (by default one host, the fake, and one route
    `bench`; `{upstream}` in it is the URL of `upstream`, when one is given, and braces are
    then doubled); `env` is added to its environment; `commands`: more manage.py commands run
    on its database before it serves (client keys made in a shell: what the admin would
    hold). The pid watched is the process that serves."""
    env = {
        **_site_env(work),
        "DATABASE_URL": f"sqlite:///{work / f'{name}.sqlite3'}",
        **(env or {}),
    }
    fleet = work / f"{name}-fleet.toml"
    fleet.write_text(fleet_toml.format(upstream=upstream.url) if upstream else fleet_toml)
    manage = [PYTHON, str(source / "manage.py")]
    for step in (["migrate", "--noinput"], ["crossbar_config", "load", str(fleet)], *commands):
        done = subprocess.run([*manage, *step], cwd=source, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"manage.py {' '.join(step)} failed:\n{done.stdout}{done.stderr}")
    port = free_port()
    command = _server_command(SERVERS[server][0], port, APP)
    with serving(command, port, "/health", work / f"{name}.log", env=env, cwd=source) as main:
        yield Server(main.url, worker_pid(main.pid), main.log) if server == "granian" else main


def fleet_problems(work: Path, source: Path, fleet_toml: str, name: str) -> str | None:
    """What `manage.py crossbar_config check` finds wrong with `fleet_toml` (written to
    `work/NAME-fleet.toml`), or None when it would load: a benchmark can skip a setting the
    code it measures does not know yet instead of failing at its start."""
    fleet = work / f"{name}-fleet.toml"
    fleet.write_text(fleet_toml)
    command = [PYTHON, str(source / "manage.py"), "crossbar_config", "check", str(fleet)]
    done = subprocess.run(command, cwd=source, env=_site_env(work), capture_output=True, text=True)
    return None if done.returncode == 0 else (done.stderr or done.stdout).strip()


@contextlib.contextmanager
def floor(
    work: Path,
    upstream: Server,
    source: Path,
    server: str,
    *,
    django: bool = False,
    transport: str = "aiohttp",
    name: str = "floor",
    env: dict[str, str] | None = None,
) -> Iterator[Server]:
    """bench/floor_app.py behind `server`: the bare pass-through, or with `django` its Django
    rung (crossbar's proxy handler from `source`). crossbar_serve's servers come from `source`
    too (bench/floor_serve.py), so that a floor and crossbar differ by the application alone.
    `env` is added to its environment; a PYTHONPATH there goes before the floor's own."""
    extra = dict(env or {})
    paths = [extra.pop("PYTHONPATH")] if "PYTHONPATH" in extra else []
    env = {
        **_site_env(work),
        "PYTHONPATH": os.pathsep.join([*paths, str(BENCH), str(source)]),
        "FLOOR_UPSTREAM": upstream.url,
        "FLOOR_TRANSPORT": transport,
        **extra,
    }
    app = "floor_app:django_application" if django else "floor_app:application"
    port = free_port()
    template = FLOOR_SERVE.get(server) or SERVERS[server][0]
    command = _server_command(template, port, app)
    with serving(command, port, "/health", work / f"{name}.log", env=env, cwd=source) as main:
        yield Server(main.url, worker_pid(main.pid), main.log) if server == "granian" else main


def worker_pid(pid: int) -> int:
    """The one child of granian's main process: the worker, which runs the application."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    if len(children) != 1:
        sys.exit(f"expected one granian worker under pid {pid}, found {children}")
    return int(children[0])


def server_version(server: str) -> str:
    return metadata.version(SERVERS[server][1])


def source_tree(work: Path, rev: str | None) -> tuple[Path, dict[str, object]]:
    """The code to benchmark: the working tree as it is, or commit `rev` exported into `work`
    (`git archive`, into a directory named after the commit, so several can sit side by side)."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()

    try:
        commit = git("rev-parse", "--short", rev or "HEAD")
    except subprocess.CalledProcessError as exc:
        sys.exit(f"git cannot name {rev!r}: {exc.stderr.strip()}")
    if rev is None:
        changed = git("status", "--porcelain", "--untracked-files=no", "--", *APP_DIRS)
        return ROOT, {"commit": commit, "working_tree": True, "uncommitted": bool(changed)}
    source = work / f"source-{commit}"
    if not source.exists():
        archive = subprocess.run(
            ["git", "archive", commit], cwd=ROOT, capture_output=True, check=True
        )
        with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
            tar.extractall(source, filter="data")
    return source, {"commit": commit, "working_tree": False, "uncommitted": False}


def litellm(work: Path, upstream: Server) -> contextlib.AbstractContextManager[Server]:
    """LiteLLM's proxy, no database, one OpenAI-compatible model at the fake."""
    if not LITELLM.exists():
        sys.exit(
            f"LiteLLM is not installed at {LITELLM.parent.parent}: run `make bench-compare`, "
            "which installs it there with pip (litellm[proxy])."
        )
    config = work / "litellm.yaml"
    config.write_text(LITELLM_YAML.format(upstream=upstream.url))
    env = {
        **os.environ,
        # No master key: requests are not authenticated, as crossbar's are not.
        "LITELLM_DANGEROUSLY_PERMIT_WEAK_OR_UNSET_MASTER_KEY": "true",
        # The machine has no internet; do not wait on fetching the price list.
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        "LITELLM_LOG": "WARNING",
    }
    port = free_port()
    command = [str(LITELLM), "--config", str(config), "--host", "127.0.0.1", "--port", str(port)]
    log = work / "litellm.log"
    return serving(command, port, "/health/liveliness", log, env=env, timeout=120)


def litellm_version() -> str:
    python = LITELLM.parent / "python"
    done = subprocess.run(
        [str(python), "-c", "import importlib.metadata as m; print(m.version('litellm'))"],
        capture_output=True,
        text=True,
    )
    return done.stdout.strip() or "unknown"


def machine() -> dict:
    cpu = next(
        (line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
         if line.startswith("model name")),
        platform.processor(),
    )  # fmt: skip
    memory_kb = int(Path("/proc/meminfo").read_text().split()[1])
    return {
        "cpus": os.cpu_count(),
        "cpu_model": cpu,
        "memory_gb": round(memory_kb / 1024**2, 1),
        "python": platform.python_version(),
        "kernel": platform.release(),
    }
