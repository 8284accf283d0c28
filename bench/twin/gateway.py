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
import math
import os
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "crossbar_site.settings")
django.setup()

import httpx  # noqa: E402
from django.conf import settings  # noqa: E402
from django.http import HttpRequest  # noqa: E402

from accounting.keys import hash_key  # noqa: E402
from accounting.recorder import use_recorder  # noqa: E402
from hosts.describe import Described, ModelState  # noqa: E402
from hosts.health import HostState  # noqa: E402
from routing import signals  # noqa: E402
from routing.config.shape import FleetConfig, HostConfig, ModelConfig, RouteConfig  # noqa: E402
from routing.core.clients import ClientSpec  # noqa: E402
from routing.core.endpoints import GENERATE, Kind  # noqa: E402
from routing.core.errors import GatewayError, HostDown  # noqa: E402
from routing.core.fingerprint import fingerprint  # noqa: E402
from routing.core.patience import Figures as Learnt  # noqa: E402
from routing.core.prefixes import prefix_blocks  # noqa: E402
from routing.core.tee import Usage  # noqa: E402
from routing.proxy.access import check_access  # noqa: E402
from routing.proxy.ask import Ask  # noqa: E402
from routing.proxy.lifecycle import Lifecycle  # noqa: E402
from routing.proxy.record import Outcome  # noqa: E402
from routing.runtime import Runtime  # noqa: E402
from twin.host import Cut, Prompt, Refused, TwinHost  # noqa: E402
from twin.router import NotLoaded, RouterHost  # noqa: E402
from twin.shapes import Segment  # noqa: E402
from twin.tally import Tally  # noqa: E402

