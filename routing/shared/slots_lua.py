"""The Lua scripts behind the shared slots, one per operation: the operations a request calls
(routing/shared/slots.py), the limits (slot_limits.py) and the restore path (slot_recovery.py).

Keys, under the prefix P (a pair is "host/model"; ids are "<process>.<n>"):

- `P conf:<pair>`    hash parallel, queue_max (and removed=1 once no process configures it)
- `P pairs`          set of the pairs with a conf, for the sweep and the snapshot
- `P held:<pair>`    hash grant id -> process: the slots held; HLEN is the pair's in flight
- `P queue:<pair>`   list of waiter ids, oldest first (at most queue_max)
- `P watch:<pair>`   sorted set of waiter ids of other pairs that may take a free slot here,
                     scored by arrival (`P seq`), so the oldest watcher goes first
- `P waiter:<id>`    hash pair, seq, watches (JSON list): one queued request; expires after
                     the longest wait allowed, and is deleted when the waiter is granted or
                     leaves. A queue or watch entry without its record is stale and skipped.
- `P proc:<id>`      a process's liveness (routing/shared/state.py)
- `P epoch`          a token that changes when Redis restarts empty (no expiry), so that a
                     process putting its slots back knows whether they may be gone for good
- `P wake:<id>`      the pub/sub channel a process hears its grants on ("<waiter>\\n<pair>")
- `P renamed:<pair>` the pair a renamed host's pair became (RENAME), for a release naming it
- `P version:slots`  a counter every script that changes a conf, a held slot or a queue moves
                     on (`bump`, routing/shared/state.py): SNAPSHOT walks the pairs only when
                     it moved since the caller's last reply

Invariant after every script, for each pair it touched: fewer slots held than `parallel`
implies no live waiter in its queue or among its watchers (a freed slot goes to the head
waiter, else to the oldest watcher, in the same script that freed it).

Every script is idempotent for its ids (a retry after a lost reply changes nothing).
"""

from __future__ import annotations

from routing.shared.leases import LEASE_FUNCTIONS
from routing.shared.state import ALIVE, VERSION

