-- ARGV: id, ttl_ms, prefix, then the replica view.
-- Drops the lease (if it is still there: release is idempotent) and hands free slots
-- to the head waiters. Returns 1 if a lease was dropped, else 0.
local id, ttl, prefix = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local view = view_of(4, #ARGV - 3)
local now = now_ms()
local dropped = drop_lease(id)
purge(now)
local _, blocked_until = generation(now, ttl)
assign(now, ttl, prefix, view, blocked_until)
if dropped then
  return 1
end
return 0
