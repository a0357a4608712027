-- ARGV: id, ttl_ms, hold_ms, prefix, the scheduling context (common.lua), the tenant
--       (priority, weight or '-', max_queued or '-', name), then the replica view.
-- One slot for a gang reservation, now or never (never a queue place): the decision of
-- acquire.lua for a newcomer of this tenant's class (newcomer.lua's take_now) but the
-- lease expires at now + hold_ms, the reservation's deadline: no gateway renews it until
-- a stage connection claims it (its gateway then confirms it with leave.lua and renews
-- it).
-- Returns {'admit', replica} | {'reject', reason, position} | {'blocked', ms}.
-- Idempotent per id: a retry after a lost reply gets the same slot.
local id, ttl, hold, prefix = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4]
local ctx, at = ctx_of(5)
local tenant, view = newcomer_of(at)
local now = now_ms(ctx)
purge(now, ctx)
if redis.call('ZSCORE', K_GONE, id) then
  return {'reject', 'withdrawn', 1}
end
local owned = redis.call('HGET', K_OWNER, id)
if owned then
  return {'admit', owned}
end
local taken, detail = take_now(id, tenant, view, now, ttl, hold, prefix, ctx)
if taken then
  return {taken, detail}
end
return {'reject', full_reason(view, now), newcomer_position(detail, tenant, now, ctx)}
