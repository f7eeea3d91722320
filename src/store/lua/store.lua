-- tollgate's shared store: every operation on budgets and leases, atomically, on Redis TIME.
--
-- The budget arithmetic is a transcription of crate::budget (decide, refund, level_at); tests
-- drive the memory and Redis stores with one sequence and compare. Every number stays an
-- integer below 2^53 (the config refuses limits that could not), so doubles are exact here.
-- Numbers go back to Redis as integer strings: tostring() would use an exponent above 1e14.
--
-- A budget is the string "level:at_us:rate" (ticks, µs, ticks drained per µs); a lease set is
-- a sorted set of lease ids scored by expiry (µs).
--
-- ARGV[1] is the operation:
--   admit  KEYS budget, key leases, route leases
--          ARGV per_unit rate capacity max_delay cost key_cap route_cap lease_id lease_ttl_us
--          -> {code, a, remaining, reset_us}: 0 over budget (a = retry_after_us), 1 key cap
--             full, 2 route cap full, 3 admitted (a = delay_us). Writes only when admitted.
--   refund KEYS budget           ARGV per_unit rate cost          -> 1
--   debit  KEYS budget           ARGV per_unit rate cost          -> 1 (charges even past
--          capacity: units already admitted elsewhere; the key then waits out the debt)
--   peek   KEYS budget           ARGV rate                        -> level now (ticks)
--   lease  KEYS lease sets...    ARGV lease_id ttl_us (0 = release) -> 1
--   take   KEYS route leases     ARGV route_cap lease_id lease_ttl_us -> 3 (ADMITTED: slot
--          taken) or 2 (ROUTE_BUSY: nothing written). On Redis Cluster a route's lease set is
--          in another slot than the key's budget: `admit` (without the route) then `take`.

-- admit's reply codes (crate::store::redis::script::AdmitCode mirrors them; a test compares).
local OVER_BUDGET, KEY_BUSY, ROUTE_BUSY, ADMITTED = 0, 1, 2, 3

local function int(x) return string.format('%.0f', x) end

local function now_us()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end

local function ceil_div(a, b)
  return math.floor((a + b - 1) / b)
end

-- The budget's level at `now` in ticks of drain rate `q` (0 when absent or drained).
local function level_at(key, q, now)
  local v = redis.call('GET', key)
  if not v then return 0 end
  local l, at, r = string.match(v, '^(%d+):(%d+):(%d+)$')
  if not l then return 0 end
  l = tonumber(l)
  at = tonumber(at)
  r = tonumber(r)
  if r ~= q and r > 0 then
    -- a reload changed the rate: keep the time until empty
    l = math.ceil(l * q / r)
  end
  local elapsed = now - at
  if elapsed < 0 then elapsed = 0 end
  if elapsed * q >= l then return 0 end
  return l - elapsed * q
end

local function store_level(key, level, q, now)
  if level <= 0 then
    redis.call('DEL', key)
    return
  end
  -- expire exactly when the bucket is empty again
  local px = math.max(1, ceil_div(ceil_div(level, q), 1000))
  redis.call('SET', key, int(level) .. ':' .. int(now) .. ':' .. int(q), 'PX', int(px))
end

-- A lease set lives as long as its longest lease (whatever lease_ttl each instance uses).
local function expire_with_last_lease(set)
  local last = redis.call('ZRANGE', set, -1, -1, 'WITHSCORES')
  if last[2] then
    redis.call('PEXPIREAT', set, int(ceil_div(tonumber(last[2]), 1000) + 1000))
  end
end

local function remaining(cap, level, p)
  if cap > level then return math.floor((cap - level) / p) end
  return 0
end

local op = ARGV[1]

if op == 'admit' then
  local p = tonumber(ARGV[2])
  local q = tonumber(ARGV[3])
  local cap = tonumber(ARGV[4])
  local max_delay = tonumber(ARGV[5])
  local cost = tonumber(ARGV[6])
  local key_cap = tonumber(ARGV[7])
  local route_cap = tonumber(ARGV[8])
  local lease = ARGV[9]
  local ttl = tonumber(ARGV[10])
  local now = now_us()
  local level = level_at(KEYS[1], q, now)
  local next_level = level + cost * p
  if next_level > cap + max_delay then
    return {OVER_BUDGET, ceil_div(next_level - cap - max_delay, q), remaining(cap, level, p), ceil_div(level, q)}
  end
  if key_cap > 0 and redis.call('ZCOUNT', KEYS[2], int(now), '+inf') >= key_cap then
    return {KEY_BUSY, 0, remaining(cap, level, p), ceil_div(level, q)}
  end
  if route_cap > 0 and redis.call('ZCOUNT', KEYS[3], int(now), '+inf') >= route_cap then
    return {ROUTE_BUSY, 0, remaining(cap, level, p), ceil_div(level, q)}
  end
  store_level(KEYS[1], next_level, q, now)
  for i, limit in ipairs({key_cap, route_cap}) do
    if limit > 0 then
      local set = KEYS[i + 1]
      redis.call('ZREMRANGEBYSCORE', set, '-inf', '(' .. int(now))
      redis.call('ZADD', set, int(now + ttl), lease)
      expire_with_last_lease(set)
    end
  end
  local delay = 0
  if next_level > cap then delay = ceil_div(next_level - cap, q) end
  return {ADMITTED, delay, remaining(cap, next_level, p), ceil_div(next_level, q)}
end

if op == 'refund' then
  local p = tonumber(ARGV[2])
  local q = tonumber(ARGV[3])
  local now = now_us()
  store_level(KEYS[1], level_at(KEYS[1], q, now) - tonumber(ARGV[4]) * p, q, now)
  return 1
end

if op == 'debit' then
  local p = tonumber(ARGV[2])
  local q = tonumber(ARGV[3])
  local now = now_us()
  store_level(KEYS[1], level_at(KEYS[1], q, now) + tonumber(ARGV[4]) * p, q, now)
  return 1
end

if op == 'peek' then
  return level_at(KEYS[1], tonumber(ARGV[2]), now_us())
end

if op == 'lease' then
  local ttl = tonumber(ARGV[3])
  if ttl == 0 then
    for i = 1, #KEYS do redis.call('ZREM', KEYS[i], ARGV[2]) end
    return 1
  end
  local now = now_us()
  for i = 1, #KEYS do
    -- Renew only a live lease: one that lapsed (say, Redis was unreachable for longer than
    -- lease_ttl) may already have been counted out, and its slot given to someone else.
    local expiry = redis.call('ZSCORE', KEYS[i], ARGV[2])
    if expiry and tonumber(expiry) >= now then
      redis.call('ZADD', KEYS[i], 'XX', int(now + ttl), ARGV[2])
      expire_with_last_lease(KEYS[i])
    end
  end
  return 1
end

if op == 'take' then
  local route_cap = tonumber(ARGV[2])
  local now = now_us()
  if redis.call('ZCOUNT', KEYS[1], int(now), '+inf') >= route_cap then
    return ROUTE_BUSY
  end
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. int(now))
  redis.call('ZADD', KEYS[1], int(now + tonumber(ARGV[4])), ARGV[3])
  expire_with_last_lease(KEYS[1])
  return ADMITTED
end

return redis.error_reply('tollgate: unknown operation ' .. tostring(op))
