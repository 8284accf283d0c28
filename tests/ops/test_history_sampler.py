"""The history's sampler: each host's load sampled into the rings every second, and the rings
rebuilt once from the rows of the requests before it, on a real `Runtime`."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import pytest
from asgiref.sync import sync_to_async

from accounting.models import Request
from routing.config.shape import FleetConfig, HostConfig, ModelConfig
from routing.core.limiter import Slot, Waiter
from routing.core.pairs import Pair
from routing.ops.history_rings import History
from routing.ops.history_sampler import ensure_sampler, sampling
from routing.runtime import Runtime
from tests.helpers.fleet import MODEL

pytestmark = pytest.mark.django_db(transaction=True)


def _fleet() -> FleetConfig:
    host = HostConfig(
        name="gpu1",
        url="http://127.0.0.1:9",  # never asked: the test takes the slots itself
        weight=1.0,
        enabled=True,
        draining=False,
        api_key="",
        models={MODEL: ModelConfig(MODEL, "", parallel=1, queue_max=2)},
    )
    return FleetConfig(hosts={"gpu1": host}, routes={}, revision=0)


async def until(condition: Callable[[], bool], what: str) -> None:
    """Await until `condition()` holds; fail the test after 10 s."""
    try:
        async with asyncio.timeout(10):
            while True:
                if condition():
                    return
                await asyncio.sleep(0.05)
    except TimeoutError:
        pytest.fail(f"timed out waiting for {what}")


async def test_the_sampler_adds_each_hosts_load_and_the_rows_before_it_to_the_rings(settings):
    settings.CROSSBAR = {**settings.CROSSBAR, "REDIS_URL": ""}  # the local limiter
    await sync_to_async(Request.objects.create)(
        route="sampled", model=MODEL, host="gpu1",
        started=datetime.now(UTC) - timedelta(minutes=10), queued_ms=0, ttfb_ms=80,
        total_ms=3000, status=200,
    )  # fmt: skip
    runtime = Runtime(_fleet(), 0)
    history = History()
    try:
        slot = await runtime.state.place([Pair("gpu1", MODEL)])
        waiters = [await runtime.state.place([Pair("gpu1", MODEL)]) for _ in range(2)]
        assert isinstance(slot, Slot) and all(isinstance(w, Waiter) for w in waiters)

        ensure_sampler(runtime, history)
        ensure_sampler(runtime, history)  # a second caller finds it started

        def sampled() -> bool:
            return history.cards().get("gpu1", {}).get("in_flight") is not None

        await until(sampled, "a sample of gpu1")
        await until(lambda: history.rebuilt, "the rebuild from the rows")
        card = history.cards()["gpu1"]
        # One running, two waiting: a sample that mixes the two up reads (2.0, 1).
        assert (card["in_flight"], card["queued_peak"]) == (1.0, 2)
        hour = history.points("1h")
        assert sum(p["hosts"].get("gpu1", {}).get("requests", 0) for p in hour) == 1
        assert sampling(runtime)
    finally:
        await runtime.aclose()
    await until(lambda: not sampling(runtime), "the sampler to stop with its runtime")
