"""Client keys' limits counted across every gateway process, in Redis.

The same limits as `ClientGate.admit` (routing/core/clients.py), over the whole fleet of
gateways: `max_concurrent` requests from admit to release, and `per_minute` admitted in any
sliding 60 seconds (exact: the admission times of the last `per_minute` are kept, on Redis's
clock). Identifying the key stays in `ClientGate.identify`, which needs no shared state.
`admit` and a pass's release are one round trip each.

Token budgets (routing/core/budgets.py) are one ledger for every process: `P budget:<name>:
<period>` (the tokens spent in the UTC day "2026-12-06" or month "2026-12", expiring a day past
the period's end), added to by a pass's release, read by `admit` before the other limits, and
seeded from the rows when a gateway starts where Redis has no count yet (`seed`). A key past a
budget is refused on every process from the release that spent it on.

Keys, under the prefix P: `P client:<name>:running` (hash pass id -> process: what is in
flight, at most `max_concurrent` or the requests really running), `P client:<name>:minute`
(sorted set of admission times, at most `per_minute`, expiring a minute after the last), the
budgets' counts, and `P clients` (the names, for the sweep). A process's passes carry its id,
so a killed process's requests stop counting once its liveness key expired
(routing/shared/state.py).
"""

from __future__ import annotations

import asyncio
import itertools
import math
import threading
from collections.abc import Callable, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

from routing.core.budgets import Spend, exhausted, periods
from routing.core.clients import ClientSpec
from routing.core.errors import ClientLimited, RouteNotAllowed
from routing.shared.state import ALIVE, Shared, StateUnavailable

__all__ = ["RedisClientPass", "RedisClients"]

WINDOW_MS = 60_000

_PRELUDE = (
    ALIVE
    + r"""
local function running_key(name) return P .. 'client:' .. name .. ':running' end
local function reclaim(name)
  local run = running_key(name)
  local all = redis.call('HGETALL', run)
  for i = 1, #all, 2 do
    if not alive(all[i + 1]) then redis.call('HDEL', run, all[i]) end
  end
end
"""
)

# ARGV: P, name, pass id, process, max_concurrent (-1: none), per_minute (-1: none), tokens per
# day (-1: none), per month (-1: none), the day's and the month's names.
# Reply: {'ok'} | {'budget', tokens spent in the day, in the month} | {'concurrent'}
# | {'minute', ms until the oldest admission leaves the window}
_ADMIT = (
    _PRELUDE
    + r"""
local name, id = ARGV[2], ARGV[3]
local run = running_key(name)
if redis.call('HEXISTS', run, id) == 1 then return {'ok'} end
local per_day, per_month = tonumber(ARGV[7]), tonumber(ARGV[8])
if per_day >= 0 or per_month >= 0 then
  local day = tonumber(redis.call('GET', P .. 'budget:' .. name .. ':' .. ARGV[9]) or '0')
  local month = tonumber(redis.call('GET', P .. 'budget:' .. name .. ':' .. ARGV[10]) or '0')
  if (per_day >= 0 and day >= per_day) or (per_month >= 0 and month >= per_month) then
    return {'budget', day, month}
  end
end
local most = tonumber(ARGV[5])
if most >= 0 and redis.call('HLEN', run) >= most then
  reclaim(name)
  if redis.call('HLEN', run) >= most then return {'concurrent'} end
end
local per = tonumber(ARGV[6])
if per >= 0 then
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  local minute = P .. 'client:' .. name .. ':minute'
  redis.call('ZREMRANGEBYSCORE', minute, '-inf', now - 60000)
  local count = redis.call('ZCARD', minute)
  if count > per then  -- the limit was lowered: keep the newest
    redis.call('ZREMRANGEBYRANK', minute, 0, count - per - 1)
    count = per
  end
  if count >= per then
    local oldest = redis.call('ZRANGE', minute, 0, 0, 'WITHSCORES')[2]
    return {'minute', oldest and (tonumber(oldest) + 60000 - now) or 60000}
  end
  redis.call('ZADD', minute, now, id)
  redis.call('PEXPIRE', minute, 60000)
end
redis.call('HSET', run, id, ARGV[4])
redis.call('SADD', P .. 'clients', name)
return {'ok'}
"""
)

# ARGV: P, name, pass id, tokens spent, (period name, expiry in Unix seconds) for the day, then
# the month: the request's end and its spend, in one round trip.
_RELEASE = r"""
redis.call('HDEL', ARGV[1] .. 'client:' .. ARGV[2] .. ':running', ARGV[3])
local tokens = tonumber(ARGV[4])
if tokens > 0 then
  for i = 5, 7, 2 do
    local key = ARGV[1] .. 'budget:' .. ARGV[2] .. ':' .. ARGV[i]
    redis.call('INCRBY', key, tokens)
    redis.call('EXPIREAT', key, ARGV[i + 1])
  end
end
return 1
"""

