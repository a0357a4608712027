-- The gateway's periodic tick for one pool, in one round trip.
-- ARGV: ttl_ms, prefix, beat_ms, known generation ('' if none), guard_ms, gateway,
--       the scheduling context (common.lua), n_view, view..., n_leases,
--       (lease id, replica)..., n_waiters, waiter ids..., n_guards, guarded replicas...
-- Extends this gateway's leases; after a data loss (new generation) and while grants
-- are blocked, re-asserts them. Refreshes its waiters' heartbeats and its guard
-- flags, then hands free slots (expired leases) to the head waiters.
-- Returns {generation, lost lease ids, waiter states, held per replica, queue depth}
-- where a waiter state is its queue position (its rank in the tenant rules' projected
-- service order), 0 if granted, -2 if refused preempted_in_queue, -1 if gone.
-- A lease re-asserted after a data loss counts as class 0 (its tenant is not sent).
local ttl, prefix, beat = tonumber(ARGV[1]), ARGV[2], tonumber(ARGV[3])
local known, guard_ms, gateway = ARGV[4], tonumber(ARGV[5]), ARGV[6]
local ctx, i = ctx_of(7)
local n_view = tonumber(ARGV[i])
local view = view_of(i + 1, n_view)
i = i + 1 + n_view
local now = now_ms(ctx)
purge(now, ctx)
local gen, blocked_until = generation(now, ttl)
local reassert = known ~= '' and known ~= gen and now < blocked_until
local lost = {}
local n_leases = tonumber(ARGV[i])
for j = i + 1, i + 2 * n_leases, 2 do
  local id, replica = ARGV[j], ARGV[j + 1]
  if redis.call('ZSCORE', K_LEASES, id) then
    redis.call('ZADD', K_LEASES, now + ttl, id)
  elseif reassert then
    grant(id, replica, now, ttl)
  else
    lost[#lost + 1] = id
  end
end
i = i + 1 + 2 * n_leases
local states = {}
local queued = {}
local n_waiters = tonumber(ARGV[i])
for j = i + 1, i + n_waiters do
  local w = ARGV[j]
  if redis.call('ZSCORE', K_QUEUE, w) then
    redis.call('ZADD', K_BEATS, now + beat, w)
    states[#states + 1] = 0
    queued[#queued + 1] = {#states, w}
  elseif redis.call('HEXISTS', K_OWNER, w) == 1 then
    states[#states + 1] = 0
  elseif redis.call('ZSCORE', K_SHED, w) then
    states[#states + 1] = -2
  else
    states[#states + 1] = -1
  end
end
i = i + 1 + n_waiters
-- This gateway's guard: on for the replicas listed, off for the rest of its view.
local mine = {}
local n_guards = tonumber(ARGV[i])
for j = i + 1, i + n_guards do
  mine[ARGV[j]] = true
  set_guard(ARGV[j], gateway, now + guard_ms, now)
end
for j = 1, #view, 3 do
  if not mine[view[j]] then
    set_guard(view[j], gateway, nil, now)
  end
end
assign(now, ttl, prefix, view, blocked_until, ctx)
-- Positions after the hand-out: a waiter granted just now reports 0.
if #queued > 0 then
  local order = tq_order(tq_load(ctx), now / 1000)
  local rank = {}
  for r, w in ipairs(order) do
    rank[w] = r
  end
  for _, q in ipairs(queued) do
    states[q[1]] = rank[q[2]] or 0
  end
end
local held = redis.call('HGETALL', K_HELD)
return {gen, lost, states, held, redis.call('ZCARD', K_QUEUE), math.max(0, blocked_until - now)}
