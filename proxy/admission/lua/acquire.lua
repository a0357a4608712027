-- ARGV: id, ttl_ms, prefix, max_depth, beat_ms, then the replica view.
-- Returns {'admit', replica} | {'queued', position} | {'reject', reason}
--       | {'blocked', ms until grants resume}.
local id, ttl, prefix = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local max_depth, beat = tonumber(ARGV[4]), tonumber(ARGV[5])
local view = view_of(6, #ARGV - 5)
local now = now_ms()
-- Expired leases are gone first: a lease that lapsed is never confirmed below.
purge(now)
-- Idempotent per id: a retry after a lost reply gets the first answer again (a live
-- lease, extended from now).
local owned = redis.call('HGET', K_OWNER, id)
if owned then
  redis.call('ZADD', K_LEASES, now + ttl, id)
  return {'admit', owned}
end
local rank = redis.call('ZRANK', K_QUEUE, id)
if rank then
  return {'queued', rank + 1}
end
local _, blocked_until = generation(now, ttl)
if now < blocked_until then
  return {'blocked', blocked_until - now}
end
assign(now, ttl, prefix, view, blocked_until)
if redis.call('ZCARD', K_QUEUE) == 0 then
  local replica = pick(view, now, nil)
  if replica then
    grant(id, replica, now, ttl)
    return {'admit', replica}
  end
end
if max_depth <= 0 then
  return {'reject', full_reason(view, now)}
end
if redis.call('ZCARD', K_QUEUE) >= max_depth then
  return {'reject', 'queue_full'}
end
redis.call('ZADD', K_QUEUE, redis.call('INCR', K_SEQ), id)
redis.call('ZADD', K_BEATS, now + beat, id)
return {'queued', redis.call('ZCARD', K_QUEUE)}