PRELUDE = (
    ALIVE
    + VERSION
    + r"""
local function proc_of(id) return string.match(id, '^([^.]+)%.') end
local function held_key(pair) return P .. 'held:' .. pair end
local function queue_key(pair) return P .. 'queue:' .. pair end
local function watch_key(pair) return P .. 'watch:' .. pair end
local function waiter_key(w) return P .. 'waiter:' .. w end
local function conf(pair)
  local c = redis.call('HMGET', P .. 'conf:' .. pair, 'parallel', 'queue_max')
  if not c[1] then return nil, nil end
  return tonumber(c[1]), tonumber(c[2])
end
local function waiting(w)
  return alive(proc_of(w)) and redis.call('EXISTS', waiter_key(w)) == 1
end

-- Take a waiter out of its queue and every watch set, and drop its record.
local function forget_waiter(w)
  bump('slots')
  local rec = redis.call('HMGET', waiter_key(w), 'pair', 'watches')
  if rec[1] then redis.call('LREM', queue_key(rec[1]), 0, w) end
  if rec[2] then
    for _, pair in ipairs(cjson.decode(rec[2])) do redis.call('ZREM', watch_key(pair), w) end
  end
  redis.call('DEL', waiter_key(w))
end

-- The slot is counted as the waiter's here, so nobody can take it before the waiter hears.
local function grant_to(w, pair)
  forget_waiter(w)  -- bumps
  redis.call('HSET', held_key(pair), w, proc_of(w))
  redis.call('PUBLISH', P .. 'wake:' .. proc_of(w), w .. '\n' .. pair)
end

local function next_waiter(pair)
  local q = queue_key(pair)
  while true do
    local w = redis.call('LINDEX', q, 0)
    if not w then break end
    if waiting(w) then return w end
    redis.call('LPOP', q)
    forget_waiter(w)
  end
  local wk = watch_key(pair)
  while true do
    local w = redis.call('ZRANGE', wk, 0, 0)[1]
    if not w then return nil end
    if waiting(w) then return w end
    redis.call('ZREM', wk, w)
    forget_waiter(w)
  end
end

local function hand_over(pair)
  local parallel = conf(pair)
  if not parallel then return end
  local h = held_key(pair)
  while redis.call('HLEN', h) < parallel do
    local w = next_waiter(pair)
    if not w then return end
    grant_to(w, pair)
  end
end

-- Slots held by processes whose liveness key expired; returns how many were taken back.
local function reclaim(pair)
  local h = held_key(pair)
  local all = redis.call('HGETALL', h)
  local freed = 0
  for i = 1, #all, 2 do
    if not alive(all[i + 1]) then
      redis.call('HDEL', h, all[i])
      bump('slots')
      freed = freed + 1
    end
  end
  return freed
end

local function purge(pair)
  local q = queue_key(pair)
  for _, w in ipairs(redis.call('LRANGE', q, 0, -1)) do
    if not waiting(w) then
      redis.call('LREM', q, 0, w)
      forget_waiter(w)
    end
  end
  local wk = watch_key(pair)
  for _, w in ipairs(redis.call('ZRANGE', wk, 0, -1)) do
    if not waiting(w) then
      redis.call('ZREM', wk, w)
      forget_waiter(w)
    end
  end
end

-- A free slot right now, after serving the pair's own waiters and taking back dead holders.
local function has_free(pair, parallel)
  local h = held_key(pair)
  hand_over(pair)
  if redis.call('HLEN', h) < parallel then return true end
  if reclaim(pair) > 0 then
    hand_over(pair)
    return redis.call('HLEN', h) < parallel
  end
  return false
end

-- A pair no process configures any more goes once nothing is held or waits there.
local function tidy(pair)
  local c = P .. 'conf:' .. pair
  if redis.call('HGET', c, 'removed') ~= '1' then return end
  if redis.call('HLEN', held_key(pair)) > 0 or redis.call('LLEN', queue_key(pair)) > 0 then
    return
  end
  redis.call('DEL', c, watch_key(pair))
  redis.call('SREM', P .. 'pairs', pair)
  bump('slots')
end

local function held_by(w, first, last)
  for i = first, last do
    if redis.call('HEXISTS', held_key(ARGV[i]), w) == 1 then return ARGV[i] end
  end
  return nil
end
"""
)

# ARGV: P, pair, parallel, queue_max
CONFIGURE = (
    PRELUDE
    + r"""
local pair = ARGV[2]
redis.call('HSET', P .. 'conf:' .. pair, 'parallel', ARGV[3], 'queue_max', ARGV[4])
redis.call('HDEL', P .. 'conf:' .. pair, 'removed')
redis.call('SADD', P .. 'pairs', pair)
bump('slots')
hand_over(pair)
return 1
"""
)

# ARGV: P, pair. Like the in-process limiter: held slots release cleanly and waiters keep
# their place, with the pair at parallel 1 and no new places, until it is idle and goes.
REMOVE = (
    PRELUDE
    + r"""
local pair = ARGV[2]
if redis.call('EXISTS', P .. 'conf:' .. pair) == 0 then return 0 end
redis.call('HSET', P .. 'conf:' .. pair, 'parallel', 1, 'queue_max', 0, 'removed', 1)
bump('slots')
tidy(pair)
return 1
"""
)

