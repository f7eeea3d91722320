
-- take: a slot in a route's lease set for lease `lease_id`, if one is free. On Redis Cluster
-- a route's lease set is in another slot than the key's budget: `admit` (without the route)
-- then `take`.
--
-- KEYS  [1] route leases
-- ARGV  [1] route_cap [2] lease_id [3] lease_ttl_us
-- reply ADMITTED (slot taken) or ROUTE_BUSY (nothing written)

local route_cap = tonumber(ARGV[1])
local now = now_us()
if redis.call('ZCOUNT', KEYS[1], int(now), '+inf') >= route_cap then
  return ROUTE_BUSY
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. int(now))
redis.call('ZADD', KEYS[1], int(now + tonumber(ARGV[3])), ARGV[2])
expire_with_last_lease(KEYS[1])
return ADMITTED
