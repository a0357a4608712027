-- ARGV: id, ttl_ms, prefix, max_depth, beat_ms, the scheduling context (common.lua),
--       the tenant (priority, weight or '-', max_queued or '-', name), then the
--       replica view.
-- Returns {'admit', replica} | {'queued', position} | {'reject', reason, position}
--       | {'blocked', ms until grants resume}; {'reject', 'withdrawn', 1} for an id
--       withdrawn before this script ran (withdraw.lua). A refusal's position is where the
-- newcomer would have stood (its Retry-After); the decisions are PoolCore.arrive's.
local id, ttl, prefix = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local max_depth, beat = tonumber(ARGV[4]), tonumber(ARGV[5])
local ctx, at = ctx_of(6)
local tenant, view = newcomer_of(at)
local now = now_ms(ctx)
-- Expired leases are gone first: a lease that lapsed is never confirmed below.
purge(now, ctx)
-- An id its gateway withdrew (it gave up waiting for this reply) takes nothing.
if redis.call('ZSCORE', K_GONE, id) then
  return {'reject', 'withdrawn', 1}
end
-- Idempotent per id: a retry after a lost reply gets the first answer again (a live
-- lease, extended from now).
local owned = redis.call('HGET', K_OWNER, id)
if owned then
  redis.call('ZADD', K_LEASES, now + ttl, id)
  return {'admit', owned}
end
if redis.call('ZSCORE', K_QUEUE, id) then
  return {'queued', rank_in(tq_order(tq_load(ctx), now / 1000), id)}
end
if redis.call('ZSCORE', K_SHED, id) then
  return {'reject', 'preempted_in_queue', 1}
end
-- A free slot now (newcomer.lua), else a queue place.
local taken, waiting = take_now(id, tenant, view, now, ttl, ttl, prefix, ctx)
if taken then
  return {taken, waiting}
end
local function refuse(reason)
  return {'reject', reason, newcomer_position(waiting, tenant, now, ctx)}
end
if max_depth <= 0 then
  return refuse(full_reason(view, now))
end
if tenant.max_queued then
  local queued = 0
  if waiting then
    queued = tq_queued_by(tq_load(ctx), tenant.name)
  end
  if queued >= tenant.max_queued then
    return refuse('tenant_limit')
  end
end
if redis.call('ZCARD', K_QUEUE) >= max_depth then
  local st = tq_load(ctx)
  local victim = tq_victim(st, tenant.priority)
  if not victim then
    return refuse('queue_full')
  end
  -- Shed: the newest waiter of the lowest sheddable class below the newcomer's.
  tq_remove(st, victim.id)
  redis.call('ZREM', K_QUEUE, victim.id)
  redis.call('ZREM', K_BEATS, victim.id)
  redis.call('ZADD', K_SHED, now + ttl, victim.id)
  local shed_at = rank_in(tq_order(st, now / 1000, victim.tenant), false)
  wake(prefix, victim.id, '!preempted_in_queue ' .. shed_at, ttl)
end
local st = tq_load(ctx)
local seq = redis.call('INCR', K_SEQ)
redis.call('ZADD', K_QUEUE, seq, id)
redis.call('ZADD', K_BEATS, now + beat, id)
tq_push(st, id, seq, tenant, now / 1000)
return {'queued', rank_in(tq_order(st, now / 1000), id)}
