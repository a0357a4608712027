-- ARGV: id, ttl_ms, prefix, the scheduling context (common.lua), then the replica view.
-- Drops the lease (if it is still there: release is idempotent), charging its
-- tenant's lane, and hands free slots to the waiters served next. Returns 1 if a
-- lease was dropped, else 0.
local id, ttl, prefix = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local ctx, at = ctx_of(4)
local view = view_of(at, #ARGV - at + 1)
local now = now_ms(ctx)
local dropped = drop_lease(id, now, ctx, true)
purge(now, ctx)
local _, blocked_until = generation(now, ttl)
assign(now, ttl, prefix, view, blocked_until, ctx)
if dropped then
  return 1
end
return 0
