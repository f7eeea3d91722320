
-- unspend: a request spent from hold `hold_id` got its `cost` back: the hold shrinks if it is
-- not settled yet, else (its units are in the levels now) the budgets get it back.
--
-- KEYS  [1] the key's holds, [2..] its budgets
-- ARGV  [1] hold_id [2] cost, then (per_unit rate) of each budget
-- reply 1

local v = redis.call('HGET', KEYS[1], ARGV[1])
local cost = tonumber(ARGV[2])
gave_back(KEYS)
if v then
  local units, exp = string.match(v, '^(%d+):(%d+)$')
  units = tonumber(units)
  -- (a tombstone's units are in the levels: they get it back)
  if units and units > 0 then
    units = math.max(0, units - cost)
    redis.call('HSET', KEYS[1], ARGV[1], int(units) .. ':' .. exp)
    return 1
  end
end
charge_budgets(-cost, now_us(), 3)
return 1