# ARGV: P, (period name, expiry) for the day and the month, count, (name, day, month)*: the
# spend read from the rows, kept only where Redis counts nothing yet for the period.
_SEED = r"""
local i = 7
for _ = 1, tonumber(ARGV[6]) do
  for j = 0, 1 do
    local key = ARGV[1] .. 'budget:' .. ARGV[i] .. ':' .. ARGV[2 + 2 * j]
    if redis.call('SET', key, ARGV[i + 1 + j], 'NX') then
      redis.call('EXPIREAT', key, ARGV[3 + 2 * j])
    end
  end
  i = i + 3
end
return 1
"""

# ARGV: P, name. Reply: requests of that client in flight over every live process.
_IN_FLIGHT = (
    _PRELUDE
    + r"""
reclaim(ARGV[2])
return redis.call('HLEN', running_key(ARGV[2]))
"""
)

# ARGV: P, process, count, (name, pass id)*: after Redis restarted empty (or this process's
# liveness lapsed), the passes this process still runs count again, even past a key's
# max_concurrent (others may have admitted more meanwhile): their requests run, and ending one
# for a quota would lose a generation; the key is refused until it is under its limit again.
_RESTORE = r"""
local i = 4
for _ = 1, tonumber(ARGV[3]) do
  redis.call('HSET', ARGV[1] .. 'client:' .. ARGV[i] .. ':running', ARGV[i + 1], ARGV[2])
  redis.call('SADD', ARGV[1] .. 'clients', ARGV[i])
  i = i + 2
end
return 1
"""

# ARGV: P, process, mark, lock ms, live pass ids... With a mark (>= 0): this process's passes
# numbered up to the mark that it no longer runs go (a call whose outcome it could not learn).
# At most one process per lock period also drops dead processes' passes.
_TICK = (
    _PRELUDE
    + r"""
local mine, mark = ARGV[2], tonumber(ARGV[3])
local live = {}
for i = 5, #ARGV do live[ARGV[i]] = true end
local function stray(id, owner)
  if owner ~= mine or mark < 0 or live[id] then return false end
  return tonumber(string.match(id, '%.(%d+)$')) <= mark
end
local sweep = redis.call('SET', P .. 'clients-sweeping', '1', 'PX', ARGV[4], 'NX')
if mark < 0 and not sweep then return 0 end
for _, name in ipairs(redis.call('SMEMBERS', P .. 'clients')) do
  local run = running_key(name)
  local all = redis.call('HGETALL', run)
  for j = 1, #all, 2 do
    if stray(all[j], all[j + 1]) or (sweep and not alive(all[j + 1])) then
      redis.call('HDEL', run, all[j])
    end
  end
  if redis.call('EXISTS', run) == 0 then redis.call('SREM', P .. 'clients', name) end
end
return 1
"""
)


def _or_none(limit: int | None) -> int:
    return -1 if limit is None else limit


def _expiring(now: datetime) -> list[str | int]:
    """The names of the day and the month `now` is in, each with when its count expires (a
    day past the period's end, in Unix seconds)."""
    return [
        value
        for period in periods(now)
        for value in (period.name, int((period.ends + timedelta(days=1)).timestamp()))
    ]


class RedisClientPass:
    """An admitted request of one client. `release` is idempotent and thread-safe (an
    exchange may be finished from another thread); it schedules the round trip on the loop."""

    __slots__ = ("client", "id", "spent", "_gate", "_lock", "_released")

    def __init__(self, gate: RedisClients, client: ClientSpec, ident: str) -> None:
        self.client = client
        self.id = ident
        self.spent: tuple[int, datetime] | None = None  # tokens, and when: set by the release
        self._gate = gate
        self._lock = threading.Lock()
        self._released = False

    def release(self, tokens: int = 0) -> None:
        if self._claim(tokens):
            self._gate._release_soon(self)

    async def arelease(self, tokens: int = 0) -> None:
        """Release now, on the loop, waiting for the round trip (never raises for Redis)."""
        if self._claim(tokens):
            await self._gate._release(self)

    def _claim(self, tokens: int) -> bool:
        with self._lock:
            if self._released:
                return False
            self._released = True
            self.spent = (tokens, self._gate.now())
            return True


