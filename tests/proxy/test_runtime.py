"""The live runtime: built from the database, reloaded on edits, state kept across reloads."""

from __future__ import annotations

import asyncio

import pytest
from asgiref.sync import sync_to_async

from hosts.models import Host, HostModel
from routing.core.leases import LeaseOutcome
from routing.runtime import close_runtime, get_runtime
from tests.fleet import MODEL, add_host, add_route

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
async def runtime():  # type: ignore[no-untyped-def]
    rt = await get_runtime()
    yield rt
    await close_runtime()


@sync_to_async
def set_parallel(host: str, parallel: int) -> None:
    model = HostModel.objects.get(host__name=host, name=MODEL)
    model.parallel = parallel
    model.save()


async def test_an_edit_in_the_orm_reaches_the_running_gateway_with_slots_kept(runtime):
    gpu1 = await sync_to_async(add_host)("gpu1", "http://127.0.0.1:9", models={MODEL: (2, 4)})
    await sync_to_async(add_route)("chat", [gpu1])
    await runtime.refresh()
    held = [await runtime.limiter.acquire("gpu1", MODEL) for _ in range(2)]
    waiter = asyncio.create_task(runtime.limiter.acquire("gpu1", MODEL))
    await asyncio.sleep(0.05)
    assert runtime.limiter.queued("gpu1", MODEL) == 1

    await set_parallel("gpu1", 3)
    await runtime.refresh()
    granted = await asyncio.wait_for(waiter, 2)

    assert runtime.limiter.in_flight("gpu1", MODEL) == 3  # two kept, the waiter granted at once
    await set_parallel("gpu1", 1)
    await runtime.refresh()
    for slot in held:
        slot.release()
    assert runtime.limiter.free_for("gpu1", MODEL) == 0  # one still held, and the limit is 1
    granted.release()
    assert runtime.limiter.free_for("gpu1", MODEL) == 1


async def test_a_deleted_host_loses_its_leases_and_others_keep_theirs(runtime):
    gpu1 = await sync_to_async(add_host)("gpu1", "http://127.0.0.1:9")
    gpu2 = await sync_to_async(add_host)("gpu2", "http://127.0.0.1:10")
    await sync_to_async(add_route)("chat", [gpu1, gpu2])
    await runtime.refresh()
    route = runtime.fleet.routes["chat"]
    first = await runtime.lease(route, "a" * 64, MODEL)
    second = await runtime.lease(route, "b" * 64, MODEL)
    assert {first[0], second[0]} == {"gpu1"}  # equal scores: route order

    await sync_to_async(Host.objects.filter(name="gpu1").delete)()
    await runtime.refresh()
    moved = await runtime.lease(runtime.fleet.routes["chat"], "a" * 64, MODEL)

    assert moved == ("gpu2", LeaseOutcome.NEW)
    assert runtime.leases.held_by_host() == {"gpu2": 1}


async def test_draining_a_host_stops_new_leases_at_once(runtime):
    gpu1 = await sync_to_async(add_host)("gpu1", "http://127.0.0.1:9")
    gpu2 = await sync_to_async(add_host)("gpu2", "http://127.0.0.1:10")
    await sync_to_async(add_route)("chat", [gpu1, gpu2])
    await runtime.refresh()

    gpu1.draining = True
    await sync_to_async(gpu1.save)()
    await runtime.refresh()
    route = runtime.fleet.routes["chat"]
    hosts = {(await runtime.lease(route, f"{i:064x}", MODEL))[0] for i in range(5)}

    assert hosts == {"gpu2"}


async def test_each_event_loop_gets_its_own_runtime(runtime):
    other_loop_runtime = await asyncio.to_thread(lambda: asyncio.run(_build_and_close()))

    assert other_loop_runtime is not runtime


async def _build_and_close():  # type: ignore[no-untyped-def]
    rt = await get_runtime()
    await close_runtime()
    return rt
