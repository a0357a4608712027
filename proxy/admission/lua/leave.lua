-- ARGV: id, ttl_ms, prefix, then the replica view.
-- A waiter leaves the queue. Returns 'left' if it was waiting, 'granted' with the
-- replica if a slot had already been handed to it (the lease is kept: the caller
-- either uses it or releases it), or 'gone' if Redis no longer knows it.
local id, ttl, prefix = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local view = view_of(4, #ARGV - 3)
local now = now_ms()
-- Expired leases are gone first: a grant that lapsed is never reported as held.
purge(now)
if redis.call('ZREM', K_QUEUE, id) == 1 then
  redis.call('ZREM', K_BEATS, id)
  local _, blocked_until = generation(now, ttl)
  assign(now, ttl, prefix, view, blocked_until)
  return {'left'}
end
local replica = redis.call('HGET', K_OWNER, id)
if replica then
  -- The caller uses the slot now (or releases it): it holds a full TTL from here.
  redis.call('ZADD', K_LEASES, now + ttl, id)
  return {'granted', replica}
end
return {'gone'}
