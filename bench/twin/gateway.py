"""crossbar's own runtime in front of twin hosts: the real `Runtime` (live fleet, limiter,
leases, rankings, prefix index, named slots, figures, running table, client gate) built from a
configuration made in memory, and each request through the real `Lifecycle`, as the proxy's
view drives it, with no HTTP and no threads.

The seams, and only these: `forward` (how a host is asked: here a `TwinHost` takes the
request, and its head comes with the first token), the health poller (the twin marks a host
down and up as a poll would find it, a poll interval after the fact, and answers a request's
on-demand probe from the host's own state), and the recorder (rows are counted in memory,
`twin.tally`). Everything else is the code a real request runs.
"""

from __future__ import annotations

import asyncio
import os
import random
from dataclasses import dataclass
from typing import Any, cast

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "crossbar_site.settings")
django.setup()

import httpx  # noqa: E402
from django.conf import settings  # noqa: E402

from accounting.recorder import use_recorder  # noqa: E402
from hosts.describe import Described  # noqa: E402
from hosts.health import HostState  # noqa: E402
from routing import signals  # noqa: E402
from routing.config.shape import FleetConfig, HostConfig, ModelConfig, RouteConfig  # noqa: E402
from routing.core.endpoints import Kind  # noqa: E402
from routing.core.errors import GatewayError, HostDown  # noqa: E402
from routing.core.fingerprint import fingerprint  # noqa: E402
from routing.core.prefixes import prefix_blocks  # noqa: E402
from routing.core.tee import Usage  # noqa: E402
from routing.proxy.ask import Ask  # noqa: E402
from routing.proxy.lifecycle import Lifecycle  # noqa: E402
from routing.proxy.record import Outcome  # noqa: E402
from routing.runtime import Runtime  # noqa: E402
from twin.host import Cut, Prompt, Refused, TwinHost  # noqa: E402
from twin.shapes import HostProfile, Segment  # noqa: E402
from twin.tally import Tally  # noqa: E402

ROUTE = "twin"
PATH = "/v1/chat/completions"  # a path whose requests may name their slot
LEASE_TTL = 1200.0  # a route's default (routing/models.py)


@dataclass(frozen=True, slots=True)
class Policy:
    """How the route places: its `lease_patience` (None: auto, priced), or one host holding
    every slot of the fleet (`one_host`: the cache's best case, the reference; as
    `make bench-cache`'s, its slots are not named, as a client asking it directly names none,
    and it never restarts)."""

    name: str
    patience: float | None = None
    one_host: bool = False
    similarity: float | None = None  # the one host's (None: llama-server's own default)
    compute: int | None = None  # the one host's, in hosts' worth (None: the whole fleet's)


@dataclass(frozen=True, slots=True)
class TwinAsk:
    """A request as the twin's client sends it: its prompt as segments (what the host's
    caches compare) and as a chat's messages (what the gateway reads: `message`), how many
    tokens it asks for, and its answer as the slot will hold it. Carried to `forward` as the
    ask's request."""

    prompt: Prompt
    messages: list[dict[str, str]]
    max_tokens: int
    answer: Segment


CHARS_PER_TOKEN = 4  # of English text; the prefix index converts with each request's own ratio


