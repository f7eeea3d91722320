
-- admit_one: `admit` for the common decision -- one budget, no key or route cap, no slice
-- asked and no hold settled -- with the same reply as `admit` (which see) and the same
-- effects, without its tables and closures, from only the arguments it reads: the exact
-- path's hot call. `script.rs` sends it only for such a call; a test compares the two on one
-- sequence.
--
-- KEYS  [1] budget, [2] the key's holds, [3] the record
-- ARGV  [1] per_unit [2] rate [3] capacity [4] max_delay [5] cost [6] record_ms: only what
--       this decision reads (`admit` takes 18 and more; a batch carries each call's)
-- reply {code, a, remaining, reset_us, 0, now_us, level, held}

local p, q = tonumber(ARGV[1]), tonumber(ARGV[2])
local cap, delay = tonumber(ARGV[3]), tonumber(ARGV[4])
local cost = tonumber(ARGV[5])
local budget, holds, record = KEYS[1], KEYS[2], KEYS[3]
local own = keys_own(budget)
local now = now_us()
local seen = redis.call('GET', record)
if seen then
  -- A resend, or a call given up and undone: nothing written, the record answers.
  local live = take_holds(holds, '', 0, now, false)
  local level = level_at(budget, q, now)
  local held = own and live * p or 0
  local code = UNDONE
  if seen == '1' then code = ADMITTED end
  local l = level + held
  return {code, 0, remaining(cap, l, p), ceil_div(l, q), 0, int(now), int(level), int(held)}
end
local live, charge, last = take_holds(holds, '', 0, now, true)
local level = level_at(budget, q, now)
local held = 0
if own then
  held = live * p
  if charge > 0 then
    level = level + charge * p
    store_level(budget, level, q, now)
  end
end
local after = level + cost * p
if after + held > cap + delay then
  local retry = ceil_div(after + held - cap - delay, q)
  local after_held = held + cost * p - cap - delay
  if held > 0 and after_held > 0 then
    retry = math.max(retry, last - now + ceil_div(after_held, q))
  end
  local l = level + held
  return {OVER_BUDGET, retry, remaining(cap, l, p), ceil_div(l, q), 0, int(now), int(level),
          int(held)}
end
local keep = math.max(1, ceil_div(ceil_div(after, q), 1000))
redis.call('SET', record, '1', 'PX', int(math.min(keep, tonumber(ARGV[6]))))
store_level(budget, after, q, now)
local wait = 0
if after + held > cap then wait = ceil_div(after + held - cap, q) end
local l = after + held
return {ADMITTED, wait, remaining(cap, l, p), ceil_div(l, q), 0, int(now), int(after), int(held)}
