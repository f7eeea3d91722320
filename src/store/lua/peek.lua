-- tollgate: a budget's level now, without writing. KEYS[1] budget; ARGV: rate
-- Returns the level in the caller's ticks.
local v = redis.call('GET', KEYS[1])
if not v then return 0 end
local l, at, r = string.match(v, '^(%d+):(%d+):(%d+)$')
if not l then return 0 end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local q = tonumber(ARGV[1])
l = tonumber(l)
at = tonumber(at)
r = tonumber(r)
if r ~= q and r > 0 then l = math.ceil(l * q / r) end
local elapsed = now - at
if elapsed < 0 then elapsed = 0 end
if elapsed * q >= l then return 0 end
return l - elapsed * q