def message(segment: Segment, role: str) -> dict[str, str]:
    """The segment as a chat message: text of its own (equal segments, equal text), about as
    long as its tokens would be."""
    tag = f"<{segment.id}>"
    size = segment.tokens * CHARS_PER_TOKEN
    return {"role": role, "content": (tag * (size // len(tag) + 1))[:size]}


class TwinAnswer:
    """The host's response head, standing for `httpx.Response`: the job it belongs to."""

    __slots__ = ("job",)

    def __init__(self, job: Any) -> None:
        self.job = job

    async def aclose(self) -> None:
        return None


class TwinGateway:
    """One gateway process over twin hosts, on the running `VirtualLoop`."""

    def __init__(
        self,
        hosts: dict[str, TwinHost],
        model: str,
        patience: float | None,
        *,
        queue_max: int,
        queue_timeout: float = 300.0,
        poll_interval: float = 5.0,
        seed: int = 0,
        name_slots: bool = True,
    ) -> None:
        self.hosts = hosts
        self.model = model
        self.poll_interval = poll_interval
        self.tally = Tally()
        self._polls = random.Random(seed)
        use_recorder(cast(Any, self.tally))
        models = {name: _model(model, host.profile, queue_max) for name, host in hosts.items()}
        # What the gateway is told of its hosts' --slot-prompt-similarity (one preset a fleet).
        profile = next(iter(hosts.values())).profile
        settings.CROSSBAR["SLOT_PROMPT_SIMILARITY"] = profile.similarity
        settings.CROSSBAR["NAME_SLOTS"] = name_slots
        config = FleetConfig(
            hosts={
                name: HostConfig(
                    name, f"http://{name}.twin", 1.0, True, False, "", {model: models[name]}
                )
                for name in hosts
            },
            routes={
                ROUTE: RouteConfig(
                    ROUTE, model, LEASE_TTL, False, True, tuple(hosts),
                    queue_timeout=queue_timeout, lease_patience=patience,
                )
            },
            revision=1,
        )  # fmt: skip
        self.route = config.routes[ROUTE]
        self.runtime = Runtime(config, signals.config_generation())
        self.runtime.probe_down = self._probe_down  # type: ignore[method-assign]  # the twin's poller
        for name in hosts:
            self._polled(name)

    async def aclose(self) -> None:
        use_recorder(None)
        await self.runtime.client.aclose()

    # -- a request ------------------------------------------------------------------------

    async def ask(self, twin_ask: TwinAsk, client: str = "") -> Outcome:
        """One request, from its route to its row; how it ended."""
        payload: dict[str, object] = {"messages": twin_ask.messages}
        ask = Ask(
            request=cast(Any, twin_ask), path=PATH, kind=Kind.GENERATE, body=b"",
            payload=payload, model=self.model, fingerprint=fingerprint("POST", payload, None),
            prefix=prefix_blocks(payload),
        )  # fmt: skip
        life = Lifecycle(forward=self._forward)
        life.routed(self.runtime, self.route)
        try:
            await life.place(ask)
            answered = await life.through()
        except GatewayError as exc:
            answer = life.fail(exc)
            return Outcome(answer.status, answer.message, answer.code)
        job = cast(TwinAnswer, answered.upstream).job
        try:
            await job.done
        except Cut as cut:
            life.host_done()
            outcome = Outcome(502, str(cut), "upstream_failed")
        else:
            life.host_done()
            usage = Usage(job.tokens, job.cache_n, job.max_tokens)
            outcome = Outcome(200, usage=usage, prompt_ms=job.prompt_ms)
        life.end(outcome)
        return outcome

    async def _forward(
        self, runtime: Runtime, ask: Ask, model: str | None, host: str, id_slot: int | None
    ) -> httpx.Response:
        twin_ask = cast(TwinAsk, ask.request)
        twin = self.hosts[host]
        try:
            job = twin.start(twin_ask.prompt, twin_ask.max_tokens, id_slot, twin_ask.answer)
            await job.first_token
        except (Refused, Cut) as exc:
            runtime.health.mark_down(host, str(exc))  # as the real forward marks it
            raise HostDown(f"host {host} unreachable: {exc}") from None
        return cast(httpx.Response, TwinAnswer(job))

    # -- health, as the poller finds it ---------------------------------------------------

    def restart(self, name: str, down: float) -> None:
        """The host goes down now and comes back after `down` seconds; the gateway's poll
        finds each a random part of a poll interval later (a request may find it sooner)."""
        loop = asyncio.get_running_loop()
        twin = self.hosts[name]
        twin.go_down()
        loop.call_later(self._polls.uniform(0, self.poll_interval), self._polled, name)
        loop.call_later(down, twin.come_up)
        loop.call_later(down + self._polls.uniform(0, self.poll_interval), self._polled, name)

    def _polled(self, name: str) -> None:
        twin = self.hosts[name]
        health = self.runtime.health
        if not twin.up:
            health.mark_down(name, "connection refused")
            return
        health.set(name, HostState.UP, loaded=None, described=Described(slots=len(twin.slots)))

    async def _probe_down(self, route: RouteConfig) -> None:
        for name in route.hosts:
            if name in self.hosts and not self.runtime.health.eligible(name):
                self._polled(name)


def _model(model: str, profile: HostProfile, queue_max: int) -> ModelConfig:
    return ModelConfig(model, model, profile.slots, queue_max)
