
-- admit_one: `admit` for the common decision -- one budget, no key or route cap, no slice
-- asked and no hold settled -- with the same reply as `admit` (which see) and the same
-- effects, without its tables and closures, from only the arguments it reads: the exact
-- path's hot call. `script.rs` sends it only for such a call; a test compares the two on one
-- sequence.
--
-- KEYS  [1] budget, [2] the key's holds, [3] the record
-- ARGV  [1] per_unit [2] rate [3] capacity [4] max_delay [5] cost [6] record_ms: only what
--       this decision reads (`admit` takes 18 and more; a batch carries each call's)
-- reply {code, a, remaining, reset_us, 0, now_us, level, held}, packed (`pack.lua`)
--
-- It decides before it looks for the call's record, and an admission writes its record with
-- the command that looks for it (SET NX GET): four commands where `admit` runs five. Until
-- then it has only read, so a call that finds its record (a resend, or a call given up and
-- undone) writes nothing and answers from it, as in `admit`; and the reads that can fail (a
-- key of the wrong type) all come before the first write.

local p, q = num(ARGV[1]), num(ARGV[2])
local cap, delay = num(ARGV[3]), num(ARGV[4])
local cost = num(ARGV[5])
local budget, holds, record = KEYS[1], KEYS[2], KEYS[3]
local own = keys_own(budget)
local now = now_us()
local live, charge, last, gone = take_holds(holds, '', 0, now, false)
local level = level_at(budget, p, q, now)
-- `charged`: the level once the expired holds found are charged (to the key's own budgets).
local held, charged = 0, level
if own then
  held = live * p
  charged = level + charge * p
end
local after = charged + cost * p
local seen
if after + held > cap + delay then
  seen = redis.call('GET', record)
  if not seen then
    -- Refused: the expired holds are charged and removed all the same, as `admit` does.
    drop_holds(holds, gone, now)
    if charged ~= level then store_level(budget, charged, p, q, now) end
    local retry = ceil_div(after + held - cap - delay, q)
    local after_held = held + cost * p - cap - delay
    if held > 0 and after_held > 0 then
      retry = math.max(retry, last - now + ceil_div(after_held, q))
    end
    local l = charged + held
    return packed8(OVER_BUDGET, retry, remaining(cap, l, p), ceil_div(l, q), 0, now, charged,
                   held)
  end
else
  local keep = math.max(1, ceil_div(ceil_div(after, q), 1000))
  seen = redis.call('SET', record, '1', 'NX', 'GET', 'PX', int(record_px(keep, num(ARGV[6]))))
  if not seen then
    drop_holds(holds, gone, now)
    store_level(budget, after, p, q, now)
    local wait = 0
    if after + held > cap then wait = ceil_div(after + held - cap, q) end
    local l = after + held
    return packed8(ADMITTED, wait, remaining(cap, l, p), ceil_div(l, q), 0, now, after, held)
  end
end
-- The record was there: nothing written, it answers (the level as it is, expired holds not
-- charged yet).
local code = UNDONE
if seen == '1' then code = ADMITTED end
local l = level + held
return packed8(code, 0, remaining(cap, l, p), ceil_div(l, q), 0, now, level, held)
