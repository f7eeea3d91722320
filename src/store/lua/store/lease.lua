
-- lease: renews lease `lease_id` in every set for ttl_us, or releases it (ttl_us 0).
-- Idempotent.
--
-- KEYS  lease sets...
-- ARGV  [1] lease_id [2] ttl_us (0: release)
-- reply 1; when renewing, the count of live leases in KEYS[1] (this one among them), 0 for
--       no KEYS

local ttl = tonumber(ARGV[2])
if ttl == 0 then
  for i = 1, #KEYS do redis.call('ZREM', KEYS[i], ARGV[1]) end
  return 1
end
local now = now_us()
for i = 1, #KEYS do
  -- A renewal re-creates a lease that is missing: Redis lost it with its data (a restart
  -- without persistence, an empty replica promoted), or it lapsed while its instance was
  -- paused. Its request is still running, so its slot is taken, whoever else took it
  -- meanwhile (DESIGN §4 bounds that).
  redis.call('ZADD', KEYS[i], int(now + ttl), ARGV[1])
  expire_with_last_lease(KEYS[i])
end
if #KEYS == 0 then return 0 end
return redis.call('ZCOUNT', KEYS[1], int(now), '+inf')
