-- ARGV: id, ttl_ms, prefix, the scheduling context (common.lua), then the replica view.
-- The gateway gave up on the acquire (or hold) of id: Redis did not answer in time and
-- the session was refused, but the script may still run, or may have run, when Redis
-- answers again. Whatever it took goes back, and the id is marked gone for one lease
-- TTL so that an acquire or hold of it that runs later takes nothing. No session ran:
-- the tenant's lane is not charged. Returns 'left' (it held a queue place),
-- 'released' (it held a slot), 'shed' or 'gone' (it held nothing).
local id, ttl, prefix = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local ctx, at = ctx_of(4)
local view = view_of(at, #ARGV - at + 1)
local now = now_ms(ctx)
purge(now, ctx)
redis.call('ZADD', K_GONE, now + ttl, id)
local outcome = 'gone'
if redis.call('ZREM', K_QUEUE, id) == 1 then
  redis.call('ZREM', K_BEATS, id)
  redis.call('HDEL', K_TW, id)
  TQ = nil
  outcome = 'left'
end
if drop_lease(id, now, ctx, false) then
  outcome = 'released'
end
if redis.call('ZREM', K_SHED, id) == 1 then
  outcome = 'shed'
end
local _, blocked_until = generation(now, ttl)
assign(now, ttl, prefix, view, blocked_until, ctx)
return outcome
