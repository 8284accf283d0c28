"""A load generator for streaming chat completions, on raw asyncio protocols.

    python bench/loadgen.py --url http://127.0.0.1:PORT/bench/v1/chat/completions \
        --concurrency 32 --requests 6 --chunks 64 --watch-pid PID

Runs `concurrency` clients, each on its own keep-alive connection (opened again whenever the
server closes it, as llama-server does after every stream). Every client first sends one
unmeasured warm-up request; then all start together and each sends up to `requests` more, one
after the other, until `max_seconds` have passed. Prints one JSON document to stdout: every
measured request's timings, this process's own CPU time (to show it is not the bottleneck), and,
for `--watch-pid`, that process's CPU time and its peak RSS and thread count over the measured
part. With `--watch-tree` too, those of the process and all its descendants (a supervisor and
its workers): CPU summed over the processes that exist at both the start and the end of the
measured part, RSS and threads summed over the tree at each sample. With `--redis-url`, the
Redis server's `INFO commandstats` and `INFO stats` before and after the measured part (the
commands it ran, and the requests it read: round trips), less this process's own INFO call.

It speaks just enough HTTP/1.1 for a streamed response: a head, then a chunked or
Content-Length body, in which it counts SSE `data:` events. Deliberately no httpx: a client
library would cost more CPU per chunk than the gateway it measures.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

SAMPLE_INTERVAL = 0.05  # seconds between RSS samples of the watched process
DATA = b"data: "
DONE = b"data: [DONE]"
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(slots=True)
class Sample:
    """One request: milliseconds from sending it to its response head, first token and end."""

    status: int
    head_ms: float
    ttfb_ms: float
    total_ms: float
    events: int
    error: str = ""
    # Where and when it was sent (the client's port, `time.perf_counter()` seconds: the
    # system's monotonic clock, which the gateway's `+stages` lever reads too), so that a
    # request can be found among the gateway's own timestamps (bench/stages.py).
    port: int = 0
    sent_at: float = 0.0


class ResponseReader(asyncio.Protocol):
    """One keep-alive connection; reads one response at a time into `Sample`s."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = asyncio.get_running_loop().create_future()
        self._done: asyncio.Future[Sample] | None = None
        self.sent_at = 0.0
        self._reset_state()

    def _reset_state(self) -> None:
        self._buffer = b""
        self._in_body = False
        self._status = 0
        self._chunked = False
        self._remaining = -1  # bytes left of the current chunk or Content-Length body
        self._chunk_tail = False  # a chunk's data ended; its CRLF is still to come
        self._keep_alive = True
        self._events = 0
        self._done_seen = False
        self._carry = b""  # the end of the last body piece, for a `data: ` split across reads
        self._t0 = 0.0
        self._head_at = 0.0
        self._first_at = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)
        if self._done is not None and not self._done.done():
            if self._in_body and not self._chunked and self._remaining < 0:
                self._finish()  # a body delimited by the close
            else:
                self._fail(f"connection closed: {exc or 'by the server'}")

    def send(self, request: bytes) -> asyncio.Future[Sample]:
        assert self.transport is not None
        self._reset_state()
        self._done = asyncio.get_running_loop().create_future()
        self._t0 = self.sent_at = time.perf_counter()
        self.transport.write(request)
        return self._done

    def data_received(self, data: bytes) -> None:
        if self._done is None or self._done.done():
            return
        if not self._in_body:
            self._buffer += data
            end = self._buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            self._head_at = time.perf_counter()
            self._read_head(self._buffer[:end].decode("latin-1"))
            data, self._buffer = self._buffer[end + 4 :], b""
            self._in_body = True
        if self._chunked:
            self._read_chunked(data)
        else:
            self._body(data)
            if self._remaining > 0:
                self._remaining -= len(data)
            if self._remaining == 0:
                self._finish()

    def _read_head(self, head: str) -> None:
        status_line, *lines = head.split("\r\n")
        self._status = int(status_line.split(" ", 2)[1])
        for line in lines:
            name, _, value = line.partition(":")
            name, value = name.strip().lower(), value.strip().lower()
            if name == "transfer-encoding" and "chunked" in value:
                self._chunked = True
            elif name == "content-length":
                self._remaining = int(value)
            elif name == "connection" and value == "close":
                self._keep_alive = False

    def _read_chunked(self, data: bytes) -> None:
        buffer = self._buffer + data if self._buffer else data
        position = 0
        while position < len(buffer):
            if self._chunk_tail:
                if len(buffer) - position < 2:
                    break
                position += 2
                self._chunk_tail = False
            elif self._remaining > 0:
                piece = buffer[position : position + self._remaining]
                self._body(piece)
                position += len(piece)
                self._remaining -= len(piece)
                self._chunk_tail = self._remaining == 0
            else:
                end = buffer.find(b"\r\n", position)
                if end < 0:
                    break
                size = int(buffer[position:end].split(b";")[0], 16)
                position = end + 2
                if size == 0:
                    self._finish()  # trailers are not used by anything measured here
                    return
                self._remaining = size
        self._buffer = buffer[position:]

    def _body(self, piece: bytes) -> None:
        if not piece:
            return
        # The carry is too short to hold a whole `data: `, so none is counted twice; `[DONE]`
        # is looked for with a longer one (finding it twice does no harm).
        text = self._carry + piece
        count = text[len(self._carry) - min(len(self._carry), len(DATA) - 1) :].count(DATA)
        if count:
            if not self._first_at:
                self._first_at = time.perf_counter()
            self._events += count
            if not self._done_seen and DONE in text:
                self._done_seen = True
        self._carry = text[-(len(DONE) - 1) :]

    def _finish(self) -> None:
        now = time.perf_counter()
        error = ""
        if self._status == 200 and not self._done_seen:
            error = "stream ended without [DONE]"
        self._complete(
            Sample(
                status=self._status,
                head_ms=(self._head_at - self._t0) * 1000,
                ttfb_ms=((self._first_at or now) - self._t0) * 1000,
                total_ms=(now - self._t0) * 1000,
                events=self._events - self._done_seen,
                error=error,
                port=self._port(),
                sent_at=self._t0,
            )
        )
        if not self._keep_alive and self.transport is not None:
            self.transport.close()

    def _port(self) -> int:
        sockname = self.transport.get_extra_info("sockname") if self.transport else None
        return sockname[1] if sockname else 0

    def _fail(self, error: str) -> None:
        now = (time.perf_counter() - self._t0) * 1000
        self._complete(Sample(self._status, now, now, now, self._events, error))

    def _complete(self, sample: Sample) -> None:
        if self._done is not None and not self._done.done():
            self._done.set_result(sample)


