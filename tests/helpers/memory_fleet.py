"""Placement's fleet over plain dicts: `MemoryFleet` is the `routing.core.placement.Fleet`
protocol with a real `Limiter` and a real `LeaseTable`, and no Django; `Route` is a route as
placement reads it, `host` a host as a plain dict."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from routing.core.choose import Candidate
from routing.core.leases import LeaseKey, LeaseTable
from routing.core.limiter import Limiter, Slot
from routing.core.pairs import Pair
from routing.core.placement import Placement, Placer
from routing.core.prefixes import PrefixIndex
from routing.core.ranking import Ranking, Rankings
from routing.core.state import LocalState

MODEL = "llama3"
SHORT = 0.05  # seconds: patience, fallback_after or queue_timeout when a test needs it to pass
LONG = 300.0  # seconds: a deadline no test reaches
WAIT = 10.0  # seconds a test waits for an outcome before failing (a busy machine is slow)
# asyncio may run a timer up to its clock's resolution early: "after the deadline" allows that.
EARLY = 1e-3


@dataclass(slots=True, frozen=True)
class Route:
    """A route as placement reads it (`RouteRules`); every deadline is long unless changed."""

    name: str = "chat"
    hosts: tuple[str, ...] = ("gpu1", "gpu2")
    lease_ttl: float = 60.0
    strict: bool = False
    queue_timeout: float = LONG
    lease_patience: float | None = LONG  # None: auto (tests/core/test_priced_patience.py)
    fallback: str = ""
    fallback_after: float = LONG
    fallback_model: str = ""


def host(
    parallel: int = 1,
    queue_max: int = 0,
    *,
    model: str = MODEL,
    healthy: bool = True,
    draining: bool = False,
    weight: float = 1.0,
) -> dict[str, Any]:
    """A host as a plain dict: its state, and the one model it serves with its limits."""
    return {
        "healthy": healthy,
        "draining": draining,
        "weight": weight,
        "models": {model: {"parallel": parallel, "queue_max": queue_max}},
    }


class MemoryFleet:
    """`routing.core.placement.Fleet` over plain dicts: hosts by name, routes by name.

    Its rankings are kept as the runtime keeps them (routing/core/ranking.py): the limiter and
    the lease table touch a host whose counts change, and a change of a host's dict must go
    through `mark` or `set_host` (as the runtime's health table and reloads touch it)."""

    def __init__(self, hosts: dict[str, dict[str, Any]], *routes: Route) -> None:
        self.rankings = Rankings(self.candidate)
        self.limiter = Limiter(on_change=self.rankings.touch)
        self.leases = LeaseTable(on_change=self.rankings.touch)
        self.state = LocalState(self.limiter, self.leases)
        self.prefixes = PrefixIndex(10_000)
        self.prefix_margin = 1
        self.hosts = hosts
        self.routes = {route.name: route for route in routes}
        for name, spec in hosts.items():
            for model, limits in spec["models"].items():
                self.limiter.configure(name, model, limits["parallel"], limits["queue_max"])

    def candidate(self, name: str, model: str | None) -> Candidate | None:
        spec = self.hosts.get(name)
        if spec is None:
            return None
        serves = model in spec["models"]
        state = self.state
        return Candidate(
            host=name,
            healthy=spec["healthy"],
            draining=spec["draining"],
            loaded=serves,
            can_serve=serves,
            free=state.free_for(name, model) if serves and model is not None else 0,
            queued=state.queued(name, model) if model is not None else 0,
            weight=spec["weight"],
            leases=state.leases_held(name),
        )

    def candidates(self, route: Route, model: str) -> list[Candidate]:
        """The route's hosts from scratch: `choose.ranked` of these is what `ranking` keeps."""
        return [c for name in route.hosts if (c := self.candidate(name, model)) is not None]

    def ranking(self, route: Route, model: str) -> Ranking:
        self.state.expire_leases()
        return self.rankings.of(route.name, route.hosts, model)

    def usable(self, route: Route, model: str, host: str) -> bool:
        spec = self.hosts.get(host)
        return (
            spec is not None
            and host in route.hosts
            and spec["healthy"]
            and not spec["draining"]
            and model in spec["models"]
        )

    def serves(self, route: Route, model: str) -> bool:
        """Whether a host of `route` lists `model` (as `LiveFleet.serves`)."""
        return any(
            model in self.hosts[name]["models"] for name in route.hosts if name in self.hosts
        )

    def fallback_of(self, route: Route) -> Route | None:
        return self.routes.get(route.fallback) if route.fallback else None

    def mark(self, name: str, **state: Any) -> None:
        """Change a host's state, as a health answer or a reload changes it (the rankings
        hear of it)."""
        self.hosts[name].update(state)
        self.rankings.touch(name)

    def set_host(self, name: str, **state: Any) -> None:
        """`mark`; then offer its slots again through the fleet's state, as the runtime's
        health table does (so `LocalState.wake` is on the tested path too)."""
        self.mark(name, **state)
        self.state.wake(name)

    def occupy(self, name: str, model: str = MODEL) -> Slot:
        """Hold one slot of the host from outside placement (another client's request)."""
        got = self.limiter.place([Pair(name, model)])
        assert isinstance(got, Slot), f"{name} has no free slot for {model}"
        return got


def placer(
    fleet: MemoryFleet,
    route: Route,
    fingerprint: str = "conversation",
    prompt: tuple[int, ...] = (),
) -> Placer:
    return Placer(fleet, route, MODEL, fingerprint, asyncio.get_running_loop().time(), prompt)


async def placed(
    fleet: MemoryFleet,
    route: Route,
    fingerprint: str = "conversation",
    prompt: tuple[int, ...] = (),
) -> Placement:
    got = await placer(fleet, route, fingerprint, prompt).now()
    assert isinstance(got, Placement), f"expected a slot at once, got {got!r}"
    return got


def lease_of(fleet: MemoryFleet, route: Route, fingerprint: str = "conversation") -> str | None:
    return fleet.leases.find(LeaseKey(route.name, fingerprint, MODEL))


async def settle(rounds: int = 5) -> None:
    for _ in range(rounds):
        await asyncio.sleep(0)


def assert_nothing_held(fleet: MemoryFleet) -> None:
    """No slot held, nobody queued, and no waiter left behind that a free slot would go to."""
    snapshot = fleet.limiter.snapshot()
    assert [(s.host, s.model, s.in_flight, s.queued) for s in snapshot] == [
        (s.host, s.model, 0, 0) for s in snapshot
    ]
    for snap in snapshot:
        # Every slot can be taken and given back; a forgotten waiter would be handed one.
        slots = [fleet.occupy(snap.host, snap.model) for _ in range(snap.parallel)]
        for slot in slots:
            slot.release()
        assert fleet.limiter.in_flight(snap.host, snap.model) == 0, snap