ROUTE = "twin"
PATH = "/v1/chat/completions"  # a path whose requests may name their slot
LEASE_TTL = 1200.0  # a route's default (routing/models.py)
REFUSED_AFTER = 0.001  # seconds for a refused connection to come back


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
    tokens it asks for, and its answer as the slot will hold it; the model it names (none: the
    route's default). Carried to `forward` as the ask's request."""

    prompt: Prompt
    messages: list[dict[str, str]]
    max_tokens: int
    answer: Segment
    model: str = ""


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


class _Unserved:
    """The job of a request its host answered 400 at once (a router with autoload off, asked
    for a model it has not loaded): `done` raises the host's answer."""

    __slots__ = ("done",)

    def __init__(self, answer: NotLoaded) -> None:
        self.done = asyncio.get_running_loop().create_future()
        self.done.set_exception(answer)


TwinServer = TwinHost | RouterHost


class WatchedFigures(Learnt):
    """The runtime's figures, keeping each wait in line priced patience compares with its
    price (`Figures.waited`), as (priced, had) seconds, for the table's verdicts."""

    __slots__ = ("waits",)

    def __init__(self) -> None:
        super().__init__()
        self.waits: list[tuple[float, float]] = []

    def waited(self, host: str, model: str, priced: float, actual: float) -> None:
        self.waits.append((priced, actual))
        super().waited(host, model, priced, actual)


class TwinGateway:
    """One gateway process over twin hosts, on the running `VirtualLoop`: `model` is the
    route's default; `serves` says, per host, each model crossbar serves there and the name
    the host knows it by (by default, `model` under its own name on every host). `clients`:
    the enabled client keys, by the name of the workload's client that presents each (none:
    keys are not in use, every request is the one anonymous key). With `by_client`, the
    tally counts each client's rows (`Tally.clients`)."""

    def __init__(
        self,
        hosts: Mapping[str, TwinServer],
        model: str,
        patience: float | None,
        *,
        queue_max: int,
        queue_timeout: float = 300.0,
        poll_interval: float = 5.0,
        seed: int = 0,
        name_slots: bool = True,
        serves: Mapping[str, Mapping[str, str]] | None = None,
        clients: Mapping[str, ClientSpec] | None = None,
        by_client: bool = False,
    ) -> None:
        self.hosts = hosts
        self.model = model
        self.poll_interval = poll_interval
        # Each conversation's client, by its fingerprint: whose a row without a key is.
        self._client_of: dict[str, str] | None = {} if by_client else None
        self.tally = Tally(by_model=serves is not None, clients=self._client_of)
        # The key each client presents, as a client would send it (`Authorization: Bearer`).
        self._keys = {client: f"twin-key-{client}" for client in clients or {}}
        self._polls = random.Random(seed)
        # Each router's polls, a poll interval apart from a phase of its own.
        phases = random.Random(f"{seed}/router-polls")
        self._phases = {
            name: phases.uniform(0, poll_interval)
            for name, host in hosts.items()
            if isinstance(host, RouterHost)
        }
        self._next_poll: dict[str, float] = {}
        use_recorder(cast(Any, self.tally))
        self._serves = serves or {name: {model: model} for name in hosts}
        # What the gateway is told of its hosts' --slot-prompt-similarity (one preset a fleet).
        profile = next(iter(hosts.values())).profile
        settings.CROSSBAR["SLOT_PROMPT_SIMILARITY"] = profile.similarity
        settings.CROSSBAR["NAME_SLOTS"] = name_slots
        config = FleetConfig(
            hosts={
                name: HostConfig(
                    name, f"http://{name}.twin", 1.0, True, False, "",
                    {served: ModelConfig(served, upstream, host.profile.slots, queue_max)
                     for served, upstream in self._serves[name].items()},
                )
                for name, host in hosts.items()
            },
            routes={
                ROUTE: RouteConfig(
                    ROUTE, model, LEASE_TTL, False, True, tuple(hosts),
                    queue_timeout=queue_timeout, lease_patience=patience,
                )
            },
            clients={hash_key(self._keys[name]): spec for name, spec in (clients or {}).items()},
            revision=1,
        )  # fmt: skip
        self.route = config.routes[ROUTE]
        self.learnt = WatchedFigures()
        self.runtime = Runtime(config, signals.config_generation(), self.learnt)
        self.runtime.probe_down = self._probe_down  # type: ignore[method-assign]  # the twin's poller
        for name, host in hosts.items():
            if isinstance(host, RouterHost):
                host.on_change = self._model_changed
            self._polled(name)

    async def aclose(self) -> None:
        use_recorder(None)
        if self.runtime.models is not None:
            await self.runtime.models.aclose()
        await self.runtime.client.aclose()

    async def place_no_models(self) -> None:
        """No model actor: the layouts whose models stay where they are, or load themselves."""
        if self.runtime.models is not None:
            await self.runtime.models.aclose()
            self.runtime.models = None

    # -- a request ------------------------------------------------------------------------

    async def ask(self, twin_ask: TwinAsk, client: str = "") -> Outcome:
        """One request of `client`, from its route to its row; how it ended. The request
        presents `client`'s key when it has one, and the view's own access check finds its
        client and share from it."""
        payload: dict[str, object] = {"messages": twin_ask.messages}
        ask = Ask(
            request=cast(Any, twin_ask), path=PATH, kind=Kind.GENERATE, body=b"",
            payload=payload, model=twin_ask.model or self.model,
            fingerprint=fingerprint("POST", payload, None), prefix=prefix_blocks(payload),
        )  # fmt: skip
        if self._client_of is not None:
            self._client_of[ask.fingerprint] = client
        life = Lifecycle(forward=self._forward)
        life.routed(self.runtime, self.route)
        try:
            caller = await check_access(
                self._request(client), self.runtime.clients, self.route, GENERATE, PATH
            )
            await life.admit(caller.client)
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
        except NotLoaded as refused:  # the host's own 400, passed through to the client
            life.host_done()
            outcome = Outcome(400, str(refused), "model_not_loaded")
        else:
            life.host_done()
            usage = Usage(job.tokens, job.cache_n, job.max_tokens)
            outcome = Outcome(200, usage=usage, prompt_ms=job.prompt_ms)
        life.end(outcome)
        return outcome

    def _request(self, client: str) -> HttpRequest:
        """The request's HTTP side as the view reads it for access: its key, if any."""
        request = HttpRequest()
        request.method = "POST"
        key = self._keys.get(client)
        if key is not None:
            request.META["HTTP_AUTHORIZATION"] = f"Bearer {key}"
        return request

    async def _forward(
        self, runtime: Runtime, ask: Ask, model: str | None, host: str, id_slot: int | None
    ) -> httpx.Response:
        twin_ask = cast(TwinAsk, ask.request)
        twin = self.hosts[host]
        asked = (twin_ask.prompt, twin_ask.max_tokens, id_slot, twin_ask.answer)
        try:
            if isinstance(twin, RouterHost):
                job = await twin.start(self._serves[host][model or self.model], *asked)
            else:
                job = twin.start(*asked)
            await job.first_token
        except NotLoaded as exc:
            return cast(httpx.Response, TwinAnswer(_Unserved(exc)))
        except (Refused, Cut) as exc:
            if isinstance(exc, Refused):
                await asyncio.sleep(REFUSED_AFTER)  # a refusal takes a round trip
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

    def _model_changed(self, name: str) -> None:
        """A router's model was loaded, began loading or was unloaded: its next poll (the real
        poller reads a router's `/v1/models` every round) finds it."""
        loop = asyncio.get_running_loop()
        phase, now = self._phases[name], loop.time()
        at = phase + (math.floor((now - phase) / self.poll_interval) + 1) * self.poll_interval
        if self._next_poll.get(name) != at:
            self._next_poll[name] = at
            loop.call_at(at, self._polled, name)

    def poll_now(self, name: str) -> None:
        """The host as a poll finds it, now: what an actor that changed it tells the gateway."""
        self._polled(name)

    def loaded_on(self, model: str) -> list[str]:
        """The hosts the gateway believes hold `model` (its own name) loaded."""
        return [
            name for name, served in self._serves.items()
            if (upstream := served.get(model)) is not None
            and (described := self.runtime.health.get(name).described) is not None
            and described.models.get(upstream) is ModelState.LOADED
        ]  # fmt: skip

    def _polled(self, name: str) -> None:
        twin = self.hosts[name]
        health = self.runtime.health
        if not twin.up:
            health.mark_down(name, "connection refused")
        elif isinstance(twin, RouterHost):
            profile = twin.profile
            described = Described(
                router=True, max_models=profile.models_max, autoload=twin.autoload,
                models={model: twin.state(model) for model in profile.models},
            )  # fmt: skip
            health.set(name, HostState.UP, loaded=described.loaded, described=described)
        else:
            described = Described(slots=len(twin.slots))
            health.set(name, HostState.UP, loaded=None, described=described)

    async def _probe_down(self, route: RouteConfig) -> None:
        for name in route.hosts:
            if name in self.hosts and not self.runtime.health.eligible(name):
                self._polled(name)