class RedisClients:
    """Counts what each client key runs over every process. Use it on one event loop."""

    def __init__(
        self, shared: Shared, now: Callable[[], datetime] = lambda: datetime.now(UTC)
    ) -> None:
        self._shared = shared
        self.now = now  # the wall clock budgets' days and months are read on
        self._admit = shared.script(_ADMIT)
        self._release_script = shared.script(_RELEASE)
        self._seed_script = shared.script(_SEED)
        self._in_flight = shared.script(_IN_FLIGHT)
        self._tick_script = shared.script(_TICK)
        self._restore_script = shared.script(_RESTORE)
        self._ids = itertools.count(1)
        self._last_id = 0
        self._reconcile_needed = False
        self._passes: dict[str, RedisClientPass] = {}  # admitted here, not yet released
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        shared.on_tick(self._tick)
        shared.on_restore(self._restore)

    async def admit(self, client: ClientSpec, route: str) -> RedisClientPass:
        """Count a request of `client` on `route` over every process and return its pass.

        Raises RouteNotAllowed, BudgetExhausted or ClientLimited (with `retry_after` in whole
        seconds) or StateUnavailable. A refused request counts against no limit."""
        if client.routes and route not in client.routes:
            raise RouteNotAllowed(f"this API key may not use route “{route}”")
        self._loop = asyncio.get_running_loop()
        self._last_id = next(self._ids)
        ident = f"{self._shared.proc}.{self._last_id}"
        admitted = RedisClientPass(self, client, ident)
        # Counted before the reply: if the reply is lost, the next tick keeps or drops it.
        self._passes[ident] = admitted
        now = self.now()
        day, month = periods(now)
        try:
            reply = await self._admit(
                client.name,
                ident,
                self._shared.proc,
                _or_none(client.max_concurrent),
                _or_none(client.per_minute),
                _or_none(client.tokens_per_day),
                _or_none(client.tokens_per_month),
                day.name,
                month.name,
            )
        except BaseException:
            del self._passes[ident]
            self._reconcile_needed = True  # the next tick drops it from Redis if the script ran
            raise
        if reply[0] == "ok":
            return admitted
        del self._passes[ident]
        if reply[0] == "budget":
            spend = Spend(int(reply[1]), int(reply[2]))
            refusal = exhausted(client.tokens_per_day, client.tokens_per_month, spend, now)
            assert refusal is not None  # Redis found the same spend over a budget
            raise refusal
        if reply[0] == "concurrent":
            raise ClientLimited(
                f"too many requests in flight for this API key (at most {client.max_concurrent})",
                retry_after=1,
            )
        raise ClientLimited(
            f"rate limit reached for this API key ({client.per_minute} requests per minute)",
            retry_after=max(1, math.ceil(int(reply[1]) / 1000)),
        )

    async def in_flight(self, name: str) -> int:
        """Requests of the named client admitted and not yet released, over every process."""
        return int(await self._in_flight(name))

    def _release_soon(self, admitted: RedisClientPass) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(self._spawn_release, admitted)
        except RuntimeError:
            pass  # the loop closed meanwhile: the process is going, and so is its liveness

    def _spawn_release(self, admitted: RedisClientPass) -> None:
        task = asyncio.ensure_future(self._release(admitted))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _release(self, admitted: RedisClientPass) -> None:
        self._passes.pop(admitted.id, None)
        tokens, ended = admitted.spent or (0, self.now())
        try:
            await self._release_script(admitted.client.name, admitted.id, tokens, *_expiring(ended))
        except StateUnavailable:
            # The next tick that reaches Redis drops the pass; the spend is lost to the
            # budgets (its row keeps it, and seeds a period Redis lost whole).
            self._reconcile_needed = True

    async def seed(self, spends: Mapping[str, Spend], now: datetime) -> None:
        """Count the spend read from the rows where Redis counts nothing yet for the period
        of `now` (a Redis started empty, a period no process has spent in). Raises
        StateUnavailable."""
        values = [str(v) for n, s in spends.items() for v in (n, s.day, s.month)]
        if values:
            await self._seed_script(*_expiring(now), len(spends), *values)

    async def _tick(self) -> None:
        mark = -1
        if self._reconcile_needed:
            self._reconcile_needed = False
            mark = self._last_id  # passes admitted after this call started are not strays
        try:
            await self._tick_script(
                self._shared.proc, mark, max(100, int(self._shared.tick * 900)), *self._passes
            )
        except StateUnavailable:
            self._reconcile_needed = self._reconcile_needed or mark >= 0
            raise

    async def _restore(self) -> None:
        live = [value for p in self._passes.values() for value in (p.client.name, p.id)]
        await self._restore_script(self._shared.proc, len(live) // 2, *live)
