-- The lease keeper's calls on one pool, independent of the gateway's event loop.
-- ARGV: op, ttl_ms, known generation, clock_ms ('' in production: Redis TIME), lease ids...
--
-- op 'keep': extends each listed lease that Redis still holds unexpired to now + ttl.
-- It never grants, re-asserts or revives anything: a lease that expired or is gone
-- stays gone (the gateway's own tick decides what that means), and nothing is handed
-- out. When the data generation is not the one the gateway knows (Redis lost its
-- data), it extends nothing: the tick re-asserts leases in that window.
-- Returns {'ok', missing lease ids} or {'generation', {}}.
--
-- op 'lapse': the hand-back of a dead gateway's leases (ttl_ms and the generation are
-- not read). The gateway process that held these leases has exited, so the kernel has
-- closed its upstream connections, and the keeper waited the engine's abort latency
-- before this call. Each listed lease that Redis still holds unexpired is marked
-- expired now; the next script on the pool purges it as it would a lapsed lease (held
-- counts, tenant lanes) and hands the slot on. A lease already released or expired is
-- left alone. Returns {'ok', lease ids not marked}.
local op, ttl, known = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local now
if ARGV[4] ~= '' then
  now = tonumber(ARGV[4])
else
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local until_ms = now
if op == 'keep' then
  local gen = redis.call('HGET', K_GEN, 'id')
  if not gen or gen ~= known then
    return {'generation', {}}
  end
  until_ms = now + ttl
elseif op ~= 'lapse' then
  return redis.error_reply('keep.lua: unknown op ' .. tostring(op))
end
local missing = {}
for j = 5, #ARGV do
  local id = ARGV[j]
  local expiry = redis.call('ZSCORE', K_LEASES, id)
  if expiry and tonumber(expiry) > now then
    redis.call('ZADD', K_LEASES, 'XX', until_ms, id)
  else
    missing[#missing + 1] = id
  end
end
return {'ok', missing}