# Placing on a list of pairs, for PLACE and OPEN.
PLACING = r"""
local function listed(first)
  local list = {}
  for i = first, #ARGV do list[#list + 1] = ARGV[i] end
  return list
end
-- A call made again with the same waiter id (its first outcome unknown): what it got then.
local function granted_before(w, list)
  for _, pair in ipairs(list) do
    if redis.call('HEXISTS', held_key(pair), w) == 1 then return {'grant', pair} end
  end
  return nil
end
local function queued_before(w)
  local mine = redis.call('HGET', waiter_key(w), 'pair')
  if mine then return {'queued', mine, (redis.call('LPOS', queue_key(mine), w) or -1) + 1} end
  return nil
end
-- A refusal: 'full', then each pair asked with its slots held and its line's length as they
-- refused it, which the refusal's message quotes (no process's view of them may be as fresh).
local function full(list)
  local out = {'full'}
  for _, pair in ipairs(list) do
    out[#out + 1] = pair
    out[#out + 1] = redis.call('HLEN', held_key(pair))
    out[#out + 1] = redis.call('LLEN', queue_key(pair))
  end
  return out
end
-- A free slot of the first pair in `list` with one, else (mode 'queue') a place in the first
-- line with room. Each pair's limits are read only once it is reached: the first free slot is
-- usually the first pair's, so a call costs what it walks, not the length of the list.
local function walk(w, ttl, mode, list)
  local queue_max = {}
  for i, pair in ipairs(list) do
    local parallel, most = conf(pair)
    if not parallel then return {'unconfigured', pair} end
    queue_max[i] = most
    if has_free(pair, parallel) then
      redis.call('HSET', held_key(pair), w, proc_of(w))
      bump('slots')
      return {'grant', pair}
    end
  end
  if mode ~= 'queue' then return full(list) end
  for i, pair in ipairs(list) do
    local most = queue_max[i]
    local q = queue_key(pair)
    if most > 0 and redis.call('LLEN', q) >= most then purge(pair) end
    if redis.call('LLEN', q) < most then
      local seq = redis.call('INCR', P .. 'seq')
      local position = redis.call('RPUSH', q, w)
      bump('slots')
      redis.call('HSET', waiter_key(w), 'pair', pair, 'seq', seq, 'watches', '[]')
      redis.call('PEXPIRE', waiter_key(w), ttl)
      return {'queued', pair, position}
    end
  end
  return full(list)
end
"""

# ARGV: P, waiter id, waiter record ttl ms, 'queue' or 'slots' (a free slot or nothing),
# '1' when the same waiter asks again (its first call's outcome unknown) else '0',
# pair1..pairN.
# Reply: {'grant', pair} | {'queued', pair, position} | {'full', (pair, held, queued)...} |
# {'unconfigured', pair} |
# {'lapsed'} (the process's liveness key is gone: what it took now would not count as its own)
PLACE = (
    PRELUDE
    + PLACING
    + r"""
local w, again = ARGV[2], ARGV[5] == '1'
local list = listed(6)
if again then
  local got = granted_before(w, list)
  if got then return got end
end
if not alive(proc_of(w)) then return {'lapsed'} end
if again then
  local got = queued_before(w)
  if got then return got end
end
return walk(w, ARGV[3], ARGV[4], list)
"""
)

