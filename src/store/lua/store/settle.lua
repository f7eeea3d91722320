
-- settle: hands hold `hold_id` back with `unspent` of its units not spent, charging the rest
-- (and every expired hold) to each of the key's budgets. Idempotent: a hold that is gone is
-- not settled again.
--
-- KEYS  [1] the key's holds, [2..] its budgets
-- ARGV  [1] hold_id [2] unspent, then (per_unit rate) of each budget, then units granted_us
-- reply 1
--
-- A hold of `units` granted at Redis TIME granted_us that Redis lost (with its data) is
-- charged units - unspent, once (`lost_hold`, `bury`).

local now = now_us()
local holds, id, unspent = KEYS[1], ARGV[1], tonumber(ARGV[2])
local units = tonumber(ARGV[3 + 2 * (#KEYS - 1)]) or 0
local granted_us = tonumber(ARGV[4 + 2 * (#KEYS - 1)]) or 0
local lost = lost_hold(holds, id, units, unspent, granted_us)
local _, charge, _, _, late = take_holds(holds, id, unspent, now, true)
if lost then
  charge = charge + units - unspent
  bury(holds, id, now, 0)
end
if charge > 0 or late then
  for i = 2, #KEYS do
    local p, q = hold_budget(i, 3)
    store_level(KEYS[i], settled_level(level_at(KEYS[i], p, q, now), charge, late, p, q, now), p, q, now)
  end
end
if unspent > 0 or late then gave_back(KEYS) end
return 1
