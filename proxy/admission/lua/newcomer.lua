-- Shared part of acquire.lua and hold.lua (prepended to those two at load, after
-- common.lua): a newcomer's tenant and view from ARGV, and the decision to give it a
-- free slot now -- PoolCore.arrive's up to the queue.

-- ARGV[at..]: the tenant (priority, weight or '-', max_queued or '-', name), then the
-- replica view to the end. Returns the tenant and the view.
local function newcomer_of(at)
  local tenant = tenant_of(ARGV[at] .. ' ' .. ARGV[at + 1] .. ' ' .. ARGV[at + 2] .. ' '
    .. ARGV[at + 3])
  return tenant, view_of(at + 4, #ARGV - at - 3)
end

-- A free slot for newcomer ``id`` now, its lease expiring at now + lease_ms (a session's
-- ttl, or a reservation's hold). Grants wait while the data generation is new; slots
-- freed meanwhile go to the waiters first; no barging: a free slot only if nobody of the
-- newcomer's class or a higher one waits, and the reserves of the classes above it
-- stay free. Returns 'admit', replica | 'blocked', ms until grants resume | nil, whether
-- anyone waits.
local function take_now(id, tenant, view, now, ttl, lease_ms, prefix, ctx)
  local _, blocked_until = generation(now, ttl)
  if now < blocked_until then
    return 'blocked', blocked_until - now
  end
  assign(now, ttl, prefix, view, blocked_until, ctx)
  local waiting = redis.call('ZCARD', K_QUEUE) > 0
  if not (waiting and tq_waiting_at_or_above(tq_load(ctx), tenant.priority))
      and may_take(tenant.priority, view, now, ctx) then
    local replica = pick(view, now, nil)
    if replica then
      grant(id, replica, now, lease_ms)
      tq_admitted(id, tenant, now)
      return 'admit', replica
    end
  end
  return nil, waiting
end

-- Where a refused newcomer of ``tenant`` would have stood in the queue (1 = head): its
-- Retry-After.
local function newcomer_position(waiting, tenant, now, ctx)
  if not waiting then
    return 1
  end
  return rank_in(tq_order(tq_load(ctx), now / 1000, tenant), false)
end
