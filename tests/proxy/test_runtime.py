"""The live runtime: built from the database, reloaded on edits, state kept across reloads."""

from __future__ import annotations

import asyncio

import pytest
from asgiref.sync import sync_to_async

from hosts.models import Host, HostModel
from routing.core.limiter import Slot, Waiter
from routing.core.pairs import Pair
from routing.core.placement import Placement, Placer, Waiting
from routing.core.state import LocalState
from routing.runtime import Runtime, close_runtime, get_runtime
from tests.helpers.fleet import MODEL, add_host, add_route

pytestmark = pytest.mark.django_db(transaction=True)


def local(runtime: Runtime) -> LocalState:
    """The runtime's own limiter and lease table (no CROSSBAR_REDIS_URL here)."""
    assert isinstance(runtime.state, LocalState)
    return runtime.state


@sync_to_async
def set_parallel(host: str, parallel: int) -> None:
    model = HostModel.objects.get(host__name=host, name=MODEL)
    model.parallel = parallel
    model.save()


async def place(runtime: Runtime, fingerprint: str) -> tuple[str, str]:
    """Place one request of route chat at once; its host and lease outcome (slot given back)."""
    placer = Placer(
        runtime.live, runtime.fleet.routes["chat"], MODEL, fingerprint, runtime.loop.time()
    )
    placement = await placer.now()
    assert isinstance(placement, Placement)
    placement.slot.release()
    return placement.host, str(placement.lease)


async def test_an_edit_in_the_orm_reaches_the_running_gateway_with_slots_kept(runtime):
    gpu1 = await sync_to_async(add_host)("gpu1", "http://127.0.0.1:9", models={MODEL: (2, 4)})
    await sync_to_async(add_route)("chat", [gpu1])
    await runtime.refresh()
    held = [local(runtime).limiter.place([Pair("gpu1", MODEL)]) for _ in range(2)]
    waiter = local(runtime).limiter.place([Pair("gpu1", MODEL)])
    assert isinstance(waiter, Waiter)
    assert local(runtime).limiter.queued("gpu1", MODEL) == 1

    await set_parallel("gpu1", 3)
    await runtime.refresh()
    granted = await asyncio.wait_for(waiter.granted, 2)

    # two kept, the waiter granted at once
    assert local(runtime).limiter.in_flight("gpu1", MODEL) == 3
    await set_parallel("gpu1", 1)
    await runtime.refresh()
    for slot in held:
        assert isinstance(slot, Slot)
        slot.release()
    # one still held, and the limit is 1
    assert local(runtime).limiter.free_for("gpu1", MODEL) == 0
    granted.release()
    assert local(runtime).limiter.free_for("gpu1", MODEL) == 1


async def test_a_deleted_host_loses_its_leases_and_others_keep_theirs(runtime):
    gpu1 = await sync_to_async(add_host)("gpu1", "http://127.0.0.1:9")
    gpu2 = await sync_to_async(add_host)("gpu2", "http://127.0.0.1:10")
    await sync_to_async(add_route)("chat", [gpu1, gpu2])
    await runtime.refresh()
    first = await place(runtime, "a" * 64)
    second = await place(runtime, "b" * 64)
    assert {first, second} == {("gpu1", "new"), ("gpu2", "new")}  # fewer leases wins a tie
    on_gpu1 = "a" * 64 if first[0] == "gpu1" else "b" * 64

    await sync_to_async(Host.objects.filter(name="gpu1").delete)()
    await runtime.refresh()

    assert await place(runtime, on_gpu1) == ("gpu2", "new")
    assert local(runtime).leases.held_by_host() == {"gpu2": 2}


async def test_draining_a_host_stops_new_leases_at_once(runtime):
    gpu1 = await sync_to_async(add_host)("gpu1", "http://127.0.0.1:9")
    gpu2 = await sync_to_async(add_host)("gpu2", "http://127.0.0.1:10")
    await sync_to_async(add_route)("chat", [gpu1, gpu2])
    await runtime.refresh()

    gpu1.draining = True
    await sync_to_async(gpu1.save)()
    await runtime.refresh()
    hosts = {(await place(runtime, f"{i:064x}"))[0] for i in range(5)}

    assert hosts == {"gpu2"}


async def test_a_request_waiting_for_a_drained_host_takes_it_once_an_edit_undrains_it(
    runtime, fake
):
    # The route waits (a fallback, far off) while its one host is drained; the undrain comes
    # as an edit, and the reload that applies it must offer the host's slot to the waiter.
    gpu1 = await sync_to_async(add_host)("gpu1", fake.url, draining=True)
    spare = await sync_to_async(add_host)("spare", fake.url)
    fallback = await sync_to_async(add_route)("spare", [spare])
    await sync_to_async(add_route)("chat", [gpu1], fallback=fallback, fallback_after=300.0,
                                   queue_timeout=300.0)  # fmt: skip
    await runtime.refresh()
    placer = Placer(runtime.live, runtime.fleet.routes["chat"], MODEL, "", runtime.loop.time())
    waiting = await placer.now()
    assert isinstance(waiting, Waiting) and waiting.host == ""  # in no line: it watches

    gpu1.draining = False
    await sync_to_async(gpu1.save)()  # as the admin's undrain saves it
    await runtime.refresh()
    placement = await asyncio.wait_for(placer.wait(waiting), 10)

    assert (placement.host, placement.route) == ("gpu1", "chat")
    placement.slot.release()


async def test_each_event_loop_gets_its_own_runtime(runtime):
    other_loop_runtime = await asyncio.to_thread(lambda: asyncio.run(_build_and_close()))

    assert other_loop_runtime is not runtime


async def _build_and_close():
    rt = await get_runtime()
    await close_runtime()
    return rt