# A conversation's first step in one call: its lease read, the place that follows from it,
# and the lease written (the same choice as routing/core/opening.py `open_with`).
# ARGV: P, waiter id, waiter record ttl ms, mode (as PLACE's, for the ranking's pairs; home's
# own line is always a choice), again (as PLACE's), lease id, lease ttl ms, lease cap, model,
# strict ('1'/'0'), patient ('1': home alone first, the others only when its line is full),
# n, then the n hosts this process may not use now, then the ranking's pairs, best first.
# Reply: {kind, pair, position, the lease's host as found or '', the host leased now or '',
# '1' when home was usable (the place was asked there first) else '0', the leases' version
# after the lease was written or '', and for 'full' the counts as PLACE's reply gives them},
# kind as PLACE's or 'pinned' (a strict route whose home may not be used).
OPEN = (
    PRELUDE
    + PLACING
    + LEASE_FUNCTIONS
    + r"""
local w, ttl, mode, again = ARGV[2], ARGV[3], ARGV[4], ARGV[5] == '1'
local id, ms, cap, model = ARGV[6], tonumber(ARGV[7]), tonumber(ARGV[8]), ARGV[9]
local strict, patient, n = ARGV[10] == '1', ARGV[11] == '1', tonumber(ARGV[12])
local unusable = {}
for i = 13, 12 + n do unusable[ARGV[i]] = true end
local ranked = listed(13 + n)
local home = lease_read(id, ms)
local at_home = home and not unusable[home] and conf(home .. '/' .. model) ~= nil
local order, others = ranked, ranked
if at_home then
  local own = home .. '/' .. model
  order, others = {own}, {}
  for _, pair in ipairs(ranked) do
    if pair ~= own then
      order[#order + 1] = pair
      others[#others + 1] = pair
    end
  end
end
local function reply(got, leased)
  local version = leased ~= '' and leases_version() or ''
  if got[1] == 'full' then  -- the counts that refused it come last
    local out = {'full', '', 0, home or '', leased, at_home and '1' or '0', version}
    for i = 2, #got do out[#out + 1] = got[i] end
    return out
  end
  return {got[1], got[2] or '', got[3] or 0, home or '', leased, at_home and '1' or '0', version}
end
if again then
  local got = granted_before(w, order)
  if got then return reply(got, '') end
end
if not alive(proc_of(w)) then return {'lapsed'} end
if again then
  local got = queued_before(w)
  if got then return reply(got, '') end
end
if at_home then  -- its lease slid as it was read
  if not patient then return reply(walk(w, ttl, mode, order), '') end
  local got = walk(w, ttl, 'queue', {order[1]})
  if got[1] == 'full' and #others > 0 then
    local at_home_full = got
    got = walk(w, ttl, mode, others)
    if got[1] == 'full' then
      for i = 2, #at_home_full do got[#got + 1] = at_home_full[i] end
    end
  end
  return reply(got, '')
end
if home and strict then return reply({'pinned'}, '') end
local got = walk(w, ttl, mode, ranked)
if got[1] ~= 'grant' and got[1] ~= 'queued' then return reply(got, '') end
local host = string.match(got[2], '^([^/]*)/')
lease_write(id, host, ms, cap, '*')
return reply(got, host)
"""
)

# ARGV: P, waiter id, own pair, pair1..pairN to watch.
# Reply: {'grant', pair} | {'watching'} | {'gone'} (the waiter left or lost its place)
WATCH = (
    PRELUDE
    + r"""
local w = ARGV[2]
local granted = held_by(w, 3, #ARGV)
if granted then return {'grant', granted} end
local key = waiter_key(w)
local rec = redis.call('HMGET', key, 'seq', 'watches')
if not rec[1] then return {'gone'} end
for i = 4, #ARGV do
  local pair = ARGV[i]
  local parallel = conf(pair)
  if parallel and pair ~= ARGV[3] then
    local free = has_free(pair, parallel)
    -- Serving the pair's own waiters first may have reached this waiter (a second watch).
    if redis.call('HEXISTS', held_key(pair), w) == 1 then return {'grant', pair} end
    if free then
      grant_to(w, pair)
      return {'grant', pair}
    end
  end
end
local watches = cjson.decode(rec[2])
local known = {}
for _, pair in ipairs(watches) do known[pair] = true end
for i = 4, #ARGV do
  local pair = ARGV[i]
  if not known[pair] and pair ~= ARGV[3] then
    known[pair] = true
    table.insert(watches, pair)
    redis.call('ZADD', watch_key(pair), rec[1], w)
  end
end
if #watches > 0 then redis.call('HSET', key, 'watches', cjson.encode(watches)) end
return {'watching'}
"""
)

