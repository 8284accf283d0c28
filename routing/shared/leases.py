"""Conversation leases shared by every gateway process, in Redis.

The same contract as the in-process `LeaseTable` (routing/core/leases.py): a (route,
fingerprint, model) stays on one host for `ttl` seconds after its last request. Reading a
lease slides its TTL in the same round trip. A request's lease is read and written inside the
slots' OPEN script (routing/shared/slots_lua.py, through `LEASE_FUNCTIONS`), in the same round
trip as its place; `slide` and `keep` serve the rest (a waiting request's lease, tests), and
`number` the slot number a conversation keeps on its host (`LeaseTable.slot_number`).

Keys, under the prefix P (a lease's id is a hash of its route, model and fingerprint, so keys
have a fixed size whatever clients send):

- `P lease:<id>`         the host, expiring after the lease's TTL (Redis expires it)
- `P leases`             sorted set of ids by expiry: the size cap and the count
- `P lease-host:<host>`  sorted set of that host's ids by expiry: `held_by_host`, `drop_host`
- `P lease-hosts`        set of hosts with leases
- `P lease-number:<id>`  the slot number the lease keeps on its host, expiring with the lease
- `P slot-numbers:<host>\0<model>`  hash of lease id -> the slot number it keeps there; an
                         entry counts while its lease lives on that host with that number
- `P version:leases`     a counter every write and drop moves on, expiring with the last
                         lease (`held_by_host` walks the hosts only when it moved, or a lease
                         counted last time expired)
  (each index expires with its longest-lived lease, so an idle gateway leaves no key behind)

How the cap holds: every write first drops ids whose expiry passed from `P leases`, then,
while more than `max_entries` remain, deletes the leases that expire soonest (the least
recently used when routes share a TTL). Writes are atomic scripts, so there are never more
than `max_entries` live leases; the index sets expire with their newest member.
"""

from __future__ import annotations

import hashlib

from routing.core.leases import LeaseKey
from routing.shared.state import ALIVE, VERSION, Shared

__all__ = ["LEASE_FUNCTIONS", "RedisLeases", "lease_id", "lease_ms", "parse_version"]

# The lease operations as Lua functions, for these scripts and for the slots' OPEN script
# (routing/shared/slots_lua.py), which reads and writes a lease in the same call as a place.
# Needs `P` (the key prefix) and `VERSION` (routing/shared/state.py) before it.
LEASE_FUNCTIONS = r"""
local lease_t = redis.call('TIME')
local now = tonumber(lease_t[1]) * 1000 + math.floor(tonumber(lease_t[2]) / 1000)
-- An index lives as long as its longest-lived member.
local function outlive(key, expires)
  local left = redis.call('PTTL', key)
  if left < 0 or left < expires - now then redis.call('PEXPIREAT', key, expires) end
end
local function index(key, expires, id)
  redis.call('ZADD', key, expires, id)
  outlive(key, expires)
end
-- The host of lease `id`, its TTL slid to `ms` from now; false without a live lease.
local function lease_read(id, ms)
  local key = P .. 'lease:' .. id
  local host = redis.call('GET', key)
  if not host then return false end
  local expires = now + ms
  redis.call('PEXPIREAT', key, expires)
  index(P .. 'leases', expires, id)
  index(P .. 'lease-host:' .. host, expires, id)
  return host
end
-- Lease `id` to `host` for `ms` unless another process changed it since it was read as
-- `expected` ('' for none, '*' for any): then the host it has is returned.
local function lease_write(id, host, ms, cap, expected)
  local key = P .. 'lease:' .. id
  local current = redis.call('GET', key) or ''
  if current ~= expected and current ~= '' and expected ~= '*' then return current end
  if current ~= '' then redis.call('ZREM', P .. 'lease-host:' .. current, id) end
  local expires = now + ms
  bump('leases')
  outlive(version_key('leases'), expires)
  redis.call('SET', key, host, 'PXAT', expires)
  index(P .. 'leases', expires, id)
  index(P .. 'lease-host:' .. host, expires, id)
  redis.call('SADD', P .. 'lease-hosts', host)
  outlive(P .. 'lease-hosts', expires)
  local all = P .. 'leases'
  redis.call('ZREMRANGEBYSCORE', all, '-inf', now)
  local over = redis.call('ZCARD', all) - cap
  if over > 0 then
    for _, victim in ipairs(redis.call('ZRANGE', all, 0, over - 1)) do
      local vkey = P .. 'lease:' .. victim
      local vhost = redis.call('GET', vkey)
      if vhost then redis.call('ZREM', P .. 'lease-host:' .. vhost, victim) end
      redis.call('DEL', vkey)
    end
    redis.call('ZREMRANGEBYRANK', all, 0, over - 1)
  end
  return host
end
-- The leases' version as this script leaves it ('' when none): a `held_by_host` reply whose
-- stamp has this version or a later one counts the leases written so far.
local function leases_version()
  return redis.call('GET', version_key('leases')) or ''
end
"""

