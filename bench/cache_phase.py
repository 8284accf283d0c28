"""A workload sent to one placement policy, as an agent sends it (bench/bench_cache.py).

Each conversation is a task: it waits for its start, then sends turn after turn, each after
the last one's answer and the agent's pause, a streamed chat completion over httpx. A direct
policy has the bench pick the host (`pick`); crossbar picks it itself. A failed request is
tried again (after its Retry-After, else half a second) for up to a minute. Halfway (or as
told) one host is killed and started again on its port.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import httpx
from cache_report import MISSING, Answer
from cache_workload import Turn, Workload
from llama_hosts import MODEL, Host
from prometheus_client.parser import text_string_to_metric_families

__all__ = ["Phase", "counters", "pick", "request_body", "stream"]

# An agent keeps trying for a minute: after a failure, as long as the answer's Retry-After
# says (crossbar's 503s carry one), else half a second. Shorter, crossbar's refusals while a
# host restarts (its line full on the one host left) would be failures that take their
# tokens out of its sum.
RETRY_FOR = 60.0
RETRY_PAUSE = 0.5
TIMEOUT = httpx.Timeout(connect=5.0, read=300.0, write=30.0, pool=None)
# llama-server closes the connection after every stream: nothing to keep alive.
LIMITS = httpx.Limits(max_connections=None, max_keepalive_connections=0)


@dataclass
class Outcome:
    """One attempt: the status (0: transport error), what it answered, or why it failed."""

    status: int
    first_byte: float | None = None
    timings: dict[str, float] | None = None
    headers: httpx.Headers | None = None
    error: str = ""
    retry_after: float = RETRY_PAUSE


def request_body(turn: Turn, max_tokens: int) -> dict[str, object]:
    # ignore_eos: every answer generates exactly max_tokens, whatever the random weights say.
    return {"model": MODEL, "messages": list(turn.messages), "stream": True,
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "cache_prompt": True}  # fmt: skip


async def stream(client: httpx.AsyncClient, url: str, body: Mapping[str, object]) -> Outcome:
    """POST a streamed chat completion and read it to its end; the last `timings` seen."""
    loop = asyncio.get_running_loop()
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                wait = response.headers.get("Retry-After", "")
                pause = float(wait) if wait.isdigit() else RETRY_PAUSE
                return Outcome(response.status_code, error=text[:200], retry_after=pause)
            outcome = Outcome(200, headers=response.headers)
            buffer = b""
            async for chunk in response.aiter_raw():
                if outcome.first_byte is None and chunk:
                    outcome.first_byte = loop.time()
                *lines, buffer = (buffer + chunk).split(b"\n")
                for line in lines:
                    if line.startswith(b"data: {"):
                        event = json.loads(line[len(b"data: ") :])
                        outcome.timings = event.get("timings") or outcome.timings
            if outcome.timings is None:
                return Outcome(200, error="a stream without timings")
            return outcome
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        return Outcome(0, error=f"{type(exc).__name__}: {exc}"[:200])


# Direct policies that keep a conversation on one host: `sticky` (what a lease does, with
# llama-server choosing the slot) and `pinned` (the same, each conversation also given a slot
# of its own there by `id_slot`): what crossbar would gain by naming slots, measured before
# building it. `pinned-free` names the slot only while no other request of the bench runs in
# it (crossbar's rule for a busy slot), however many conversations share it.
STICKY = ("sticky", "pinned", "pinned-free")


def pick(policy: str, seed: int, key: str, up: Sequence[str], in_flight: Mapping[str, int]) -> str:
    """The host a direct policy sends a request to, among the hosts `up`: the draw is the
    request's own (`key`: conversation, turn, attempt), so it does not depend on timing."""
    if policy == "least-loaded":
        fewest = min(in_flight[host] for host in up)
        up = [host for host in up if in_flight[host] == fewest]
    return up[int(random.Random(f"{seed}/pick/{key}").random() * len(up))]


