-- ARGV: id, ttl_ms, prefix, the scheduling context (common.lua), then the replica view.
-- A waiter leaves the queue. Returns 'left' if it was waiting, 'granted' with the
-- replica if a slot had already been handed to it (the lease is kept: the caller
-- either uses it or releases it), 'shed' if it had been refused preempted_in_queue,
-- or 'gone' if Redis no longer knows it.
local id, ttl, prefix = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local ctx, at = ctx_of(4)
local view = view_of(at, #ARGV - at + 1)
local now = now_ms(ctx)
-- Expired leases are gone first: a grant that lapsed is never reported as held.
purge(now, ctx)
if redis.call('ZREM', K_QUEUE, id) == 1 then
  redis.call('ZREM', K_BEATS, id)
  redis.call('HDEL', K_TW, id)
  TQ = nil
  local _, blocked_until = generation(now, ttl)
  assign(now, ttl, prefix, view, blocked_until, ctx)
  return {'left'}
end
local replica = redis.call('HGET', K_OWNER, id)
if replica then
  -- The caller uses the slot now (or releases it): it holds a full TTL from here.
  redis.call('ZADD', K_LEASES, now + ttl, id)
  return {'granted', replica}
end
if redis.call('ZREM', K_SHED, id) == 1 then
  return {'shed'}
end
return {'gone'}
