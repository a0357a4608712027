-- ARGV: id, ttl_ms, prefix, from (the replica the caller holds the lease on),
--       n_exclude, exclude..., the scheduling context (common.lua), then the view.
-- Failover before the first byte: move the lease from `from` to another eligible
-- replica (least loaded, free slot, not `from`, not excluded) -- the placement rule of
-- PoolCore.relocate. The session keeps its admission, so this is not barging. The slot
-- it leaves goes to the head waiter if `from` is still in the view (not ejected).
-- Returns {'moved', replica} | {'stay', from} (nowhere to go, lease unchanged)
--       | {'gone'} (the lease expired or was never granted).
-- Idempotent: a retry after a lost reply finds the lease already moved and says so.
local id, ttl, prefix, from = ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[4]
local n = tonumber(ARGV[5])
local exclude = {[from] = true}
for i = 6, 5 + n do
  exclude[ARGV[i]] = true
end
local ctx, at = ctx_of(6 + n)
local view = view_of(at, #ARGV - at + 1)
local now = now_ms(ctx)
purge(now, ctx)
local owner = redis.call('HGET', K_OWNER, id)
if not owner then
  return {'gone'}
end
if owner ~= from then
  return {'moved', owner}
end
local _, blocked_until = generation(now, ttl)
if now < blocked_until then
  -- Held counts are incomplete until the gateways have re-asserted their leases.
  return {'stay', from}
end
local target = pick(view, now, exclude)
if not target then
  return {'stay', from}
end
redis.call('HINCRBY', K_HELD, from, -1)
redis.call('HSET', K_OWNER, id, target)
redis.call('HINCRBY', K_HELD, target, 1)
redis.call('ZADD', K_LEASES, now + ttl, id)
assign(now, ttl, prefix, view, blocked_until, ctx)
return {'moved', target}