_PRELUDE = "local P = ARGV[1]\n" + VERSION + LEASE_FUNCTIONS

# ARGV: P, id, ttl ms. Reply: the host, or nil. Slides the TTL of a live lease.
_READ = _PRELUDE + "return lease_read(ARGV[2], tonumber(ARGV[3]))"

# ARGV: P, id, host, ttl ms, cap, expected current host ('' for none, '*' for any). Sets the
# lease unless another process changed it since it was read. Reply: {the lease's host (another
# process's when it changed), the leases' version after the write}.
_WRITE = _PRELUDE + (
    "local host = lease_write(ARGV[2], ARGV[3], tonumber(ARGV[4]), tonumber(ARGV[5]), ARGV[6])\n"
    "return {host, leases_version()}"
)

# ARGV: P, host. Reply: how many leases went.
_DROP_HOST = (
    _PRELUDE
    + r"""
local hk = P .. 'lease-host:' .. ARGV[2]
local gone = 0
for _, id in ipairs(redis.call('ZRANGE', hk, 0, -1)) do
  local key = P .. 'lease:' .. id
  if redis.call('GET', key) == ARGV[2] then
    redis.call('DEL', key)
    redis.call('ZREM', P .. 'leases', id)
    gone = gone + 1
  end
end
redis.call('DEL', hk)
redis.call('SREM', P .. 'lease-hosts', ARGV[2])
-- No counter: no lease was written since they all expired, and the reader walks anyway.
if redis.call('EXISTS', version_key('leases')) == 1 then bump('leases') end
return gone
"""
)

# ARGV: P, the stamp of the caller's last reply ('' for none). Reply: this one's stamp, then a
# flat list of host, live leases; an empty list when the stamp is the caller's. The stamp is
# the leases' version (moved by every write and drop; it expires with the last lease) and the
# first expiry among the leases it counted: the counts stay as they were until one of the two
# comes, so an idle fleet's tick reads one counter, not every host.
_HELD = (
    _PRELUDE
    + r"""
local current = redis.call('GET', version_key('leases'))
local last_version, last_expiry = string.match(ARGV[2], '^(%d+) (%d+)$')
if current and last_version == current and now < tonumber(last_expiry) then return {} end
local out, first = {}, 2 ^ 52
for _, host in ipairs(redis.call('SMEMBERS', P .. 'lease-hosts')) do
  local hk = P .. 'lease-host:' .. host
  redis.call('ZREMRANGEBYSCORE', hk, '-inf', now)
  local count = redis.call('ZCARD', hk)
  if count == 0 then
    redis.call('SREM', P .. 'lease-hosts', host)
  else
    table.insert(out, host)
    table.insert(out, count)
    first = math.min(first, tonumber(redis.call('ZRANGE', hk, 0, 0, 'WITHSCORES')[2]))
  end
end
table.insert(out, 1, current and current .. ' ' .. string.format('%d', first) or '')
return out
"""
)

