"""A second gateway process for the tests: takes one slot (or one client-key admission) in
Redis, says so, and holds it until it is killed.

`python -m tests.shared.holder URL HOLD_TTL slot HOST MODEL` or `... client NAME`.
"""

from __future__ import annotations

import asyncio
import sys

from routing.core.clients import ClientSpec
from routing.core.pairs import Pair
from routing.shared.clients import RedisClients
from routing.shared.grants import Grant
from routing.shared.slots import RedisSlots
from routing.shared.state import Shared


async def main(url: str, hold_ttl: float, what: str, *names: str) -> None:
    shared = Shared(url, hold_ttl=hold_ttl)
    await shared.start()
    if what == "slot":
        slots = RedisSlots(shared)
        await slots.start()
        host, model = names
        await slots.configure(host, model, parallel=1, queue_max=4)
        grant = await slots.place([Pair(host, model)])
        print("held" if isinstance(grant, Grant) else f"not held: {grant!r}", flush=True)
    else:
        clients = RedisClients(shared)
        await clients.admit(ClientSpec(names[0], max_concurrent=1), "chat")
        print("held", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], float(sys.argv[2]), sys.argv[3], *sys.argv[4:]))
