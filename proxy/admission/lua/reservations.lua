-- Gang reservations kept in Redis, so that any gateway (or worker) can claim them
-- (proxy/admission/shared_reservations.py). Not a pool script (no prelude): its keys
-- share the tenants' hash tag {<prefix>tenants}, so a reservation and its key's quota
-- change in one atomic step.
--
-- KEYS[1] the reservation: hash  'key' (API key name, '' without auth), 'tenant' (the
--         quota's name, '' if the key has no max_sessions), 'deadline' (ms, Redis
--         clock), 'pools' (space separated), 'slot:<pool>' -> lease id while unclaimed,
--         'ended' -> why, once nothing is left to claim. Named by the SHA-256 of the
--         token (the token itself is never stored). Kept keep_ms past its deadline,
--         so a late claim hears "expired", not "unknown".
-- KEYS[2] the key's reservations with unclaimed slots: zset  digest -> deadline
-- KEYS[3] the key's quota (tenants.lua's set): lease id -> expiry. A reserved slot
--         counts from the reservation until it is claimed (then as its session, renewed
--         by the claiming gateway), released or past the deadline.
--
-- ARGV[1] = op:
--   'open', digest, key, tenant, max_sessions (0: none), max_live (0: none), hold_ms, keep_ms,
--           then (pool, lease id) pairs
--       -> {'ok'} | {'live_limit', live} | {'tenant_limit', slots that fit}
--   'abort', digest                       -> 1 (the reservation never reached a client)
--   'claim', digest, key, pool, ttl_ms    -> {'ok', lease id} | {'unknown'}
--       | {'expired', why} | {'pool', 'already in use' | 'not reserved'}
--   'release', digest, key, why           -> {'ok', pool, lease id, ...} (the unclaimed
--       slots, now the caller's to release in their pools) | {'ended'} | {'unknown'}
local op = ARGV[1]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local K_REC, K_LIVE, K_QUOTA = KEYS[1], KEYS[2], KEYS[3]

-- A set whose members carry their expiry as score lives until its last one expires.
local function expire_with_last(key)
  local last = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
  if #last == 2 then
    redis.call('PEXPIREAT', key, math.max(tonumber(last[2]), now + 1))
  end
end

-- The unclaimed slots: {pool, lease id, ...}.
local function unclaimed()
  local out = {}
  local raw = redis.call('HGETALL', K_REC)
  for j = 1, #raw, 2 do
    local pool = string.match(raw[j], '^slot:(.*)$')
    if pool then
      out[#out + 1] = pool
      out[#out + 1] = raw[j + 1]
    end
  end
  return out
end

-- Nothing is left to claim: the slots given back stop counting against the quota.
local function finish(digest, tenant, taken, why)
  for j = 1, #taken, 2 do
    redis.call('HDEL', K_REC, 'slot:' .. taken[j])
    if tenant ~= '' then
      redis.call('ZREM', K_QUOTA, taken[j + 1])
    end
  end
  redis.call('HSET', K_REC, 'ended', why)
  redis.call('ZREM', K_LIVE, digest)
end

if op == 'open' then
  local digest, key, tenant = ARGV[2], ARGV[3], ARGV[4]
  local max_sessions, max_live = tonumber(ARGV[5]), tonumber(ARGV[6])
  local hold, keep = tonumber(ARGV[7]), tonumber(ARGV[8])
  local deadline = now + hold
  redis.call('ZREMRANGEBYSCORE', K_LIVE, '-inf', now)
  local live = redis.call('ZCARD', K_LIVE)
  if max_live > 0 and live >= max_live then
    return {'live_limit', live}
  end
  local n = (#ARGV - 8) / 2
  if tenant ~= '' then
    -- The rule of tenants.lua's reserve, for every slot at once.
    redis.call('ZREMRANGEBYSCORE', K_QUOTA, '-inf', now)
    local active = redis.call('ZCARD', K_QUOTA)
    if active + n > max_sessions then
      return {'tenant_limit', math.max(0, max_sessions - active)}
    end
  end
  local pools = {}
  for j = 9, #ARGV, 2 do
    pools[#pools + 1] = ARGV[j]
    redis.call('HSET', K_REC, 'slot:' .. ARGV[j], ARGV[j + 1])
    if tenant ~= '' then
      redis.call('ZADD', K_QUOTA, deadline, ARGV[j + 1])
    end
  end
  if tenant ~= '' then
    expire_with_last(K_QUOTA)
  end
  redis.call('HSET', K_REC, 'key', key, 'tenant', tenant, 'deadline', deadline,
             'pools', table.concat(pools, ' '))
  redis.call('PEXPIREAT', K_REC, deadline + keep)
  redis.call('ZADD', K_LIVE, deadline, digest)
  expire_with_last(K_LIVE)
  return {'ok'}
elseif op == 'abort' then
  local tenant = redis.call('HGET', K_REC, 'tenant')
  if tenant then
    finish(ARGV[2], tenant, unclaimed(), 'aborted')
  end
  redis.call('DEL', K_REC)
  return 1
elseif op == 'claim' then
  local digest, key, pool, ttl = ARGV[2], ARGV[3], ARGV[4], tonumber(ARGV[5])
  local rec = redis.call('HMGET', K_REC, 'key', 'tenant', 'deadline', 'pools', 'ended')
  if not rec[1] or rec[1] ~= key then
    return {'unknown'}
  end
  if rec[5] then
    return {'expired', rec[5]}
  end
  if tonumber(rec[3]) <= now then
    finish(digest, rec[2], unclaimed(), 'expired after its hold_s')
    return {'expired', 'expired after its hold_s'}
  end
  local id = redis.call('HGET', K_REC, 'slot:' .. pool)
  if not id then
    for p in string.gmatch(rec[4], '%S+') do
      if p == pool then
        return {'pool', 'already in use'}
      end
    end
    return {'pool', 'not reserved'}
  end
  redis.call('HDEL', K_REC, 'slot:' .. pool)
  if rec[2] ~= '' then
    -- From now on the session's: its gateway renews it with its leases.
    redis.call('ZADD', K_QUOTA, now + ttl, id)
    expire_with_last(K_QUOTA)
  end
  if #unclaimed() == 0 then
    finish(digest, rec[2], {}, 'fully used')
  end
  return {'ok', id}
elseif op == 'release' then
  local digest, key, why = ARGV[2], ARGV[3], ARGV[4]
  local rec = redis.call('HMGET', K_REC, 'key', 'tenant', 'ended')
  if not rec[1] or rec[1] ~= key then
    return {'unknown'}
  end
  if rec[3] then
    return {'ended'}
  end
  local taken = unclaimed()
  finish(digest, rec[2], taken, why)
  local out = {'ok'}
  for _, x in ipairs(taken) do
    out[#out + 1] = x
  end
  return out
end
return redis.error_reply('reservations.lua: unknown op ' .. tostring(op))
