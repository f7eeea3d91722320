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
--   admit  KEYS budget, key leases, route leases, further budgets...
--          ARGV per_unit rate capacity max_delay floor, cost key_cap route_cap lease_id
--               lease_ttl_us slice give_back, then per_unit rate capacity max_delay floor of
--               each further budget
--          -> {code, a, remaining, reset_us, granted, now_us, level of each budget...}:
--             code 0 over budget (a = retry_after_us), 1 key cap full, 2 route cap full,
--             3 admitted (a = delay_us). Writes only when admitted, and then to every budget
--             (all fit, or none is charged) -- except `give_back`, which is applied first,
--             whatever the answer. `slice` asks for that many extra units (a budget slice,
--             crate::store::redis::slices): granted in full when cost + slice fit every budget
--             with `floor` units of it still left and no max_delay in play, else not at all
--             (granted 0, and the request is decided exactly as without it). The figures
--             describe the budgets as if the granted units were not taken (what the instance
--             shows while it holds them); the levels are the stored ones, at now_us. With
--             further budgets the reply goes on: decisive budget's index, then remaining,
--             reset_us of each.
--   refund KEYS budget...        ARGV (per_unit rate cost)...     -> 1
--   debit  KEYS budget...        ARGV (per_unit rate cost)...     -> 1 (charges even past
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
  local cost = tonumber(ARGV[7])
  local key_cap = tonumber(ARGV[8])
  local route_cap = tonumber(ARGV[9])
  local lease = ARGV[10]
  local ttl = tonumber(ARGV[11])
  local slice = tonumber(ARGV[12])
  local give_back = tonumber(ARGV[13])
  -- Every budget the request must fit: KEYS[1] (ARGV 2-6), then KEYS[4], KEYS[5], ... with
  -- five ARGV each from ARGV[14] on (crate::budget::decide_all, all or nothing).
  local function budget(key, j)
    return {key = key, p = tonumber(ARGV[j]), q = tonumber(ARGV[j + 1]),
            cap = tonumber(ARGV[j + 2]), delay = tonumber(ARGV[j + 3]),
            floor = tonumber(ARGV[j + 4])}
  end
  local b = {budget(KEYS[1], 2)}
  for i = 1, math.floor((#ARGV - 13) / 5) do
    b[#b + 1] = budget(KEYS[3 + i], 14 + 5 * (i - 1))
  end
  local now = now_us()
  local refused, retry = nil, 0
  for i, x in ipairs(b) do
    x.level = level_at(x.key, x.q, now)
    if give_back > 0 then
      -- The unspent rest of this instance's last slice: back before anything is decided.
      x.level = math.max(0, x.level - give_back * x.p)
      store_level(x.key, x.level, x.q, now)
    end
    x.next = x.level + cost * x.p
    if x.next > x.cap + x.delay then
      local r = ceil_div(x.next - x.cap - x.delay, x.q)
      if refused == nil or r > retry then refused, retry = i, r end
    end
  end
  local granted = 0
  if refused == nil and slice > 0 and key_cap == 0 and route_cap == 0 then
    granted = slice
    for _, x in ipairs(b) do
      if x.delay > 0 or x.level + (cost + slice + x.floor) * x.p > x.cap then granted = 0 end
    end
  end
  -- The reply: {code, a, remaining, reset_us, granted, now, levels...} of the decisive budget
  -- and, when there are several, its index (from 0) and every budget's remaining and
  -- reset_us. `after` = the levels after the charge; `decisive` = nil picks the tightest
  -- (fewest left, first of equals).
  local function reply(code, a, after, decisive)
    local figs = {}
    for i, x in ipairs(b) do
      local l = x.level
      if after then l = x.next - granted * x.p end
      figs[i] = {remaining(x.cap, l, x.p), ceil_div(l, x.q)}
    end
    if decisive == nil then
      decisive = 1
      for i = 2, #b do
        if figs[i][1] < figs[decisive][1] then decisive = i end
      end
    end
    local out = {code, a, figs[decisive][1], figs[decisive][2], granted, int(now)}
    for _, x in ipairs(b) do
      if after then out[#out + 1] = int(x.next) else out[#out + 1] = int(x.level) end
    end
    if #b > 1 then
      out[#out + 1] = decisive - 1
      for i = 1, #b do
        out[#out + 1] = figs[i][1]
        out[#out + 1] = figs[i][2]
      end
    end
    return out
  end
  if refused then
    return reply(OVER_BUDGET, retry, false, refused)
  end
  if key_cap > 0 and redis.call('ZCOUNT', KEYS[2], int(now), '+inf') >= key_cap then
    return reply(KEY_BUSY, 0, false, nil)
  end
  if route_cap > 0 and redis.call('ZCOUNT', KEYS[3], int(now), '+inf') >= route_cap then
    return reply(ROUTE_BUSY, 0, false, nil)
  end
  local delay = 0
  for _, x in ipairs(b) do
    x.next = x.next + granted * x.p
    store_level(x.key, x.next, x.q, now)
    if x.next > x.cap then delay = math.max(delay, ceil_div(x.next - x.cap, x.q)) end
  end
  for i, limit in ipairs({key_cap, route_cap}) do
    if limit > 0 then
      local set = KEYS[i + 1]
      redis.call('ZREMRANGEBYSCORE', set, '-inf', '(' .. int(now))
      redis.call('ZADD', set, int(now + ttl), lease)
      expire_with_last_lease(set)
    end
  end
  return reply(ADMITTED, delay, true, nil)
end

-- refund and debit take one budget per key: KEYS[i] with ARGV per_unit, rate, cost from
-- ARGV[2 + 3 (i - 1)] (several budgets of one request in one call).
local function adjust(sign)
  local now = now_us()
  for i = 1, #KEYS do
    local j = 2 + 3 * (i - 1)
    local p = tonumber(ARGV[j])
    local q = tonumber(ARGV[j + 1])
    store_level(KEYS[i], level_at(KEYS[i], q, now) + sign * tonumber(ARGV[j + 2]) * p, q, now)
  end
  return 1
end

if op == 'refund' then
  return adjust(-1)
end

if op == 'debit' then
  return adjust(1)
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
