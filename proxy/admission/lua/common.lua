-- Shared part of every Headroom admission script (prepended to each one at load).
--
-- Every key of one pool shares the hash tag {<prefix>:<pool>}, so a script touches
-- one cluster slot. KEYS, in this order, for every script:
--   1 leases  zset   lease id -> expiry (ms, Redis clock)
--   2 owner   hash   lease id -> replica
--   3 held    hash   replica -> leases held (all gateways)
--   4 queue   zset   waiter id -> arrival sequence (the pool's FIFO)
--   5 beats   zset   waiter id -> heartbeat expiry (ms)
--   6 gen     hash   id, since: the data generation (recreated after a data loss)
--   7 seq     string arrival counter
--   8 flags   hash   'guard:<replica>' -> 'gateway=expiry ms,...'
-- Wake lists ('<prefix>wake:<gateway>') are named from ARGV but share the hash tag.
--
-- A replica view (the caller's configured, healthy, non-retired replicas, in
-- configuration order) is a flat list: name, cap, locally_guarded (0/1), ...
local K_LEASES, K_OWNER, K_HELD, K_QUEUE = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local K_BEATS, K_GEN, K_SEQ, K_FLAGS = KEYS[5], KEYS[6], KEYS[7], KEYS[8]

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- Expired leases give their slots back; waiters whose gateway stopped beating leave.
local function purge(now)
  local dead = redis.call('ZRANGEBYSCORE', K_LEASES, '-inf', now)
  for _, id in ipairs(dead) do
    local replica = redis.call('HGET', K_OWNER, id)
    if replica then
      redis.call('HINCRBY', K_HELD, replica, -1)
      redis.call('HDEL', K_OWNER, id)
    end
    redis.call('ZREM', K_LEASES, id)
  end
  local gone = redis.call('ZRANGEBYSCORE', K_BEATS, '-inf', now)
  for _, w in ipairs(gone) do
    redis.call('ZREM', K_QUEUE, w)
    redis.call('ZREM', K_BEATS, w)
  end
end

-- The data generation. A missing key means Redis lost its data (or never had any):
-- start a new generation and block grants for one lease TTL, so that surviving
-- gateways re-assert their live leases before any slot is handed out again.
-- Returns the generation id and the time until which grants are blocked.
local function generation(now, ttl)
  local g = redis.call('HMGET', K_GEN, 'id', 'since')
  if not g[1] then
    redis.call('HSET', K_GEN, 'id', tostring(now), 'since', now)
    return tostring(now), now + ttl
  end
  return g[1], tonumber(g[2]) + ttl
end

-- A guard flag holds, per gateway whose guard engaged, an expiry: 'gw=ms,gw=ms'.
-- A replica is guarded while any of them is in the future.
local function guard_entries(replica)
  local entries = {}
  local raw = redis.call('HGET', K_FLAGS, 'guard:' .. replica)
  if raw then
    for gateway, until_ms in string.gmatch(raw, '([^=,]+)=(%d+)') do
      entries[gateway] = tonumber(until_ms)
    end
  end
  return entries
end

local function guarded(replica, now)
  for _, until_ms in pairs(guard_entries(replica)) do
    if until_ms > now then
      return true
    end
  end
  return false
end

-- Set (until_ms) or clear (nil) one gateway's guard on a replica.
local function set_guard(replica, gateway, until_ms, now)
  local entries = guard_entries(replica)
  if entries[gateway] == until_ms then
    return
  end
  entries[gateway] = until_ms
  local parts = {}
  for g, u in pairs(entries) do
    if u > now then
      parts[#parts + 1] = g .. '=' .. u
    end
  end
  if #parts == 0 then
    redis.call('HDEL', K_FLAGS, 'guard:' .. replica)
  else
    redis.call('HSET', K_FLAGS, 'guard:' .. replica, table.concat(parts, ','))
  end
end

-- The placement rule of proxy/admission/core.py (PoolCore._pick): the least loaded
-- (held / cap, then held) eligible replica with a free slot; ties go to the first
-- in configuration order. exclude: nil, or a set {replica = true} never picked.
local function pick(view, now, exclude)
  local best, best_ratio, best_held = nil, 2.0, 0
  for i = 1, #view, 3 do
    local replica, cap = view[i], tonumber(view[i + 1])
    if not (exclude and exclude[replica]) and view[i + 2] == '0'
        and not guarded(replica, now) then
      local held = tonumber(redis.call('HGET', K_HELD, replica) or '0')
      if held < cap then
        local ratio = held / cap
        if ratio < best_ratio or (ratio == best_ratio and held < best_held) then
          best, best_ratio, best_held = replica, ratio, held
        end
      end
    end
  end
  return best
end

-- 'pool_full', or 'guard' when a guarded replica still had a free slot.
local function full_reason(view, now)
  for i = 1, #view, 3 do
    local replica, cap = view[i], tonumber(view[i + 1])
    local held = tonumber(redis.call('HGET', K_HELD, replica) or '0')
    if held < cap and (view[i + 2] == '1' or guarded(replica, now)) then
      return 'guard'
    end
  end
  return 'pool_full'
end

local function grant(id, replica, now, ttl)
  redis.call('ZADD', K_LEASES, now + ttl, id)
  redis.call('HSET', K_OWNER, id, replica)
  redis.call('HINCRBY', K_HELD, replica, 1)
end

local function drop_lease(id)
  local replica = redis.call('HGET', K_OWNER, id)
  if not replica then
    return false
  end
  redis.call('HINCRBY', K_HELD, replica, -1)
  redis.call('HDEL', K_OWNER, id)
  redis.call('ZREM', K_LEASES, id)
  return true
end

-- Hand free slots to the head waiters (direct hand-off, no barging) and wake each
-- one's gateway by pushing '<waiter> <replica>' onto that gateway's wake list.
local function assign(now, ttl, prefix, view, blocked_until)
  if now < blocked_until then
    return
  end
  while true do
    local head = redis.call('ZRANGE', K_QUEUE, 0, 0)[1]
    if not head then
      return
    end
    local replica = pick(view, now, nil)
    if not replica then
      return
    end
    redis.call('ZREM', K_QUEUE, head)
    redis.call('ZREM', K_BEATS, head)
    grant(head, replica, now, ttl)
    local gateway = string.match(head, '^(.*):[^:]*$')
    local wake = prefix .. 'wake:' .. gateway
    redis.call('RPUSH', wake, head .. ' ' .. replica)
    redis.call('PEXPIRE', wake, ttl)
  end
end

-- ARGV[from..to] as a replica view.
local function view_of(from, count)
  local view = {}
  for i = from, from + count - 1 do
    view[#view + 1] = ARGV[i]
  end
  return view
end