# ARGV: P, id, host, model, slots, proc. Reply: the slot number the lease `id` keeps on `host`
# for `model` (0 to slots - 1): the one it kept, else the one the fewest other live leases
# there keep (the lowest of those); nil when the lease is not live on `host`, or left to the
# host's choice there (`_LEAVE`: its mark slides with the lease), or while another
# live process holds a slot of the pair (`P held:<host>/<model>`, routing/shared/slots_lua.py):
# the process naming a slot knows only its own requests, and one of another process's that
# the host placed itself may run in that slot, where a request naming it would wait. A
# lease's number expires with it: it is written with the lease's TTL left, and an entry whose
# lease is gone, moved, or numbered again is dropped as the hash is walked (only for a lease
# numbered anew).
_NUMBER = (
    ALIVE  # `local P`, and `alive(proc)`: a dead process's slots are its no longer
    + VERSION
    + LEASE_FUNCTIONS
    + r"""
local HOSTS_CHOICE = 'host'
local id, host, model, slots, proc = ARGV[2], ARGV[3], ARGV[4], tonumber(ARGV[5]), ARGV[6]
local lease = P .. 'lease:' .. id
if redis.call('GET', lease) ~= host then return false end
local left = redis.call('PTTL', lease)
if left <= 0 then return false end
local numbers = P .. 'slot-numbers:' .. host .. '\0' .. model
local function take(n)
  redis.call('HSET', numbers, id, tostring(n))
  redis.call('SET', P .. 'lease-number:' .. id, tostring(n), 'PX', left)
  outlive(numbers, now + left)
  return n
end
local mine = redis.call('GET', P .. 'lease-number:' .. id)
if mine == HOSTS_CHOICE and redis.call('HGET', numbers, id) == mine then
  take(mine)  -- left to the host for as long as the lease lives
  return false
end
for _, holder in ipairs(redis.call('HVALS', P .. 'held:' .. host .. '/' .. model)) do
  if holder ~= proc and alive(holder) then return false end
end
if mine and mine ~= HOSTS_CHOICE and tonumber(mine) < slots
    and redis.call('HGET', numbers, id) == mine then
  return take(tonumber(mine))
end
local kept = {}
for n = 0, slots - 1 do kept[n] = 0 end
local entries = redis.call('HGETALL', numbers)
for i = 1, #entries, 2 do
  local holder, n = entries[i], entries[i + 1]
  if holder ~= id and redis.call('GET', P .. 'lease-number:' .. holder) == n
      and redis.call('GET', P .. 'lease:' .. holder) == host then
    local number = tonumber(n)
    if kept[number] then kept[number] = kept[number] + 1 end
  else
    redis.call('HDEL', numbers, holder)
  end
end
local best = 0
for n = 1, slots - 1 do
  if kept[n] < kept[best] then best = n end
end
return take(best)
"""
)

# ARGV: P, id, host, model. Marks the lease `id`, live on `host`, as served there before the
# host's slots were known (`LeaseTable.leave_to_host`): its number is 'host' (the host's
# choice), which `_NUMBER` keeps and answers with nil, and which its walk counts for no slot.
_LEAVE = (
    _PRELUDE
    + r"""
local id, host, model = ARGV[2], ARGV[3], ARGV[4]
local lease = P .. 'lease:' .. id
if redis.call('GET', lease) ~= host then return false end
local left = redis.call('PTTL', lease)
if left <= 0 then return false end
local numbers = P .. 'slot-numbers:' .. host .. '\0' .. model
redis.call('HSET', numbers, id, 'host')  -- `_NUMBER`'s HOSTS_CHOICE
redis.call('SET', P .. 'lease-number:' .. id, 'host', 'PX', left)
outlive(numbers, now + left)
return true
"""
)

