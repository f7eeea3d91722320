-- tollgate: give back `cost` units (the upstream never handled the request).
-- KEYS[1] budget string; ARGV: per_unit rate cost
local v = redis.call('GET', KEYS[1])
if not v then return 0 end
local l, at, r = string.match(v, '^(%d+):(%d+):(%d+)$')
if not l then return 0 end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local p = tonumber(ARGV[1])
local q = tonumber(ARGV[2])
l = tonumber(l)
at = tonumber(at)
r = tonumber(r)
if r ~= q and r > 0 then l = math.ceil(l * q / r) end
local elapsed = now - at
if elapsed < 0 then elapsed = 0 end
local level = 0
if elapsed * q < l then level = l - elapsed * q end
level = level - tonumber(ARGV[3]) * p
if level <= 0 then
  redis.call('DEL', KEYS[1])
  return 1
end
local px = math.max(1, math.floor((math.floor((level + q - 1) / q) + 999) / 1000))
redis.call('SET', KEYS[1], string.format('%.0f:%.0f:%.0f', level, now, q), 'PX', string.format('%.0f', px))
return 1
