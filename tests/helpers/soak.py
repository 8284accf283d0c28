"""The soak's load and faults: clients sending chats one after another, some leaving early, while
faults are injected into random fake hosts (tests/e2e/test_soak.py, tests/shared)."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections import Counter

import httpx

from tests.fakes.llama_server import FakeLlamaServer
from tests.helpers.fleet import chat
from tests.helpers.invariants import Ledger

CLIENTS = 32
# (fail_mode, requests it applies to) and how often each is injected. "hang" costs a slot for
# the 3 s head timeout, so it is rare.
COUNTED_FAULTS = [("error_500", 3), ("reset_before_headers", 2), ("reset_mid_stream", 3)]
KINDS = ("hang", "refuse", "loading", *(mode for mode, _ in COUNTED_FAULTS))


class Faults:
    """Injects faults into random hosts until stopped; counts what it injected."""

    def __init__(self, fakes: list[FakeLlamaServer], rng: random.Random) -> None:
        self.fakes = fakes
        self.rng = rng
        self.injected: Counter[str] = Counter()
        self.stop = threading.Event()

    def run(self) -> None:
        # Every kind once first, in a random order, so each is seen however slow the machine;
        # then kinds at random, a hang rarely (it costs a slot for the 3 s head timeout).
        first = list(KINDS)
        self.rng.shuffle(first)
        while not self.stop.wait(0.25):
            fake = self.rng.choice(self.fakes)
            if fake.fail_mode is not None or fake.health != "ok":
                continue
            self.inject(fake, first.pop() if first else self._random_kind())
        for fake in self.fakes:
            fake.fail_mode, fake.health = None, "ok"

    def _random_kind(self) -> str:
        roll = self.rng.random()
        if roll < 0.08:
            return "hang"
        if roll < 0.16:
            return "refuse"
        if roll < 0.24:
            return "loading"
        return self.rng.choice(COUNTED_FAULTS)[0]

    def inject(self, fake: FakeLlamaServer, kind: str) -> None:
        if kind == "refuse":
            self._for_a_while(fake, "fail_mode", "refuse", None)
        elif kind == "loading":
            self._for_a_while(fake, "health", "loading", "ok")
        else:
            count = dict(COUNTED_FAULTS).get(kind, 1)
            fake.fail_mode, fake.fail_count = kind, count
            self.injected[kind] += count

    def _for_a_while(self, fake: FakeLlamaServer, knob: str, value: str, back: object) -> None:
        setattr(fake, knob, value)
        self.injected[value] += 1
        if not self.stop.wait(self.rng.uniform(0.2, 0.6)):
            setattr(fake, knob, back)

    def total(self) -> int:
        return sum(self.injected.values())


async def load(url: str, ledger: Ledger, seconds: float, rng: random.Random) -> Counter[str]:
    """CLIENTS clients, each sending chats one after another for `seconds`; outcomes by kind.

    A client that leaves does so only after its whole request went out (and was counted): a
    request cut while it is being written never reaches the gateway, so it has no row.
    """
    outcomes: Counter[str] = Counter()

    async def one(client: httpx.AsyncClient) -> None:
        stream = rng.random() < 0.6
        body = chat(
            f"conversation {rng.randrange(300)}", stream=stream, max_tokens=rng.randint(1, 12)
        )
        headers = {"X-Crossbar-Wait-Status": "on"} if stream and rng.random() < 0.2 else {}
        leave_after = rng.uniform(0.0, 0.08) if rng.random() < 0.15 else None
        out = asyncio.Event()

        async def trace(name: str, info: dict) -> None:
            if name == "http11.send_request_body.complete":
                ledger.sent()
                out.set()

        async def ask() -> str:
            request = client.build_request(
                "POST", "/chat/v1/chat/completions", json=body, headers=headers,
                extensions={"trace": trace},
            )  # fmt: skip
            try:
                response = await client.send(request, stream=True)
                try:
                    await response.aread()
                finally:
                    await response.aclose()
            except httpx.TransportError:
                return "broken"  # a whole answer its host cut short
            return str(response.status_code)

        asking = asyncio.ensure_future(ask())
        if leave_after is not None:
            sending = asyncio.ensure_future(out.wait())
            await asyncio.wait((asking, sending), return_when=asyncio.FIRST_COMPLETED)
            sending.cancel()
            await asyncio.wait((asking,), timeout=leave_after)
            if not asking.done():
                asking.cancel()
                outcomes["left"] += 1
                await asyncio.wait((asking,))
                return
        outcomes[await asking] += 1

    async def client_loop(deadline: float) -> None:
        limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
        async with httpx.AsyncClient(base_url=url, timeout=30, limits=limits) as client:
            while time.monotonic() < deadline:
                await one(client)

    deadline = time.monotonic() + seconds
    await asyncio.gather(*(client_loop(deadline) for _ in range(CLIENTS)))
    return outcomes