# ARGV: P. Reply: live leases in all.
_COUNT = (
    _PRELUDE
    + r"""
redis.call('ZREMRANGEBYSCORE', P .. 'leases', '-inf', now)
return redis.call('ZCARD', P .. 'leases')
"""
)


def lease_id(key: LeaseKey) -> str:
    """A fixed-size id for a lease key: route, model and fingerprint may be long or odd."""
    raw = "\0".join((key.route, key.model, key.fingerprint)).encode("utf-8", "surrogatepass")
    return hashlib.sha256(raw).hexdigest()[:32]


class RedisLeases:
    """Leases with a sliding TTL, shared by every process; at most `max_entries` live.

    Every method raises StateUnavailable when Redis cannot be reached.
    """

    def __init__(self, shared: Shared, *, max_entries: int = 100_000) -> None:
        self.max_entries = max(1, max_entries)
        self._read = shared.script(_READ)
        self._write = shared.script(_WRITE)
        self._drop_host = shared.script(_DROP_HOST)
        self._held = shared.script(_HELD)
        self._last_held: tuple[str, dict[str, int]] = ("", {})
        self._count = shared.script(_COUNT)
        self._number = shared.script(_NUMBER)
        self._leave = shared.script(_LEAVE)
        self._proc = shared.proc

    async def slide(self, key: LeaseKey, ttl: float) -> str | None:
        """The host of a live lease for `key`, its TTL slid to `ttl` from now; None without."""
        return await self._read(lease_id(key), lease_ms(ttl))

    async def keep(self, key: LeaseKey, host: str, ttl: float) -> int | None:
        """Lease `key` to `host` for `ttl` seconds from now, whatever it was (one round trip).
        Returns the leases' version after the write (`counted_up_to`); None for an empty
        fingerprint, which is never stored."""
        if not key.fingerprint:
            return None
        _, version = await self._write(lease_id(key), host, lease_ms(ttl), self.max_entries, "*")
        return parse_version(version)

    async def drop_host(self, host: str) -> int:
        """Remove every lease held by `host` (a deleted host); return how many went."""
        return int(await self._drop_host(host))

    async def held_by_host(self) -> dict[str, int]:
        """Live leases per host (ranking, dashboard). When no count changed since the last
        call, the dict that call returned (do not change it)."""
        stamp, last = self._last_held
        flat = await self._held(stamp)
        if not flat:
            return last  # nothing changed since that reply
        held = {flat[i]: int(flat[i + 1]) for i in range(1, len(flat), 2)}
        self._last_held = (flat[0], held)
        return held

    @property
    def counted_up_to(self) -> int | None:
        """The leases' version the last `held_by_host` counts: a lease whose write left this
        version or an earlier one is in its counts (Redis runs scripts one at a time). None when
        the read found no version: no lease was live, and a later write is not counted."""
        return parse_version(self._last_held[0].partition(" ")[0])

    async def number(self, key: LeaseKey, host: str, slots: int) -> int | None:
        """The slot number (0 to `slots` - 1) the conversation keeps on `host`, its lease's
        host, as `LeaseTable.slot_number` gives it in one process: the one it kept before,
        else the one the fewest other live leases of the (host, model) keep (the lowest of
        those); None when its lease is not live there, or while another process holds a slot
        of the (host, model): its requests are not this process's to account for. One round
        trip."""
        number = await self._number(lease_id(key), host, key.model, slots, self._proc)
        return None if number is None else int(number)

    async def leave_to_host(self, key: LeaseKey, host: str) -> None:
        """Keep no slot number for the conversation on `host`, its lease's host, from now on
        (`LeaseTable.leave_to_host`). One round trip."""
        await self._leave(lease_id(key), host, key.model)

    async def count(self) -> int:
        """Live leases in all."""
        return int(await self._count())


def parse_version(version: str) -> int | None:
    """The leases' version as a script replies it; None for '' (no lease was live)."""
    return int(version) if version else None


def lease_ms(ttl: float) -> int:
    return max(1, int(ttl * 1000))
