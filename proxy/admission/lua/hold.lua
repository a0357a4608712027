-- ARGV: id, ttl_ms, hold_ms, prefix, the scheduling context (common.lua), the tenant
--       (priority, weight or '-', max_queued or '-', name), then the replica view.
-- One slot for a gang reservation, now or never (never a queue place): the decision of
-- acquire.lua for a newcomer of this tenant's class -- no barging past a waiter of its
-- class or higher, the reserves kept for the classes above it -- but the lease expires
-- at now + hold_ms, the reservation's deadline: no gateway renews it until a stage
-- connection claims it (its gateway then confirms it with leave.lua and renews it).
-- Returns {'admit', replica} | {'reject', reason, position} | {'blocked', ms}.
-- Idempotent per id: a retry after a lost reply gets the same slot.
local id, ttl, hold, prefix = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4]
local ctx, at = ctx_of(5)
local tenant = tenant_of(ARGV[at] .. ' ' .. ARGV[at + 1] .. ' ' .. ARGV[at + 2] .. ' '
  .. ARGV[at + 3])
local view = view_of(at + 4, #ARGV - at - 3)
local now = now_ms(ctx)
purge(now, ctx)
local owned = redis.call('HGET', K_OWNER, id)
if owned then
  return {'admit', owned}
end
local _, blocked_until = generation(now, ttl)
if now < blocked_until then
  return {'blocked', blocked_until - now}
end
-- Slots freed meanwhile go to the waiters first.
assign(now, ttl, prefix, view, blocked_until, ctx)
local waiting = redis.call('ZCARD', K_QUEUE) > 0
if not (waiting and tq_waiting_at_or_above(tq_load(ctx), tenant.priority))
    and may_take(tenant.priority, view, now, ctx) then
  local replica = pick(view, now, nil)
  if replica then
    grant(id, replica, now, hold)
    tq_admitted(id, tenant, now)
    return {'admit', replica}
  end
end
local position = 1
if waiting then
  position = rank_in(tq_order(tq_load(ctx), now / 1000, tenant), false)
end
return {'reject', full_reason(view, now), position}
