"""Each (host, model) pair's limits as this process configures them, and their way to Redis.

Every process configures the pairs of its own configuration; Redis keeps one record per pair
(`parallel`, `queue_max`), which the last process to send it set. A configuration is
remembered here first, so that places can be asked for at once, and sent after: at once when
Redis answers, else at the next tick (`send_unsent`), and again, whole, whenever Redis lost it
(the restore path reads `flat`). A renamed host's pairs move in Redis by the RENAME script.

Use it on one event loop; it is not thread-safe.
"""

from __future__ import annotations

from collections.abc import Iterable

from routing.core.pairs import Pair
from routing.shared import slots_lua as lua
from routing.shared.grants import pair_id, split_pair
from routing.shared.holdings import Holdings
from routing.shared.state import Shared, StateUnavailable
from routing.shared.tasks import Tasks

__all__ = ["SlotLimits"]


class SlotLimits:
    """The limits of the pairs this process configures, by pair id.

    `parallel` below 1 counts as 1 and a negative `queue_max` as 0, as in the in-process
    limiter. A call that cannot reach Redis leaves its pair unsent, for the next tick.
    """

    def __init__(self, shared: Shared, book: Holdings, tasks: Tasks) -> None:
        self._book = book
        self._tasks = tasks
        self._configure = shared.script(lua.CONFIGURE)
        self._remove = shared.script(lua.REMOVE)
        self._rename = shared.script(lua.RENAME)
        self._configs: dict[str, tuple[int, int]] = {}
        self._unsent: set[str] = set()  # configure/remove calls Redis did not get

    async def configure(self, host: str, model: str, parallel: int, queue_max: int) -> None:
        """Remember the pair's limits and send them. Raises StateUnavailable (then they are
        sent at the next tick), ValueError for a host name that is empty or holds '/'."""
        await self._send(self._remember(host, model, parallel, queue_max))

    async def remove(self, host: str, model: str) -> None:
        """Forget the pair and tell Redis. Raises StateUnavailable (sent at the next tick)."""
        await self._send(self._forget(host, model))

    def configure_soon(self, host: str, model: str, parallel: int, queue_max: int) -> None:
        """`configure` from synchronous code: remembered now, sent in a task of its own."""
        self._send_soon(self._remember(host, model, parallel, queue_max))

    def remove_soon(self, host: str, model: str) -> None:
        """`remove` from synchronous code."""
        self._send_soon(self._forget(host, model))

    def rename_soon(self, old: str, new: str) -> None:
        """The pairs of host `old` are `new`'s: forgotten here under `old`, and their records
        and slots moved in Redis (the RENAME script, in tasks of their own; when Redis is
        away, the book is marked unsure: the releases find the slots either way)."""
        for pair in [pair for pair in self._configs if split_pair(pair)[0] == old]:
            del self._configs[pair]
            self._tasks.spawn(self._send_rename(pair, pair_id(new, split_pair(pair)[1])))

    def known(self, pairs: Iterable[Pair]) -> list[str]:
        """The ids of `pairs`, each once, in order. Raises ValueError for a pair not
        configured here."""
        ids = []
        for host, model in pairs:
            pair = pair_id(host, model)
            if pair not in self._configs:
                raise ValueError(f"{pair} is not configured")
            if pair not in ids:
                ids.append(pair)
        return ids

    def of_model(self, model: str) -> list[str]:
        """The ids of the configured pairs that serve `model`."""
        return [pair for pair in self._configs if split_pair(pair)[1] == model]

    def flat(self) -> list[str | int]:
        """Every configured pair as (pair id, parallel, queue_max), flattened (RESTORE's
        arguments)."""
        return [value for pair, (p, q) in self._configs.items() for value in (pair, p, q)]

    def all_sent(self) -> None:
        """Redis has every configuration now (the restore path sent them all)."""
        self._unsent.clear()

    async def send_unsent(self) -> None:
        """Send what Redis did not get. Raises StateUnavailable (the rest stays unsent)."""
        for pair in list(self._unsent):
            await self._send(pair)

    def _remember(self, host: str, model: str, parallel: int, queue_max: int) -> str:
        if not host or "/" in host:
            raise ValueError(f"a host name must be non-empty and without '/': {host!r}")
        pair = pair_id(host, model)
        self._configs[pair] = (max(1, parallel), max(0, queue_max))
        return pair

    def _forget(self, host: str, model: str) -> str:
        pair = pair_id(host, model)
        self._configs.pop(pair, None)
        return pair

    def _send_soon(self, pair: str) -> None:
        self._unsent.add(pair)

        async def send() -> None:
            try:
                await self._send(pair)
            except StateUnavailable:
                pass  # still unsent: the next tick that reaches Redis sends it

        self._tasks.spawn(send())

    async def _send(self, pair: str) -> None:
        self._unsent.add(pair)
        limits = self._configs.get(pair)
        if limits is None:
            await self._remove(pair)
        else:
            await self._configure(pair, *limits)
        self._unsent.discard(pair)

    async def _send_rename(self, pair: str, target: str) -> None:
        try:
            await self._rename(pair, target)
        except StateUnavailable:
            self._book.unsure()
