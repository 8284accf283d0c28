"""A second gateway process for the tests: takes one slot in Redis, says so, and holds it
until it is killed. `python -m tests.shared.holder URL HOST MODEL HOLD_TTL`."""

from __future__ import annotations

import asyncio
import sys

from routing.shared.slots import Grant, RedisSlots
from routing.shared.state import Shared


async def main(url: str, host: str, model: str, hold_ttl: float) -> None:
    shared = Shared(url, hold_ttl=hold_ttl)
    slots = RedisSlots(shared)
    await shared.start()
    await slots.start()
    await slots.configure(host, model, parallel=1, queue_max=4)
    grant = await slots.place([(host, model)])
    print("held" if isinstance(grant, Grant) else f"not held: {grant!r}", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])))
