-- The lease keeper's hand-back of a dead gateway's leases.
-- ARGV: clock_ms ('' in production: Redis TIME), lease ids...
-- The gateway process that held these leases has exited, so the kernel has closed its
-- upstream connections, and the keeper waited the engine's abort latency before this
-- call. Each listed lease that Redis still holds unexpired is marked expired now; the
-- next script on the pool purges it as it would a lapsed lease (held counts, tenant
-- lanes) and hands the slot on. A lease already released or expired is left alone.
-- Returns the number of leases marked.
local now
if ARGV[1] ~= '' then
  now = tonumber(ARGV[1])
else
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local marked = 0
for j = 2, #ARGV do
  local id = ARGV[j]
  local expiry = redis.call('ZSCORE', K_LEASES, id)
  if expiry and tonumber(expiry) > now then
    redis.call('ZADD', K_LEASES, 'XX', now, id)
    marked = marked + 1
  end
end
return marked
