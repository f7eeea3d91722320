-- tollgate: decide one request atomically (budget, per-key slot, route slot) in one round trip.
-- A transcription of crate::budget::decide; tests prove the two agree. Every number stays an
-- integer below 2^53 (the config refuses limits that could not), so doubles are exact here.
--
-- KEYS[1] budget string "level:at_us:rate"   KEYS[2] per-key lease zset   KEYS[3] route lease zset
-- ARGV: per_unit rate capacity max_delay cost key_cap route_cap lease_id lease_ttl_us
-- Returns {code, a, remaining, reset_us}:
--   code 0 over budget (a = retry_after_us)   1 key cap full   2 route cap full
--   code 3 admitted (a = delay_us)
-- Nothing is written unless the request is admitted.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local p = tonumber(ARGV[1])
local q = tonumber(ARGV[2])
local cap = tonumber(ARGV[3])
local max_delay = tonumber(ARGV[4])
local cost = tonumber(ARGV[5])
local key_cap = tonumber(ARGV[6])
local route_cap = tonumber(ARGV[7])
local ttl = tonumber(ARGV[9])
-- numbers go to Redis as integer strings (tostring would use an exponent above 1e14)
local function int(x) return string.format('%.0f', x) end

local level = 0
local v = redis.call('GET', KEYS[1])
if v then
  local l, at, r = string.match(v, '^(%d+):(%d+):(%d+)$')
  if l then
    l = tonumber(l)
    at = tonumber(at)
    r = tonumber(r)
    if r ~= q and r > 0 then
      -- a reload changed the rate: keep the time until empty
      l = math.ceil(l * q / r)
    end
    local elapsed = now - at
    if elapsed < 0 then elapsed = 0 end
    if elapsed * q >= l then level = 0 else level = l - elapsed * q end
  end
end

local function ceil_div(a, b)
  return math.floor((a + b - 1) / b)
end

local next_level = level + cost * p
if next_level > cap + max_delay then
  local remaining = 0
  if cap > level then remaining = math.floor((cap - level) / p) end
  return {0, ceil_div(next_level - cap - max_delay, q), remaining, ceil_div(level, q)}
end

local function busy(code)
  local remaining = 0
  if cap > level then remaining = math.floor((cap - level) / p) end
  return {code, 0, remaining, ceil_div(level, q)}
end
if key_cap > 0 and redis.call('ZCOUNT', KEYS[2], int(now), '+inf') >= key_cap then
  return busy(1)
end
if route_cap > 0 and redis.call('ZCOUNT', KEYS[3], int(now), '+inf') >= route_cap then
  return busy(2)
end

-- admitted: charge, and take the slots
local reset = ceil_div(next_level, q)
local px = math.max(1, ceil_div(reset, 1000))
redis.call('SET', KEYS[1], string.format('%.0f:%.0f:%.0f', next_level, now, q), 'PX', int(px))
local ttl_ms = ceil_div(ttl, 1000) + 1000
if key_cap > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', '(' .. int(now))
  redis.call('ZADD', KEYS[2], int(now + ttl), ARGV[8])
  redis.call('PEXPIRE', KEYS[2], int(ttl_ms))
end
if route_cap > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', '(' .. int(now))
  redis.call('ZADD', KEYS[3], int(now + ttl), ARGV[8])
  redis.call('PEXPIRE', KEYS[3], int(ttl_ms))
end
local delay = 0
if next_level > cap then delay = ceil_div(next_level - cap, q) end
local remaining = 0
if cap > next_level then remaining = math.floor((cap - next_level) / p) end
return {3, delay, remaining, reset}
