"""One gateway process's handle on the state it shares with the others through Redis.

`Shared` holds the connection, the process's id and its liveness: a key `<prefix>proc:<id>`
that the process renews every `tick` seconds with an expiry of `hold_ttl`. Every slot, queue
place and client count a process takes in Redis carries its id, so once that key has expired
(the process was killed, hung, or cut off from Redis for longer than `hold_ttl`) any other
process may take them back. The same tick runs the periodic work of the modules built on it
(sweeps, deferred releases), and when it finds the process's key gone (Redis restarted empty,
or the key lapsed), their restore hooks put back what this process still holds and may still
count as its own (routing/shared/slot_recovery.py says which slots may not).

Every operation of those modules is one Lua script (EVALSHA; redis-py loads a script once and
again after a Redis restart) written to be idempotent, so the one retry allowed on a dropped
connection cannot take a slot twice. When Redis cannot be reached they raise `StateUnavailable`.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit

import redis.asyncio as aioredis
import redis.exceptions as redis_errors
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.typing import EncodableT

from routing.core.errors import GatewayError

__all__ = ["DEFAULT_HOLD_TTL", "DEFAULT_PREFIX", "UNREACHABLE", "Shared", "StateUnavailable"]

log = logging.getLogger("crossbar.shared")

DEFAULT_HOLD_TTL = 5.0
DEFAULT_PREFIX = "crossbar:"
# Errors that mean "Redis is not there (or not writable) right now", as opposed to a bug.
POOL_SIZE = 32  # connections to Redis per process, the grant listener's included
# How long a call may wait for one of them. Waiting means this process is busy, not that Redis
# is away (that shows as a refused or timed-out connection), so it is longer than a socket's
# timeout: 160 requests at once on a loaded machine waited past 2 s and read as an outage.
POOL_WAIT = 10.0

UNREACHABLE = (
    redis_errors.ConnectionError,  # refused, reset, authentication, still loading its data
    redis_errors.TimeoutError,
    redis_errors.ReadOnlyError,  # a replica after a failover
    redis_errors.OutOfMemoryError,  # maxmemory reached with a noeviction policy
    OSError,
)


# The start of every script: ARGV[1] is the key prefix, and `alive(proc)` says whether a
# process still renews its liveness key (asked once per process per script).
ALIVE = r"""
local P = ARGV[1]
local alive_cache = {}
local function alive(proc)
  local known = alive_cache[proc]
  if known == nil then
    known = redis.call('EXISTS', P .. 'proc:' .. proc) == 1
    alive_cache[proc] = known
  end
  return known
end
"""


# `bump(name)`: what the counts named `name` are made of changed in this script (once per
# script, however often called). A tick reads `P version:<name>` first and walks the keys only
# when it moved, so an idle fleet's tick costs one GET, not every pair. A missing counter (Redis
# restarted empty, or it expired) starts from Redis's clock in microseconds, past any value
# handed out before: a number a process remembers is never current again for other counts.
# A reader finding no counter walks the keys. Needs `P`.
VERSION = r"""
local bumped = {}
local function version_key(name) return P .. 'version:' .. name end
local function bump(name)
  if bumped[name] then return end
  bumped[name] = true
  local key = version_key(name)
  if redis.call('EXISTS', key) == 0 then
    local t = redis.call('TIME')
    redis.call('SET', key, t[1] .. string.format('%06d', tonumber(t[2])))
  end
  redis.call('INCR', key)