class Phase:
    """A workload sent to one policy: every conversation a task, each turn after the last
    one's answer and pause. `gateway`: crossbar's chat URL, else the bench picks among
    `hosts`. `restart`: the host killed and started again once `restart_after` requests
    are done (crossbar's /metrics read as it begins)."""

    def __init__(
        self,
        policy: str,
        workload: Workload,
        hosts: Sequence[Host],
        gateway: str | None,
        restart: Host | None,
        restart_after: int,
    ) -> None:
        self.policy = policy
        self.workload = workload
        self.hosts = {host.name: host for host in hosts}
        self.gateway = gateway
        self.restart = restart
        self.restart_after = restart_after
        self.answers: list[Answer] = []
        self.in_flight: Counter[str] = Counter()
        self.down: set[str] = set()
        self.restarted = False
        self.metrics_at_restart: dict[str, dict[str, float]] | None = None
        self.restart_seconds: float | None = None
        # `sticky` and `pinned`: each conversation's host, and (pinned) its slot there.
        self.homes: dict[int, str] = {}
        self.slots: dict[tuple[int, str], int] = {}
        self.named_running: Counter[tuple[str, int]] = Counter()  # (host, slot): requests in it

    async def run(self) -> list[Answer]:
        async with httpx.AsyncClient(timeout=TIMEOUT, limits=LIMITS, trust_env=False) as client:
            self.client = client
            self.began = asyncio.get_running_loop().time()
            async with asyncio.TaskGroup() as group:
                self.group = group
                for conversation in self.workload.conversations:
                    group.create_task(self.converse(conversation.number))
        return self.answers

    async def converse(self, number: int) -> None:
        conversation = self.workload.conversations[number]
        loop = asyncio.get_running_loop()
        await asyncio.sleep(max(0.0, self.began + conversation.start - loop.time()))
        for index, turn in enumerate(conversation.turns):
            self.answers.append(await self.ask(number, index, turn))
            if self.restart is not None and len(self.answers) == self.restart_after:
                self.group.create_task(self.restart_host(self.restart))
            await asyncio.sleep(turn.pause_after)

    async def ask(self, conversation: int, index: int, turn: Turn) -> Answer:
        loop = asyncio.get_running_loop()
        body = request_body(turn, self.workload.shape.max_tokens)
        started, after_restart = loop.time(), self.restarted
        attempt = 0
        while True:
            attempt += 1
            host = ""
            if self.gateway is None:
                up = [name for name in self.hosts if name not in self.down] or list(self.hosts)
                key = f"{conversation}/{index}/{attempt}"
                if self.policy in STICKY:
                    host = self.home(conversation, up)
                else:
                    host = pick(self.policy, self.workload.seed, key, up, self.in_flight)
            url = self.gateway or f"{self.hosts[host].url}/v1/chat/completions"
            sent, named = body, None
            if self.policy in ("pinned", "pinned-free"):
                named = (host, self.slot(conversation, host))
                if self.policy == "pinned-free" and self.named_running[named]:
                    named = None  # busy: llama-server chooses, as crossbar leaves it
                else:
                    sent = {**body, "id_slot": named[1]}
            self.in_flight[host] += 1
            if named is not None:
                self.named_running[named] += 1
            try:
                outcome = await stream(self.client, url, sent)
            finally:
                self.in_flight[host] -= 1
                if named is not None:
                    self.named_running[named] -= 1
            if outcome.timings is not None and outcome.first_byte is not None:
                return self.answer(conversation, index, attempt, host, outcome, started,
                                   after_restart)  # fmt: skip
            if loop.time() + outcome.retry_after > started + RETRY_FOR:
                return Answer(conversation, index, "", outcome.status, attempt, None, None, None,
                              None, error=outcome.error, after_restart=after_restart)  # fmt: skip
            await asyncio.sleep(outcome.retry_after)

    def home(self, conversation: int, up: Sequence[str]) -> str:
        """`sticky`/`pinned`: the conversation's host while it is up; a new one (or one whose
        host is down) goes to the up host with the fewest conversations, then requests."""
        home = self.homes.get(conversation)
        if home is not None and home in up:
            return home
        held = Counter(self.homes.values())
        home = min(up, key=lambda host: (held[host], self.in_flight[host], host))
        self.homes[conversation] = home
        return home

    def slot(self, conversation: int, host: str) -> int:
        """`pinned`: the slot the conversation is given on `host` (llama-server's `id_slot`),
        the one with the fewest conversations so far; kept for its next turns."""
        key = (conversation, host)
        if key not in self.slots:
            taken = Counter(slot for (_, on), slot in self.slots.items() if on == host)
            self.slots[key] = min(range(self.hosts[host].slots), key=lambda n: (taken[n], n))
        return self.slots[key]

    def answer(
        self,
        conversation: int,
        index: int,
        attempt: int,
        host: str,
        outcome: Outcome,
        started: float,
        after_restart: bool,
    ) -> Answer:
        timings, headers = outcome.timings or {}, outcome.headers or httpx.Headers()
        assert outcome.first_byte is not None
        return Answer(
            conversation, index, headers.get("X-Crossbar-Host", host), 200, attempt,
            (outcome.first_byte - started) * 1000, int(timings["prompt_n"]),
            int(timings.get("cache_n", 0)), float(timings.get("prompt_ms", 0.0)),
            placement=headers.get("X-Crossbar-Placement", MISSING) if self.gateway else "",
            lease=headers.get("X-Crossbar-Lease", ""), after_restart=after_restart,
        )  # fmt: skip

    async def restart_host(self, host: Host) -> None:
        if self.gateway is not None:
            self.metrics_at_restart = await asyncio.to_thread(counters, self.gateway)
        began = time.monotonic()
        self.down.add(host.name)
        await asyncio.to_thread(host.crash)
        self.down.discard(host.name)
        self.restarted = True
        self.restart_seconds = time.monotonic() - began


def counters(chat_url: str) -> dict[str, dict[str, float]]:
    """crossbar's cache-lost and prefix-block counters by host, from its /metrics."""
    base = chat_url.split("/bench/", 1)[0]
    with httpx.Client(timeout=10, trust_env=False) as client:
        text = client.get(base + "/metrics").text
    wanted = {"crossbar_cache_lost_total", "crossbar_prefix_predicted_blocks_total",
              "crossbar_prefix_confirmed_blocks_total"}  # fmt: skip
    found: dict[str, dict[str, float]] = {name: {} for name in wanted}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted:
                host = sample.labels.get("host", "")
                found[sample.name][host] = found[sample.name].get(host, 0.0) + sample.value
    return found