class Client:
    """One simulated user: a conversation of its own on a connection of its own (or, with
    `fresh`, a new conversation every request: `fresh()` builds each request)."""

    def __init__(
        self,
        host: str,
        port: int,
        request: bytes,
        timeout: float,
        reconnect: bool,
        fresh: Callable[[], bytes] | None = None,
    ) -> None:
        self.host, self.port, self.request, self.timeout = host, port, request, timeout
        self.reconnect = reconnect
        self.fresh = fresh
        self.reader: ResponseReader | None = None

    async def send(self) -> Sample:
        """One request. With `reconnect`, on a new connection whose setup counts in its time."""
        started = time.perf_counter()
        try:
            if self.reconnect or self.reader is None or self.reader.closed.done():
                self.close()
                loop = asyncio.get_running_loop()
                _, self.reader = await loop.create_connection(ResponseReader, self.host, self.port)
            if self.fresh is not None:
                self.request = self.fresh()
            async with asyncio.timeout(self.timeout):
                sample = await self.reader.send(self.request)
            if self.reconnect:
                elapsed = (self.reader.sent_at - started) * 1000
                sample.head_ms += elapsed
                sample.ttfb_ms += elapsed
                sample.total_ms += elapsed
            return sample
        except (OSError, TimeoutError) as exc:
            if self.reader is not None and self.reader.transport is not None:
                self.reader.transport.abort()
            self.reader = None
            elapsed = (time.perf_counter() - started) * 1000
            return Sample(0, elapsed, elapsed, elapsed, 0, f"{type(exc).__name__}: {exc}")

    def close(self) -> None:
        if self.reader is not None and self.reader.transport is not None:
            self.reader.transport.close()


