"""The twin's llama-server in router mode (bench/twin/router.py) loads, unloads and waits as
llama-server's router does (tools/server/server-models.cpp), in virtual time."""

from __future__ import annotations

import asyncio

import pytest
from twin.clock import in_virtual_time
from twin.host import Job
from twin.router import LimitReached, NotLoaded, RouterHost
from twin.shapes import HostProfile, ModelProfile, Segment

from hosts.describe import ModelState


def model(name: str, load_s: float, size_gb: float = 5.0) -> ModelProfile:
    return ModelProfile(
        name, size_gb=size_gb, load_s=load_s, prefill_tps=1000.0, decode_tps=(50.0, 40.0),
        restore_tps=100_000.0, kv_bytes_per_token=1024 * 1024,
    )  # fmt: skip


MODELS = {m.name: m for m in (model("a", 4.0), model("b", 2.0), model("c", 3.0))}
ROUTER = HostProfile("router", slots=2, cache_ram_mib=10_000, memory_gb=48.0, models_max=2,
                     models=MODELS)  # fmt: skip
PROMPT = (Segment(1, 500),)


def made(number: int, tokens: int = 10) -> Segment:
    return Segment(-number, tokens)


async def served(host: RouterHost, name: str, number: int, tokens: int = 10) -> Job:
    job = await host.start(name, PROMPT, tokens, None, made(number, tokens))
    await job.done
    return job


def test_a_router_loads_a_model_on_the_first_request_for_it_and_the_request_waits_for_it() -> None:
    async def main() -> tuple[float, float, ModelState, ModelState]:
        loop = asyncio.get_running_loop()
        host = RouterHost("h", ROUTER)
        before = host.state("a")
        job = await host.start("a", PROMPT, 10, None, made(1))
        await job.first_token
        return job.arrived, loop.time(), before, host.state("a")

    arrived, first_token, before, after = in_virtual_time(main())
    assert (before, after) == (ModelState.UNLOADED, ModelState.LOADED)
    assert arrived == pytest.approx(4.0)  # the child took it once the 4 s load was over
    assert first_token == pytest.approx(4.0 + 0.5)  # then its 500-token prompt


def test_requests_for_a_model_being_loaded_share_one_load() -> None:
    async def main() -> RouterHost:
        host = RouterHost("h", ROUTER)
        await asyncio.gather(served(host, "a", 1), served(host, "a", 2), served(host, "a", 3))
        return host

    host = in_virtual_time(main())
    assert host.loads == {"a": 1}
    assert host.loading_s == {"a": 4.0}


def test_requests_waiting_for_room_for_the_same_model_make_room_for_one_model() -> None:
    """llama-server's line holds one entry a model: three requests for c, waiting while a and
    b are busy, need one model's room, so b stays loaded once its own request ends."""

    async def main() -> RouterHost:
        host = RouterHost("h", ROUTER, loaded=("a", "b"))
        busy = [await host.start(name, PROMPT, tokens, None, made(n, tokens))
                for n, (name, tokens) in enumerate((("a", 50), ("b", 200)))]  # fmt: skip
        await asyncio.gather(*(served(host, "c", n) for n in range(3, 6)))
        await asyncio.gather(*(job.done for job in busy))
        return host

    host = in_virtual_time(main())
    assert host.loads == {"c": 1}
    assert {name: host.state(name) for name in MODELS} == {
        "a": ModelState.UNLOADED, "b": ModelState.LOADED, "c": ModelState.LOADED,
    }  # fmt: skip


def test_past_models_max_a_router_unloads_its_least_recently_used_idle_model() -> None:
    async def main() -> RouterHost:
        host = RouterHost("h", ROUTER)
        await served(host, "a", 1)
        await served(host, "b", 2)
        await served(host, "a", 3)  # b is now the least recently used
        await served(host, "c", 4)
        return host

    host = in_virtual_time(main())
    states = {name: host.state(name) for name in MODELS}
    assert states == {"a": ModelState.LOADED, "b": ModelState.UNLOADED, "c": ModelState.LOADED}
    assert host.loads == {"a": 1, "b": 1, "c": 1}


def test_a_busy_model_is_not_unloaded_the_request_waits_until_its_last_request_ends() -> None:
    """llama-server's `tick`: "all remaining models are busy, wait for a request to end"; the
    model whose last request ends is then the one unloaded."""

    async def main() -> tuple[float, float, dict[str, ModelState]]:
        loop = asyncio.get_running_loop()
        host = RouterHost("h", ROUTER)
        await served(host, "b", 1)  # b: the least recently used, soon busy again
        await served(host, "a", 2)
        long_b = await host.start("b", PROMPT, 500, None, made(3, 500))
        long_a = await host.start("a", PROMPT, 100, None, made(4, 100))
        waiting = asyncio.ensure_future(host.start("c", PROMPT, 10, None, made(5)))
        await long_a.done  # a's only request ends first: a goes, though b was used before it
        a_ended = loop.time()
        states = {name: host.state(name) for name in MODELS}
        job = await waiting
        assert not long_b.done.done()  # b ran on, untouched
        return a_ended, job.arrived, states

    a_ended, c_started, states = in_virtual_time(main())
    assert states == {"a": ModelState.UNLOADED, "b": ModelState.LOADED, "c": ModelState.LOADING}
    assert c_started == pytest.approx(a_ended + 3.0)  # c's load began when a's request ended


def test_with_autoload_off_a_request_for_a_model_not_loaded_is_refused() -> None:
    async def main() -> None:
        host = RouterHost("h", ROUTER, autoload=False, loaded=("a",))
        await served(host, "a", 1)
        with pytest.raises(NotLoaded):
            await host.start("b", PROMPT, 10, None, made(2))

    in_virtual_time(main())


def test_a_load_by_hand_with_every_loaded_model_busy_fails_for_want_of_room() -> None:
    async def main() -> None:
        host = RouterHost("h", ROUTER, loaded=("a", "b"))
        running = [await host.start(name, PROMPT, 100, None, made(n)) for n, name in
                   enumerate(("a", "b"))]  # fmt: skip
        with pytest.raises(LimitReached):
            host.load("c")
        await asyncio.gather(*(job.done for job in running))
        host.load("c")  # now a (the least recently used, idle) makes room
        assert host.state("a") is ModelState.UNLOADED

    in_virtual_time(main())


def test_models_that_do_not_fit_in_memory_are_not_loaded_together() -> None:
    big = {m.name: m for m in (model("a", 1.0, 30.0), model("b", 1.0, 30.0))}
    profile = HostProfile("big", slots=2, cache_ram_mib=0, memory_gb=48.0, models_max=2,
                          models=big)  # fmt: skip

    async def main() -> dict[str, ModelState]:
        host = RouterHost("h", profile)
        await served(host, "a", 1)
        await served(host, "b", 2)
        return {name: host.state(name) for name in big}

    assert in_virtual_time(main()) == {"a": ModelState.UNLOADED, "b": ModelState.LOADED}
