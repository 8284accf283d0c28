"""The relay on its own, without a server: built as a request's lifecycle builds it on a stand-in
runtime, its ends recorded by `Ends`."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import httpx

from routing.core.patience import Figures
from routing.proxy.lifecycle import Answered, Lifecycle
from routing.proxy.record import Arrival, Outcome, Trail
from routing.proxy.relay import Relay
from routing.runtime import Runtime


class Ends:
    """Stands in for the request's record: keeps what each request was finished with."""

    def __init__(self) -> None:
        self.finished: list[tuple[object, ...]] = []

    def __call__(self, trail: Trail, outcome: Outcome) -> None:
        self.finished.append((outcome.status, outcome.error, outcome.code, outcome.usage))


def relayed(response: httpx.Response, slot: object | None = None, idle: float = 5.0) -> Relay:
    """The relay of `response` as the lifecycle of a request on host gpu1 holding `slot` builds
    it, on a stand-in runtime (its idle timeout and the hosts' figures are all that is read)."""
    trail = Trail(Arrival(), host="gpu1")
    runtime = SimpleNamespace(stream_idle_timeout=idle, figures=Figures())
    life = Lifecycle(trail, cast(Runtime, runtime))
    placement = SimpleNamespace(slot=slot) if slot is not None else None
    life.answered(Answered(response, cast(Any, placement), trail))
    return life.relay()