def build_request(
    url: str, number: int | str, chunks: int, model: str, headers: list[str]
) -> bytes:
    parts = urlsplit(url)
    body = json.dumps(
        {
            "model": model,
            "stream": True,
            "max_tokens": chunks,
            "messages": [
                {"role": "system", "content": "You are a terse benchmark."},
                {"role": "user", "content": f"Client {number}: count to {chunks}."},
            ],
        }
    ).encode()
    head = [
        f"POST {parts.path or '/'} HTTP/1.1",
        f"Host: {parts.netloc}",
        "Content-Type: application/json",
        "Accept: text/event-stream",
        f"Content-Length: {len(body)}",
        *headers,
    ]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def read_cpu_seconds(pid: int) -> float:
    """utime + stime of a process, all its threads, in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def tree_pids(pid: int) -> list[int]:
    """`pid` and all its descendants (through every thread's /proc/.../children list); those
    that end while being read are left out."""
    found, pending = [], [pid]
    while pending:
        current = pending.pop()
        try:
            tasks = list(Path(f"/proc/{current}/task").iterdir())
        except FileNotFoundError:
            continue
        found.append(current)
        for task in tasks:
            try:
                pending += [int(child) for child in (task / "children").read_text().split()]
            except FileNotFoundError:
                pass
    return found


def read_tree_cpu(pid: int) -> dict[int, tuple[float, float]]:
    """(utime + stime of all threads, of the main thread) of every process of `pid`'s tree."""
    cpu = {}
    for each in tree_pids(pid):
        try:
            cpu[each] = (read_cpu_seconds(each), main_thread_cpu_seconds(each))
        except (FileNotFoundError, ProcessLookupError):
            pass  # it ended meanwhile
    return cpu


def tree_cpu_between(
    before: dict[int, tuple[float, float]], after: dict[int, tuple[float, float]]
) -> dict[int, tuple[float, float]]:
    """CPU used between two readings by each process present in both (a process's own CPU:
    a child that ended meanwhile is not counted anywhere, one started meanwhile neither)."""
    return {
        pid: (after[pid][0] - before[pid][0], after[pid][1] - before[pid][1])
        for pid in before.keys() & after.keys()
    }


def read_rss_mb(pid: int) -> float:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return 0.0  # a child that ended meanwhile
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def machine_busy_seconds() -> float:
    """CPU seconds all processes of the machine have used (all cores), from /proc/stat."""
    user, nice, system, _idle, _iowait, irq, softirq = (
        int(field) for field in Path("/proc/stat").read_text().split(maxsplit=8)[1:8]
    )
    return (user + nice + system + irq + softirq) / CLOCK_TICKS


def main_thread_cpu_seconds(pid: int) -> float:
    """CPU seconds of the main thread: the event loop, as opposed to sync_to_async workers."""
    fields = Path(f"/proc/{pid}/task/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def thread_count(pid: int) -> int:
    try:
        return len(list(Path(f"/proc/{pid}/task").iterdir()))
    except FileNotFoundError:
        return 0  # a child that ended meanwhile


async def watch(pid: int, peak: list[float], tree: bool) -> None:
    """Keep the peaks of RSS (MB) and of the number of threads in `peak`; with `tree`, of
    their sums over the process tree (shared pages count in each process that maps them)."""
    while True:
        pids = tree_pids(pid) if tree else [pid]
        peak[0] = max(peak[0], sum(read_rss_mb(each) for each in pids))
        peak[1] = max(peak[1], sum(thread_count(each) for each in pids))
        await asyncio.sleep(SAMPLE_INTERVAL)


# Commands only a client sends (a script cannot): each is one round trip of the gateway's.
SCRIPT_CALLS = ("evalsha", "eval", "evalsha_ro", "eval_ro", "fcall", "fcall_ro")


def redis_counters(client: Any) -> tuple[dict[str, int], int]:
    """Calls per command (commands run by scripts included) and requests read so far."""
    info = client.info("commandstats", "stats")
    calls = {
        key.removeprefix("cmdstat_"): int(value["calls"])
        for key, value in info.items()
        if key.startswith("cmdstat_")
    }
    return calls, int(info["total_reads_processed"])


def redis_between(
    before: tuple[dict[str, int], int], after: tuple[dict[str, int], int]
) -> dict[str, object]:
    """What Redis did between two `redis_counters`, less the first reading's own INFO (a
    command counts in commandstats once it has run, so in the second reading; each INFO is one
    read, and a reading counts its own read: the second's)."""
    calls = {name: count - before[0].get(name, 0) for name, count in after[0].items()}
    calls["info"] = calls.get("info", 0) - 1
    calls = {name: count for name, count in calls.items() if count}
    return {
        "commands": sum(calls.values()),
        "round_trips": after[1] - before[1] - 1,
        "scripts": sum(calls.get(name, 0) for name in SCRIPT_CALLS),
        "by_command": dict(sorted(calls.items(), key=lambda item: -item[1])),
    }


async def run(args: argparse.Namespace) -> dict[str, object]:
    parts = urlsplit(args.url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    conversations = itertools.count()
    prefix = os.urandom(4).hex()  # a run's conversations are its own, whatever ran before

    def fresh() -> bytes:
        number = f"{prefix}-{next(conversations)}"
        return build_request(args.url, number, args.chunks, args.model, args.header)

    clients = [
        Client(
            host,
            port,
            build_request(args.url, number, args.chunks, args.model, args.header),
            args.timeout,
            args.reconnect,
            fresh if args.new_conversations else None,
        )
        for number in range(args.concurrency)
    ]
    warmup = await asyncio.gather(*(client.send() for client in clients))

    pid, tree = args.watch_pid, args.watch_tree and bool(args.watch_pid)
    peak = [0.0, 0.0]
    redis_client = None
    redis_before: tuple[dict[str, int], int] = ({}, 0)
    if args.redis_url:
        import redis  # only here: the load generator needs it for targets with a Redis

        redis_client = redis.Redis.from_url(args.redis_url, socket_timeout=5)
        redis_before = redis_counters(redis_client)
    tree_before = read_tree_cpu(pid) if tree else {}
    cpu_before = read_cpu_seconds(pid) if pid and not tree else 0.0
    main_before = main_thread_cpu_seconds(pid) if pid and not tree else 0.0
    own_before = time.process_time()
    machine_before = machine_busy_seconds()
    watcher = asyncio.create_task(watch(pid, peak, tree)) if pid else None
    started = time.perf_counter()
    deadline = started + args.max_seconds
    samples: list[Sample] = []

    async def drive(client: Client) -> None:
        for _ in range(args.requests):
            if time.perf_counter() > deadline:
                break
            samples.append(await client.send())

    await asyncio.gather(*(drive(client) for client in clients))
    wall = time.perf_counter() - started
    own_cpu = time.process_time() - own_before
    machine_busy = machine_busy_seconds() - machine_before
    result: dict[str, object] = {
        "concurrency": args.concurrency,
        "chunks": args.chunks,
        "wall_s": wall,
        "loadgen_cpu_s": own_cpu,
        "machine_busy_cores": machine_busy / wall,
        "warmup_errors": sum(1 for s in warmup if s.error or s.status != 200),
        "samples": [asdict(s) for s in samples],
    }
    if pid:
        assert watcher is not None
        watcher.cancel()
        if tree:
            tree_after = read_tree_cpu(pid)
            used = tree_cpu_between(tree_before, tree_after)
            cpu = sum(total for total, _ in used.values())
            main_cpu = sum(main for _, main in used.values())
            result |= {
                "processes": len(used),
                # The root first (a supervisor), then its descendants.
                "cpu_s_by_process": {
                    str(each): used[each][0]
                    for each in sorted(used, key=lambda each: (each != pid, each))
                },  # fmt: skip
                "processes_gone": len(tree_before.keys() - tree_after.keys()),
                "processes_new": len(tree_after.keys() - tree_before.keys()),
            }
        else:
            peak[0] = max(peak[0], read_rss_mb(pid))
            cpu = read_cpu_seconds(pid) - cpu_before
            main_cpu = main_thread_cpu_seconds(pid) - main_before
        result |= {
            "cpu_s": cpu,
            "rss_peak_mb": peak[0],
            # Threads that ended meanwhile count in the process, not in /proc/<pid>/task.
            "thread_cpu_s": {"main": main_cpu, "other": cpu - main_cpu},
            "threads_peak": int(peak[1]),
        }
    if redis_client is not None:
        result["redis"] = redis_between(redis_before, redis_counters(redis_client))
        redis_client.close()
    for client in clients:
        client.close()
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True, help="the chat completions URL")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--requests", type=int, default=4, help="measured requests per client")
    parser.add_argument("--max-seconds", type=float, default=20.0, help="no new request after")
    parser.add_argument("--chunks", type=int, default=64, help="max_tokens of each request")
    parser.add_argument("--model", default="test-model")
    parser.add_argument("--header", action="append", default=[], help="'Name: value'")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per request")
    parser.add_argument(
        "--reconnect",
        action="store_true",
        help="a new connection per request (llama-server closes one after every stream)",
    )
    parser.add_argument(
        "--new-conversations",
        action="store_true",
        help="every request a new conversation (its first message differs), not one per client",
    )
    parser.add_argument("--watch-pid", type=int, default=0, help="report this process's CPU")
    parser.add_argument(
        "--watch-tree",
        action="store_true",
        help="with --watch-pid: the CPU, RSS and threads of that process and its descendants",
    )
    parser.add_argument(
        "--redis-url", default="", help="report what this Redis did during the measured part"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    json.dump(asyncio.run(run(args)), sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