# ARGV: P, waiter id, pair1..pairN (its own and every pair it watched or was placed on).
# Reply: {'grant', pair} when a slot reached the waiter first (the caller now holds it), else
# {'none'}; either way the waiter is in no queue or watch set afterwards.
CANCEL = (
    PRELUDE
    + r"""
local w = ARGV[2]
local granted = held_by(w, 3, #ARGV)
if granted then return {'grant', granted} end
forget_waiter(w)
for i = 3, #ARGV do
  redis.call('LREM', queue_key(ARGV[i]), 0, w)
  redis.call('ZREM', watch_key(ARGV[i]), w)
end
return {'none'}
"""
)

# ARGV: P, old pair, new pair. The host was renamed (the same box): the slots held on the
# old pair, whichever process holds them, count on the new one from now on, and a release
# naming the old pair follows `P renamed:<old>` (a process that has not reloaded yet). The old
# pair is removed as by REMOVE; its line's waiters are ended by their own processes.
RENAME = (
    PRELUDE
    + r"""
local old, new = ARGV[2], ARGV[3]
local h = held_key(old)
local all = redis.call('HGETALL', h)
for i = 1, #all, 2 do redis.call('HSET', held_key(new), all[i], all[i + 1]) end
redis.call('DEL', h)
redis.call('SET', P .. 'renamed:' .. old, new)
redis.call('DEL', P .. 'renamed:' .. new)
bump('slots')
if redis.call('EXISTS', P .. 'conf:' .. old) == 1 then
  redis.call('HSET', P .. 'conf:' .. old, 'parallel', 1, 'queue_max', 0, 'removed', 1)
  tidy(old)
end
return 1
"""
)

# ARGV: P, grant id, pair. A grant no longer on its pair was moved by a RENAME: it is
# released where the renames led (a few at most).
RELEASE = (
    PRELUDE
    + r"""
local pair = ARGV[3]
for _ = 1, 8 do
  if redis.call('HDEL', held_key(pair), ARGV[2]) == 1 then
    bump('slots')
    hand_over(pair)
    tidy(pair)
    return 1
  end
  pair = redis.call('GET', P .. 'renamed:' .. pair)
  if not pair then return 1 end
end
return 1
"""
)

# ARGV: P, count, then per waiter: id, n, pair1..pairN. Reply per waiter: the pair it was
# granted, 'waiting', or 'gone'.
CHECK = (
    PRELUDE
    + r"""
local out = {}
local i = 3
for _ = 1, tonumber(ARGV[2]) do
  local w, n = ARGV[i], tonumber(ARGV[i + 1])
  local status = held_by(w, i + 2, i + 1 + n)
  if not status then
    status = redis.call('EXISTS', waiter_key(w)) == 1 and 'waiting' or 'gone'
  end
  table.insert(out, status)
  i = i + 2 + n
end
return out
"""
)

# ARGV: P, process, hold ttl ms, epoch the process last saw, a new epoch, count of configs,
# (pair, parallel, queue_max)*, (grant id, pair)*. Reply: {epoch, grant id lost...}.
# After Redis restarted empty or this process's liveness lapsed: its key is renewed, pairs with
# no conf get this process's, and each slot it holds is checked. One still in Redis is its own.
# One that is gone was either taken back from it (it was away past its hold TTL: another may
# hold that slot now) or lost with Redis's data: only in the second case, and only while the
# pair has a free slot, is it counted again. The others are lost, so `parallel` holds.
RESTORE = (
    PRELUDE
    + r"""
local proc = ARGV[2]
redis.call('SET', P .. 'proc:' .. proc, '1', 'PX', ARGV[3])
alive_cache[proc] = true
local epoch = redis.call('GET', P .. 'epoch')
if not epoch then
  epoch = ARGV[5]
  redis.call('SET', P .. 'epoch', epoch)
end
local restarted = epoch ~= ARGV[4]
local n = tonumber(ARGV[6])
local i = 7
for _ = 1, n do
  local c = P .. 'conf:' .. ARGV[i]
  if redis.call('EXISTS', c) == 0 then
    redis.call('HSET', c, 'parallel', ARGV[i + 1], 'queue_max', ARGV[i + 2])
    redis.call('SADD', P .. 'pairs', ARGV[i])
    bump('slots')
  end
  i = i + 3
end
local out = {epoch}
while i < #ARGV do
  local id, pair = ARGV[i], ARGV[i + 1]
  if redis.call('HEXISTS', held_key(pair), id) == 0 then
    local parallel = conf(pair)
    if restarted and parallel and has_free(pair, parallel) then
      redis.call('HSET', held_key(pair), id, proc)
      bump('slots')
    else
      table.insert(out, id)
    end
  end
  i = i + 2
end
return out
"""
)

