-- Tenant quotas (an API key's max_sessions) counted over every gateway.
--
-- KEYS: one sorted set per tenant, reservation id -> expiry (ms, Redis clock), all
-- under the hash tag {<prefix>tenants} (one cluster slot, apart from the pools': a
-- tenant's sessions span pools). Each session reserves before it asks its pool for a
-- slot (queued sessions count, as in TenantQuotas), the owning gateway renews its
-- reservations with its leases, and a reservation nobody renews expires, so a crashed
-- gateway's sessions stop counting within one lease TTL. The tenant's key expires with
-- its last reservation.
--
-- ARGV[1] = op:
--   'reserve', id, max, ttl_ms  (KEYS[1] the tenant)
--       -> {'ok', active} | {'limit', active}; idempotent per id
--   'release', id               (KEYS[1] the tenant) -> 1 if it was held, else 0
--   'renew', ttl_ms, then per key: count, ids...  -> number of reservations renewed
--   'active'                    (KEYS[1] the tenant) -> its unexpired reservations, on
--       the clock of the shard that holds them
local op = ARGV[1]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

-- The set lives until its last reservation expires (a gang reservation's slots may be
-- held longer than one lease TTL: reservations.lua), never shorter.
local function expire_with_last(key)
  local last = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
  if #last == 2 then
    redis.call('PEXPIREAT', key, math.max(tonumber(last[2]), now + 1))
  end
end

if op == 'reserve' then
  local key, id, max, ttl = KEYS[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
  local active = redis.call('ZCARD', key)
  if not redis.call('ZSCORE', key, id) then
    -- The rule of TenantQuotas.reserve: refused once the tenant holds max sessions.
    if active >= max then
      return {'limit', active}
    end
    active = active + 1
  end
  redis.call('ZADD', key, now + ttl, id)
  expire_with_last(key)
  return {'ok', active}
elseif op == 'release' then
  return redis.call('ZREM', KEYS[1], ARGV[2])
elseif op == 'renew' then
  local ttl = tonumber(ARGV[2])
  local at, renewed = 3, 0
  for k = 1, #KEYS do
    local n = tonumber(ARGV[at])
    for i = at + 1, at + n do
      -- Re-added even if it had expired (a paused gateway) or Redis lost it: the
      -- session is live, and the quota counts live sessions.
      redis.call('ZADD', KEYS[k], now + ttl, ARGV[i])
    end
    expire_with_last(KEYS[k])
    renewed = renewed + n
    at = at + n + 1
  end
  return renewed
elseif op == 'active' then
  return redis.call('ZCOUNT', KEYS[1], '(' .. now, '+inf')
end
return redis.error_reply('tenants.lua: unknown op ' .. tostring(op))
