"""Placement under cancellation, step by step on one event loop: a request whose client leaves
in the very loop turn its slot is granted must give that slot back (found by the soak)."""

from __future__ import annotations

import asyncio

import pytest

from routing.config.shape import Fleet, HostConfig, ModelConfig, RouteConfig
from routing.core.placement import Placer
from routing.runtime import Runtime

MODEL = "test-model"


def one_host_fleet(parallel: int, queue_max: int) -> Fleet:
    host = HostConfig(
        name="gpu1",
        url="http://127.0.0.1:9",
        weight=1.0,
        enabled=True,
        draining=False,
        api_key="",
        models={MODEL: ModelConfig(MODEL, "", parallel, queue_max)},
    )
    route = RouteConfig(
        name="chat", default_model="", lease_ttl=60.0, strict=False, enabled=True, hosts=("gpu1",)
    )
    return Fleet(hosts={"gpu1": host}, routes={"chat": route}, revision=1)


async def test_a_wait_cancelled_in_the_turn_its_slot_is_granted_gives_the_slot_back():
    runtime = Runtime(one_host_fleet(parallel=1, queue_max=1), generation=0)
    try:
        route = runtime.fleet.routes["chat"]
        holder = await runtime.limiter.acquire("gpu1", MODEL)
        placer = Placer(runtime, route, MODEL, "fingerprint")
        assert await placer.now() is None
        waiting = asyncio.create_task(placer.wait())
        await placer.queued()

        holder.release()  # hands the slot to the waiter
        await asyncio.sleep(0)  # the acquire finishes; the wait has not seen it yet
        waiting.cancel()  # the client leaves in that very turn
        with pytest.raises(asyncio.CancelledError):
            await waiting

        assert runtime.limiter.in_flight("gpu1", MODEL) == 0
        assert runtime.limiter.queued("gpu1", MODEL) == 0
    finally:
        await runtime.aclose()
