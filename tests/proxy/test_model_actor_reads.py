"""What the model actor reads of the fleet, and when: it acts only on router-mode hosts that
load no model on demand, and a gateway without any must not pass over its whole fleet for
every request (on 2,000 hosts that was most of a request's cost while any line was long:
bench/twin/README.md, "Scale"). A host read anew, or a reload, changes what it acts on at
once."""

from __future__ import annotations

import asyncio

import pytest
from asgiref.sync import sync_to_async

from hosts.describe import Described, ModelState
from hosts.health import HostState
from hosts.models import Host
from routing.core.limiter import Slot, Waiter
from routing.core.pairs import Pair
from routing.core.state import LocalState
from routing.models_actor import actor
from routing.runtime import Runtime
from tests.helpers.fleet import MODEL, add_host, add_route

pytestmark = pytest.mark.django_db(transaction=True)

ROUTER = Described(router=True, autoload=False, models={MODEL: ModelState.UNLOADED})


def drain(name: str) -> None:
    host = Host.objects.get(name=name)
    host.draining = True
    host.save()


async def one_host(runtime: Runtime) -> None:
    gpu1 = await sync_to_async(add_host)("gpu1", "http://127.0.0.1:9", models={MODEL: (1, 4)})
    await sync_to_async(add_route)("chat", [gpu1])
    await runtime.refresh()


async def test_requests_arriving_while_one_waits_set_off_no_model_decision_without_routers(
    runtime, monkeypatch
):
    await one_host(runtime)
    await asyncio.sleep(0)  # the decision the reload set off
    decided: list[object] = []

    def decide(snapshot: object, now: float) -> list[object]:
        decided.append(snapshot)
        return []

    monkeypatch.setattr(actor, "decide", decide)
    state = runtime.state
    assert isinstance(state, LocalState)
    held = state.limiter.place([Pair("gpu1", MODEL)])
    assert isinstance(held, Slot)
    waiting = state.limiter.place([Pair("gpu1", MODEL)])
    assert isinstance(waiting, Waiter)  # a line that is not empty

    for _ in range(3):
        runtime.arrived(MODEL)
    await asyncio.sleep(0)  # a decision set off runs at the loop's next turn

    assert decided == []
    waiting.cancel()
    held.release()


async def test_a_host_read_anew_as_a_router_that_loads_none_on_demand_is_one_a_load_may_use(
    runtime,
):
    await one_host(runtime)
    assert runtime.models is not None
    assert not runtime.models.can_load(MODEL, ["gpu1"])  # a host not read yet: none

    runtime.health.set("gpu1", HostState.UP, described=ROUTER)

    assert runtime.models.can_load(MODEL, ["gpu1"])


async def test_a_router_drained_by_the_operator_is_one_a_load_may_no_longer_use(runtime):
    await one_host(runtime)
    assert runtime.models is not None
    runtime.health.set("gpu1", HostState.UP, described=ROUTER)
    assert runtime.models.can_load(MODEL, ["gpu1"])

    await sync_to_async(drain)("gpu1")
    await runtime.refresh()

    assert not runtime.models.can_load(MODEL, ["gpu1"])