# ARGV: P, lock ms. At most one process sweeps per lock period: dead holders and waiters go,
# their slots to the next waiters; removed pairs that went idle are forgotten.
SWEEP = (
    PRELUDE
    + r"""
if not redis.call('SET', P .. 'sweeping', '1', 'PX', ARGV[2], 'NX') then return 0 end
for _, pair in ipairs(redis.call('SMEMBERS', P .. 'pairs')) do
  reclaim(pair)
  purge(pair)
  hand_over(pair)
  tidy(pair)
end
return 1
"""
)

# ARGV: P, a process whose slots not to count ('' for none), the version of the caller's last
# reply ('' for none). Reply: the slots' version now ('' without one), then a flat list of pair,
# parallel, queue_max, in flight, queued; an empty list when the version is the caller's
# (nothing changed: an idle fleet's tick reads one counter, not every pair).
SNAPSHOT = (
    PRELUDE
    + r"""
local current = redis.call('GET', version_key('slots'))
if current and current == ARGV[3] then return {} end
local out, skip = {}, ARGV[2]
for _, pair in ipairs(redis.call('SMEMBERS', P .. 'pairs')) do
  local parallel, queue_max = conf(pair)
  if parallel then
    table.insert(out, pair)
    table.insert(out, parallel)
    table.insert(out, queue_max)
    local held = 0
    if skip == '' then
      held = redis.call('HLEN', held_key(pair))
    else
      for _, holder in ipairs(redis.call('HVALS', held_key(pair))) do
        if holder ~= skip then held = held + 1 end
      end
    end
    table.insert(out, held)
    table.insert(out, redis.call('LLEN', queue_key(pair)))
  end
end
table.insert(out, 1, current or '')
return out
"""
)

# ARGV: P, process, mark, live ids... After calls whose outcome this process could not learn
# (Redis away, a cancelled call): every slot, place or watch of this process numbered up to the
# mark that it no longer knows of goes, and freed slots go to the next waiters. Ids it still
# holds or waits with are passed, and ids made after the mark (calls that may reach Redis
# before this script) are left alone, so what is under way stays.
RECONCILE = (
    PRELUDE
    + r"""
local mine, mark = ARGV[2], tonumber(ARGV[3])
local live = {}
for i = 4, #ARGV do live[ARGV[i]] = true end
local function stray(id)
  if proc_of(id) ~= mine or live[id] then return false end
  return tonumber(string.match(id, '%.(%d+)$')) <= mark
end
for _, pair in ipairs(redis.call('SMEMBERS', P .. 'pairs')) do
  local h = held_key(pair)
  local all = redis.call('HGETALL', h)
  for i = 1, #all, 2 do
    if stray(all[i]) then
      redis.call('HDEL', h, all[i])
      bump('slots')
    end
  end
  local q = queue_key(pair)
  for _, w in ipairs(redis.call('LRANGE', q, 0, -1)) do
    if stray(w) then
      redis.call('LREM', q, 0, w)
      forget_waiter(w)
    end
  end
  local wk = watch_key(pair)
  for _, w in ipairs(redis.call('ZRANGE', wk, 0, -1)) do
    if stray(w) then
      redis.call('ZREM', wk, w)
      forget_waiter(w)
    end
  end
  hand_over(pair)
  tidy(pair)
end
return 1
"""
)
