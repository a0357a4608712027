-- Shared part of every Headroom admission script (prepended to each one at load).
--
-- Every key of one pool shares the hash tag {<pool>} ('<prefix>{<pool>}:<name>'), so a
-- script touches one cluster slot. KEYS, in this order, for every script:
--   1 leases  zset   lease id -> expiry (ms, Redis clock)
--   2 owner   hash   lease id -> replica
--   3 held    hash   replica -> leases held (all gateways)
--   4 queue   zset   waiter id -> arrival sequence (the pool's FIFO)
--   5 beats   zset   waiter id -> heartbeat expiry (ms)
--   6 gen     hash   id, since: the data generation (recreated after a data loss)
--   7 seq     string arrival counter
--   8 flags   hash   'guard:<replica>' -> 'gateway=expiry ms,...'
--   9 tw      hash   waiter id -> 'priority weight max_queued name' (its tenant; '-'
--                    for a weight or max_queued it has not)
--  10 lanes   hash   '<priority>|<lane name>' -> 'charge weight' (fair-share lanes);
--                    'mean' -> the pool's observed mean session length (s, EWMA)
--  11 run     hash   lease id -> 'seq admitted_ms priority weight name' (its tenant)
--  12 shed    zset   waiter id -> expiry (ms): waiters refused preempted_in_queue
--  13 gone    zset   id -> expiry (ms): ids withdrawn by their gateway after it gave up
--                    on their acquire (withdraw.lua); a late acquire or hold of one is
--                    refused
--  14 moving never written. While the pool's slot migrates between cluster shards,
--                    this key is missing on both, so the source redirects the call and
--                    the target answers TRYAGAIN until the slot has moved (Redis serves
--                    a multi-key call in a migrating slot only if it holds every key):
--                    no script runs on a half-moved pool, and none writes a wake list
--                    the other shard holds.
-- Wake lists ('<prefix>wake:<gateway>') are named from ARGV but share the hash tag.
--
-- A replica view (the caller's configured, healthy, non-retired replicas, in
-- configuration order) is a flat list: name, cap, locally_guarded (0/1), ...
local K_LEASES, K_OWNER, K_HELD, K_QUEUE = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local K_BEATS, K_GEN, K_SEQ, K_FLAGS = KEYS[5], KEYS[6], KEYS[7], KEYS[8]
local K_TW, K_LANES, K_RUN, K_SHED = KEYS[9], KEYS[10], KEYS[11], KEYS[12]
local K_GONE = KEYS[13]

-- Every script's ARGV carries, after its own leading fields, a scheduling context:
--   clock_ms ('' in production: Redis TIME; a test's clock otherwise),
--   session_estimate_s (the pool's seed for the mean session length),
--   n_reserves, then (priority, slots, per_replica) per reserve.
-- Returns the context and the index of the next argument.
local function ctx_of(at)
  local ctx = {clock = ARGV[at], estimate = tonumber(ARGV[at + 1]), reserves = {}}
  local n = tonumber(ARGV[at + 2])
  for j = at + 3, at + 2 + 3 * n, 3 do
    ctx.reserves[#ctx.reserves + 1] = {
      priority = tonumber(ARGV[j]), slots = tonumber(ARGV[j + 1]),
      per_replica = tonumber(ARGV[j + 2])}
  end
  return ctx, at + 3 + 3 * n
end

local function now_ms(ctx)
  if ctx and ctx.clock ~= '' then
    return tonumber(ctx.clock)
  end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- Tenants: the rules of proxy/admission/tenants.py (TenantQueue) and of
-- PoolCore's reserves, ported line for line so both backends decide alike (a
-- differential test drives both with the same operations). Times in seconds are
-- ms / 1000, as the test's PoolCore sees them; floats are stored with 17 digits so
-- they come back exact.
local EWMA_ALPHA, MIN_MEAN_S = 0.1, 0.05  -- proxy/admission/retry_after.py

local function fmt(x)
  return string.format('%.17g', x)
end

-- A tenant: {priority, weight (nil: the class's shared lane), max_queued, name}.
local function tenant_of(raw)
  if not raw then
    return {priority = 0, weight = nil, max_queued = nil, name = ''}
  end
  local p, w, q, name = string.match(raw, '^(%S+) (%S+) (%S+) (.*)$')
  return {priority = tonumber(p), weight = tonumber(w), max_queued = tonumber(q), name = name}
end

local function tenant_raw(t)
  return t.priority .. ' ' .. (t.weight and fmt(t.weight) or '-') .. ' '
    .. (t.max_queued or '-') .. ' ' .. t.name
end

local function lane_key(t)
  return t.priority .. '|' .. (t.weight and t.name or '')
end

local function session_mean(ctx)
  return tonumber(redis.call('HGET', K_LANES, 'mean') or '') or ctx.estimate
end

-- SessionLengths.observe
local function observe_length(ctx, duration_s)
  local mean = session_mean(ctx)
  local delta = math.max(0, duration_s) - mean
  mean = math.max(MIN_MEAN_S, mean + EWMA_ALPHA * delta)
  redis.call('HSET', K_LANES, 'mean', fmt(mean))
end

-- The tenant state of the pool, loaded once per script call when a rule needs it
-- (TQ): waiters in arrival order, lanes with their queues and running sessions.
local TQ = nil

local function lane_get(st, key, weight)
  local lane = st.lanes[key]
  if not lane then
    lane = {key = key, priority = tonumber(string.match(key, '^([^|]*)|')),
            charge = 0, weight = weight or 1, queue = {}, running = {}}
    st.lanes[key] = lane
  end
  return lane
end

local function tq_load(ctx)
  if TQ then
    return TQ
  end
  local st = {waiters = {}, order = {}, lanes = {}, mean = session_mean(ctx), top = 0}
  local raw = redis.call('HGETALL', K_LANES)
  for j = 1, #raw, 2 do
    if raw[j] ~= 'mean' then
      local c, w = string.match(raw[j + 1], '^(%S+) (%S+)$')
      local lane = lane_get(st, raw[j], tonumber(w))
      lane.charge = tonumber(c)
    end
  end
  local runs = {}
  raw = redis.call('HGETALL', K_RUN)
  for j = 1, #raw, 2 do
    if redis.call('HEXISTS', K_OWNER, raw[j]) == 1 then
      local seq, ms, rest = string.match(raw[j + 1], '^(%S+) (%S+) (.*)$')
      runs[#runs + 1] = {id = raw[j], seq = tonumber(seq), t = tonumber(ms) / 1000,
                         tenant = tenant_of(rest)}
    else  -- released by a script that does not charge (an older gateway's)
      redis.call('HDEL', K_RUN, raw[j])
    end
  end
  table.sort(runs, function(a, b) return a.seq < b.seq end)
  for _, r in ipairs(runs) do
    local lane = lane_get(st, lane_key(r.tenant), r.tenant.weight)
    lane.running[#lane.running + 1] = r
  end
  local queued = redis.call('ZRANGE', K_QUEUE, 0, -1, 'WITHSCORES')
  for j = 1, #queued, 400 do
    local ids = {}
    for k = j, math.min(j + 398, #queued - 1), 2 do
      ids[#ids + 1] = queued[k]
    end
    local fields = redis.call('HMGET', K_TW, unpack(ids))
    for k, id in ipairs(ids) do
      local w = {id = id, seq = tonumber(queued[j + 2 * k - 1]), tenant = tenant_of(fields[k])}
      st.waiters[id] = w
      st.order[#st.order + 1] = w
      local lane = lane_get(st, lane_key(w.tenant), w.tenant.weight)
      lane.queue[#lane.queue + 1] = w
    end
  end
  st.top = tonumber(redis.call('GET', K_SEQ) or '0')
  TQ = st
  return st
end

local function lane_vtime(lane, now_s, mean)
  local held = 0
  for _, r in ipairs(lane.running) do
    held = held + math.max(now_s - r.t, mean)
  end
  return lane.charge + held / lane.weight
end

local function lane_save(lane)
  redis.call('HSET', K_LANES, lane.key, fmt(lane.charge) .. ' ' .. fmt(lane.weight))
end

-- TenantQueue._lane: the tenant's lane, its weight brought up to date (a reload).
local function tq_lane(st, t)
  local key = lane_key(t)
  local weight = t.weight or 1
  local lane = st.lanes[key]
  if not lane then
    lane = lane_get(st, key, weight)
    lane_save(lane)
  elseif lane.weight ~= weight then
    lane.charge = lane.charge * lane.weight / weight
    lane.weight = weight
    lane_save(lane)
  end
  return lane
end

-- TenantQueue._floor: the least virtual time of the other lanes waiting in the class.
local function tq_floor(st, key, priority, now_s, default)
  local found = nil
  for k, lane in pairs(st.lanes) do
    if lane.priority == priority and k ~= key and #lane.queue > 0 then
      local v = lane_vtime(lane, now_s, st.mean)
      if found == nil or v < found then
        found = v
      end
    end
  end
  if found == nil then
    return default
  end
  return found
end

-- TenantQueue.push (rule 4: a lane that had nothing waiting banks no credit).
local function tq_push(st, id, seq, t, now_s)
  local lane = tq_lane(st, t)
  if #lane.queue == 0 then
    local own = lane_vtime(lane, now_s, st.mean)
    local floor = tq_floor(st, lane.key, t.priority, now_s, own)
    if floor > own then
      lane.charge = lane.charge + (floor - own)
      lane_save(lane)
    end
  end
  local w = {id = id, seq = seq, tenant = t}
  st.waiters[id] = w
  st.order[#st.order + 1] = w
  lane.queue[#lane.queue + 1] = w
  if seq > st.top then
    st.top = seq
  end
  redis.call('HSET', K_TW, id, tenant_raw(t))
end

local function tq_remove(st, id)
  local w = st.waiters[id]
  if not w then
    return nil
  end
  st.waiters[id] = nil
  for j, x in ipairs(st.order) do
    if x == w then
      table.remove(st.order, j)
      break
    end
  end
  local lane = st.lanes[lane_key(w.tenant)]
  for j, x in ipairs(lane.queue) do
    if x == w then
      table.remove(lane.queue, j)
      break
    end
  end
  redis.call('HDEL', K_TW, id)
  return w
end

-- TenantQueue.head: highest class, then least virtual time, then earliest arrival.
local function tq_head(st, now_s)
  local best, bp, bv, bs = nil, nil, nil, nil
  for _, lane in pairs(st.lanes) do
    local first = lane.queue[1]
    if first then
      local p, v, s = lane.priority, lane_vtime(lane, now_s, st.mean), first.seq
      if best == nil or p > bp or (p == bp and (v < bv or (v == bv and s < bs))) then
        best, bp, bv, bs = first, p, v, s
      end
    end
  end
  return best
end

-- TenantQueue.victim: the newest waiter of the lowest sheddable class below priority.
local function tq_victim(st, priority)
  local found = nil
  for _, w in ipairs(st.order) do
    local p = w.tenant.priority
    if p < 0 and p < priority and (found == nil or p < found.tenant.priority
        or (p == found.tenant.priority and w.seq > found.seq)) then
      found = w
    end
  end
  return found
end

local function tq_waiting_at_or_above(st, priority)
  for _, w in ipairs(st.order) do
    if w.tenant.priority >= priority then
      return true
    end
  end
  return false
end

local function tq_queued_by(st, name)
  local n = 0
  for _, w in ipairs(st.order) do
    if w.tenant.name == name then
      n = n + 1
    end
  end
  return n
end

-- TenantQueue.order: waiters in projected service order (classes from the highest;
-- within one, lanes interleaved by virtual time, each waiter advancing its lane by
-- mean / weight). newcomer: a phantom waiter of that tenant (id false) placed too.
local function tq_order(st, now_s, newcomer)
  local lanes = {}
  for k, lane in pairs(st.lanes) do
    if #lane.queue > 0 then
      local q = {}
      for j, w in ipairs(lane.queue) do
        q[j] = w
      end
      lanes[k] = {priority = lane.priority, q = q, weight = lane.weight,
                  v = lane_vtime(lane, now_s, st.mean)}
    end
  end
  if newcomer then
    local key = lane_key(newcomer)
    if not lanes[key] then
      local lane = st.lanes[key]
      local own = 0
      if lane then
        own = lane_vtime(lane, now_s, st.mean)
      end
      lanes[key] = {priority = newcomer.priority, q = {},
                    weight = lane and lane.weight or (newcomer.weight or 1),
                    v = math.max(own, tq_floor(st, key, newcomer.priority, now_s, own))}
    end
    lanes[key].q[#lanes[key].q + 1] = {id = false, seq = st.top + 1}
  end
  local classes, seen = {}, {}
  for _, l in pairs(lanes) do
    if not seen[l.priority] then
      seen[l.priority] = true
      classes[#classes + 1] = l.priority
    end
  end
  table.sort(classes, function(a, b) return a > b end)
  local out = {}
  for _, priority in ipairs(classes) do
    local live = {}
    for _, l in pairs(lanes) do
      if l.priority == priority then
        l.cursor = 1
        live[#live + 1] = l
      end
    end
    while #live > 0 do
      local bj = 1
      for j = 2, #live do
        local a, b = live[j], live[bj]
        local sa, sb = a.q[a.cursor].seq, b.q[b.cursor].seq
        if a.v < b.v or (a.v == b.v and sa < sb) then
          bj = j
        end
      end
      local l = live[bj]
      out[#out + 1] = l.q[l.cursor].id
      l.cursor = l.cursor + 1
      if l.cursor > #l.q then
        table.remove(live, bj)
      else
        l.v = l.v + st.mean / l.weight
      end
    end
  end
  return out
end

-- 1-based rank of a waiter in tq_order (false: the newcomer's phantom).
local function rank_in(order, id)
  for j, x in ipairs(order) do
    if x == id then
      return j
    end
  end
  return nil
end

-- TenantQueue.admitted: a session of tenant t holds a slot from now (ms).
local function tq_admitted(id, t, now)
  local st = TQ
  local seq = redis.call('INCR', K_SEQ)
  redis.call('HSET', K_RUN, id, seq .. ' ' .. now .. ' ' .. tenant_raw(t))
  if st then
    local lane = tq_lane(st, t)
    lane.running[#lane.running + 1] = {id = id, seq = seq, t = now / 1000, tenant = t}
    st.top = seq
  else
    -- the lane exists with the tenant's current weight (TenantQueue._lane)
    local key = lane_key(t)
    local weight = t.weight or 1
    local raw = redis.call('HGET', K_LANES, key)
    if not raw then
      redis.call('HSET', K_LANES, key, fmt(0) .. ' ' .. fmt(weight))
    else
      local c, w = string.match(raw, '^(%S+) (%S+)$')
      c, w = tonumber(c), tonumber(w)
      if w ~= weight then
        redis.call('HSET', K_LANES, key, fmt(c * w / weight) .. ' ' .. fmt(weight))
      end
    end
  end
end

-- TenantQueue.released: the session ended at until (ms); its lane is charged its
-- length over the lane's weight; observe: the length also feeds the mean.
local function tq_released(ctx, id, until_ms, observe)
  local raw = redis.call('HGET', K_RUN, id)
  if not raw then
    return
  end
  redis.call('HDEL', K_RUN, id)
  TQ = nil  -- reloaded by the next rule that needs it
  local _, ms, rest = string.match(raw, '^(%S+) (%S+) (.*)$')
  local t = tenant_of(rest)
  local held = until_ms / 1000 - tonumber(ms) / 1000
  local key = lane_key(t)
  local lraw = redis.call('HGET', K_LANES, key)
  local c, w = 0, t.weight or 1
  if lraw then
    local cs, ws = string.match(lraw, '^(%S+) (%S+)$')
    c, w = tonumber(cs), tonumber(ws)
  end
  redis.call('HSET', K_LANES, key, fmt(c + held / w) .. ' ' .. fmt(w))
  if observe then
    observe_length(ctx, held)
  end
end

-- An expired lease's lane is charged up to its expiry (not observed as a length).
local function purge(now, ctx)
  local dead = redis.call('ZRANGEBYSCORE', K_LEASES, '-inf', now, 'WITHSCORES')
  for j = 1, #dead, 2 do
    local id = dead[j]
    local replica = redis.call('HGET', K_OWNER, id)
    if replica then
      redis.call('HINCRBY', K_HELD, replica, -1)
      redis.call('HDEL', K_OWNER, id)
    end
    redis.call('ZREM', K_LEASES, id)
    tq_released(ctx, id, tonumber(dead[j + 1]), false)
  end
  local gone = redis.call('ZRANGEBYSCORE', K_BEATS, '-inf', now)
  for _, w in ipairs(gone) do
    redis.call('ZREM', K_QUEUE, w)
    redis.call('ZREM', K_BEATS, w)
    redis.call('HDEL', K_TW, w)
  end
  if #gone > 0 then
    TQ = nil
  end
  redis.call('ZREMRANGEBYSCORE', K_SHED, '-inf', now)
  redis.call('ZREMRANGEBYSCORE', K_GONE, '-inf', now)
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

-- The placement rule of proxy/admission/pool_core.py (PoolCore._pick): the least loaded
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

-- PoolCore._may_take: a session of class priority keeps every reserve above it
-- (reserve_allows), counted over the usable replicas (in the view, not guarded).
local function may_take(priority, view, now, ctx)
  if #ctx.reserves == 0 then
    return true
  end
  local usable, n_usable, capacity = {}, 0, 0
  for i = 1, #view, 3 do
    if view[i + 2] == '0' and not guarded(view[i], now) then
      usable[view[i]] = true
      n_usable = n_usable + 1
      capacity = capacity + tonumber(view[i + 1])
    end
  end
  local classes = {}
  local owners = redis.call('HGETALL', K_OWNER)
  for j = 1, #owners, 2 do
    if usable[owners[j + 1]] then
      local raw = redis.call('HGET', K_RUN, owners[j])
      local p = 0
      if raw then
        p = tonumber(string.match(raw, '^%S+ %S+ (%S+)'))
      end
      classes[#classes + 1] = p
    end
  end
  local levels, seen = {}, {}
  for _, r in ipairs(ctx.reserves) do
    if r.priority > priority and not seen[r.priority] then
      seen[r.priority] = true
      levels[#levels + 1] = r.priority
    end
  end
  table.sort(levels)
  for _, level in ipairs(levels) do
    local kept = 0
    for _, r in ipairs(ctx.reserves) do
      if r.priority > level - 1 then
        kept = kept + r.slots + r.per_replica * n_usable
      end
    end
    local below = 0
    for _, c in ipairs(classes) do
      if c < level then
        below = below + 1
      end
    end
    if below >= capacity - kept then
      return false
    end
  end
  return true
end

-- Expired leases give their slots back; waiters whose gateway stopped beating leave.
local function grant(id, replica, now, ttl)
  redis.call('ZADD', K_LEASES, now + ttl, id)
  redis.call('HSET', K_OWNER, id, replica)
  redis.call('HINCRBY', K_HELD, replica, 1)
end

-- The lease ends at now: its slot frees. ``ran`` says a session used it, so its lane
-- is charged its length and the pool's mean session length observes it (a release);
-- false for a lease whose session never ran (a withdrawn acquire).
local function drop_lease(id, now, ctx, ran)
  local replica = redis.call('HGET', K_OWNER, id)
  if not replica then
    return false
  end
  redis.call('HINCRBY', K_HELD, replica, -1)
  redis.call('HDEL', K_OWNER, id)
  redis.call('ZREM', K_LEASES, id)
  tq_released(ctx, id, now, ran)
  return true
end

-- Tell a waiter's gateway (its wake list) what became of it: '<waiter> <replica>' for
-- a slot, '<waiter> !<reason> <position>' for a refusal.
local function wake(prefix, id, message, ttl)
  local gateway = string.match(id, '^(.*):[^:]*$')
  local key = prefix .. 'wake:' .. gateway
  redis.call('RPUSH', key, id .. ' ' .. message)
  redis.call('PEXPIRE', key, ttl)
end

-- Hand free slots to the waiters the tenant rules serve next (direct hand-off, no
-- barging; PoolCore._assign): if the head may not take a slot (reserves) or none is
-- free, nobody behind it may either. Each one's gateway is woken through its list.
local function assign(now, ttl, prefix, view, blocked_until, ctx)
  if now < blocked_until or redis.call('ZCARD', K_QUEUE) == 0 then
    return
  end
  local st = tq_load(ctx)
  while true do
    local head = tq_head(st, now / 1000)
    if not head then
      return
    end
    if not may_take(head.tenant.priority, view, now, ctx) then
      return
    end
    local replica = pick(view, now, nil)
    if not replica then
      return
    end
    tq_remove(st, head.id)
    redis.call('ZREM', K_QUEUE, head.id)
    redis.call('ZREM', K_BEATS, head.id)
    grant(head.id, replica, now, ttl)
    tq_admitted(head.id, head.tenant, now)
    wake(prefix, head.id, replica, ttl)
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
