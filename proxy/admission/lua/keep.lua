-- The lease keeper's renewal of one pool, independent of the gateway's event loop.
-- ARGV: ttl_ms, known generation, clock_ms ('' in production: Redis TIME), lease ids...
-- Extends each listed lease that Redis still holds unexpired to now + ttl. It never
-- grants, re-asserts or revives anything: a lease that expired or is gone stays gone
-- (the gateway's own tick decides what that means), and nothing is handed out.
-- When the data generation is not the one the gateway knows (Redis lost its data),
-- it extends nothing: the tick re-asserts leases in that window.
-- Returns {'ok', missing lease ids} or {'generation', {}}.
local ttl, known = tonumber(ARGV[1]), ARGV[2]
local now
if ARGV[3] ~= '' then
  now = tonumber(ARGV[3])
else
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local gen = redis.call('HGET', K_GEN, 'id')
if not gen or gen ~= known then
  return {'generation', {}}
end
local missing = {}
for j = 4, #ARGV do
  local id = ARGV[j]
  local expiry = redis.call('ZSCORE', K_LEASES, id)
  if expiry and tonumber(expiry) > now then
    redis.call('ZADD', K_LEASES, 'XX', now + ttl, id)
  else
    missing[#missing + 1] = id
  end
end
return {'ok', missing}