end
"""


class StateUnavailable(GatewayError):
    """The shared state (Redis) cannot be reached; the request can be retried shortly."""

    status = 503
    code = "state_unavailable"
    when = "the shared state (Redis) cannot be reached (`Retry-After: 2`)"

    def __init__(self, message: str = "shared state unavailable", *, retry_after: int = 2):
        super().__init__(message, retry_after=retry_after)


Script = Callable[..., Awaitable[Any]]
Hook = Callable[[], Awaitable[None]]


def url_problem(url: str) -> str:
    """What is wrong with a Redis URL, in one line without the URL (it may hold a password);
    "" when nothing is."""
    if urlsplit(url).scheme not in ("redis", "rediss", "unix"):
        return "CROSSBAR_REDIS_URL must start with redis://, rediss:// or unix://"
    return ""


class Shared:
    """The connection, identity and liveness of one process. Use it on one event loop.

    `start()` begins renewing the liveness key (it never raises: an unreachable Redis is
    logged and retried every tick); `aclose()` stops, and deletes the key so that the other
    processes take back at once whatever this process failed to release.
    """

    def __init__(
        self,
        url: str,
        *,
        prefix: str = DEFAULT_PREFIX,
        hold_ttl: float = DEFAULT_HOLD_TTL,
        timeout: float = 2.0,
    ) -> None:
        if not hold_ttl > 0:
            raise ValueError(f"the hold TTL must be a positive number of seconds, not {hold_ttl}")
        problem = url_problem(url)
        if problem:
            raise ValueError(problem)
        parts = urlsplit(url)
        # Where Redis is, for messages: never the whole URL, which may carry a password.
        where = f"{parts.hostname}:{parts.port or 6379}"
        self.where = parts.path if parts.scheme == "unix" else where
        self.prefix = prefix
        self.hold_ttl = hold_ttl
        self.tick = min(1.0, hold_ttl / 3)
        self.proc = secrets.token_hex(6)
        # One retry on a dropped connection (a pooled connection that died with a restarted
        # Redis); every script is idempotent, so a retry after a lost reply changes nothing.
        # A blocking pool: past POOL_SIZE calls at once, a call waits (up to POOL_WAIT) for a
        # connection rather than failing, as redis-py's default pool does past 100; a script
        # takes Redis tens of microseconds, so a few dozen connections serve thousands of
        # requests a second.
        pool = aioredis.BlockingConnectionPool.from_url(
            url,
            max_connections=POOL_SIZE,
            timeout=POOL_WAIT,
            decode_responses=True,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            retry=Retry(NoBackoff(), 1),
        )
        self.redis = aioredis.Redis.from_pool(pool)
        self.available = False
        self._renew = self.script(_RENEW)
        self._restorers: list[Hook] = []
        self._tickers: list[Hook] = []
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self._said_down = False

    def script(self, lua: str) -> Script:
        """A Lua script as an async function of its ARGV (KEYS are not used: one Redis, not a
        cluster). Raises StateUnavailable when Redis cannot be reached."""
        registered = self.redis.register_script(lua)

        async def call(*args: EncodableT) -> Any:
            task = asyncio.current_task()
            cancels = task.cancelling() if task is not None else 0
            try:
                reply = await registered(args=[self.prefix, *args])
            except UNREACHABLE as exc:
                self.mark_down(exc)
                raise StateUnavailable(
                    f"shared state unavailable: Redis at {self.where} cannot be reached"
                ) from exc
            if task is not None and task.cancelling() > cancels:
                # Cancelled during the call, which returned anyway: redis-py sends through
                # asyncio.wait_for, which on Python 3.11 drops a cancellation that comes as
                # the send ends. Delivered here, as if it had come a moment sooner (every
                # caller settles a script whose reply a cancellation cut off).
                raise asyncio.CancelledError
            return reply

        return call

    def on_restore(self, hook: Hook) -> None:
        """Call `hook` when this process's liveness key was found gone (Redis restarted, or
        the key lapsed): the hook puts back what the process still holds."""
        self._restorers.append(hook)

    def on_tick(self, hook: Hook) -> None:
        """Call `hook` every tick while Redis answers (sweeps, deferred releases)."""
        self._tickers.append(hook)

    async def start(self) -> None:
        """Renew the liveness key now and then every `tick` seconds, in a task of its own."""
        if self._task is None:
            await self.beat()
            self._task = asyncio.create_task(self._beat_forever(), name="crossbar-shared-beat")

    async def aclose(self) -> None:
        if self._task is not None:
            # The flag too: a cancellation lost on its way (`script` delivers the ones its
            # calls lose; an awaited hook might lose another) would keep the beat going.
            self._stopping = True
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        try:
            await self.redis.delete(f"{self.prefix}proc:{self.proc}")
        except UNREACHABLE:
            pass  # it expires by itself
        await self.redis.aclose()

    async def beat(self) -> None:
        """One tick: renew the liveness key, restore if it was gone, run the tick hooks.

        Never raises for an unreachable Redis (that is logged once per outage)."""
        try:
            if await self._renew(self.proc, int(self.hold_ttl * 1000)):
                await self._restore()
            for hook in self._tickers:
                await hook()
        except StateUnavailable:
            return
        except Exception:
            log.exception("shared state: a periodic task failed")
            return
        if self._said_down:
            log.warning("shared state: Redis at %s answers again", self.where)
            self._said_down = False
        self.available = True

    async def revive(self) -> None:
        """Renew the liveness key and put back what this process holds, as the next tick
        would: for a call that found this process's key gone (Redis restarted, or the
        process was away past the hold TTL) and must not wait for that tick. Raises
        StateUnavailable."""
        await self._renew(self.proc, int(self.hold_ttl * 1000))
        await self._restore()

    async def _restore(self) -> None:
        for restore in self._restorers:
            await restore()

    async def _beat_forever(self) -> None:
        while not self._stopping:
            await asyncio.sleep(self.tick)
            await self.beat()

    def mark_down(self, exc: BaseException) -> None:
        """Note that Redis could not be reached (`exc` says how): `available` is False until a
        tick goes through, and the outage is logged once. For a caller that talks to Redis
        other than through `script` (the grant listener's pub/sub). Never raises."""
        self.available = False
        if not self._said_down:
            self._said_down = True
            log.warning(
                "shared state: Redis at %s cannot be reached (%s)", self.where, type(exc).__name__
            )


# Returns 1 when the key was gone (first start, Redis restarted, or lapsed), 0 when renewed.
_RENEW = """
local key = ARGV[1] .. 'proc:' .. ARGV[2]
if redis.call('SET', key, '1', 'PX', ARGV[3], 'XX') then return 0 end
redis.call('SET', key, '1', 'PX', ARGV[3])
return 1
"""
