"""The `loading` wait: a request for a model loaded on no host that may serve it, where a load
would (a router-mode host that loads none on demand), waits for the model actor's load
(routing/models_actor) instead of being refused with `model_not_loaded`.

The first such request starts one load on the best host; the ones that follow for the same
model join it. The wait lasts up to the route's `queue_timeout` (then `queue_timeout`); a load
that fails ends it with the host's own words (`ModelLoadFailed`). Its row says placement
`loaded`, the wait counted in its queued time (`Trail.placed`).

`probing` is what a request finding no usable host does before it is refused: its route's
down hosts asked how they are, then this wait, where a load would serve it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

from routing.core.clock import loop_time as clock
from routing.core.errors import ModelLoadFailed, NoHealthyHost, QueueTimeout

if TYPE_CHECKING:
    from routing.proxy.lifecycle import Lifecycle


def can_load(life: Lifecycle) -> bool:
    """Whether a load would serve the request's model: an actor runs, and may load it on a
    host of the route."""
    actor, model = life.runtime.models, life.ask.model
    return actor is not None and model is not None and actor.can_load(model, life.route.hosts)


T = TypeVar("T")


async def probing(life: Lifecycle, attempt: Callable[[], Awaitable[T]], *, loads: bool = True) -> T:
    """`attempt()`; finding no usable host, again after asking the route's down hosts how they
    are (once each, all at once), then (`loads`) after a load, where one would serve it."""
    try:
        return await attempt()
    except NoHealthyHost:
        await life.runtime.probe_down(life.route)
    try:
        return await attempt()
    except NoHealthyHost:
        if not loads or not await waited_for_load(life):
            raise
    return await attempt()


async def waited_for_load(life: Lifecycle) -> bool:
    """Wait for a load of the request's model; False (at once) when no load would serve it
    (`can_load`). Raises ModelLoadFailed, QueueTimeout."""
    actor, model, route = life.runtime.models, life.ask.model, life.route
    if actor is None or model is None or not can_load(life):
        return False
    started = clock()
    life.trail = life.trail._replace(placement="loaded")
    try:
        async with asyncio.timeout(route.queue_timeout):
            host = await actor.wait_loaded(model)
    except ModelLoadFailed as failed:
        life.trail = life.trail._replace(host=failed.host)
        raise
    except TimeoutError:
        where = actor.loading_on(model)
        life.trail = life.trail._replace(host=where)
        on = f" (loading on {where})" if where else ""
        raise QueueTimeout(
            f"model “{model}” was not loaded within route {route.name}'s queue_timeout of"
            f" {route.queue_timeout:g} s{on}"
        ) from None
    life.trail = life.trail._replace(host=host, load_waited=clock() - started)
    return True
