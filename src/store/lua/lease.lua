-- tollgate: renew (ARGV[2] = ttl_us > 0) or release (ARGV[2] = 0) a request's leases.
-- KEYS: the lease zsets the request holds; ARGV[1] lease id.
local ttl = tonumber(ARGV[2])
if ttl == 0 then
  for i = 1, #KEYS do redis.call('ZREM', KEYS[i], ARGV[1]) end
  return 1
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
for i = 1, #KEYS do
  redis.call('ZADD', KEYS[i], 'XX', string.format('%.0f', now + ttl), ARGV[1])
  redis.call('PEXPIRE', KEYS[i], string.format('%.0f', math.floor(ttl / 1000) + 1000))
end
return 1
