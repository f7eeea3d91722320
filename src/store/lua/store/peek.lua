
-- peek: the levels of a key's budgets now, the holds included, in one atomic view; writes
-- nothing.
--
-- KEYS  [1] the key's holds, [2..] its budgets
-- ARGV  (per_unit rate) of each budget, from [1]
-- reply each budget's level now (ticks)

local now = now_us()
local live, charge = take_holds(KEYS[1], '', 0, now, false)
local levels = {}
for i = 2, #KEYS do
  local p, q = hold_budget(i, 1)
  -- Holds count in the key's own budgets only, as in admit (a route's is never passed).
  local held = keys_own(KEYS[i]) and (live + charge) or 0
  levels[#levels + 1] = level_at(KEYS[i], p, q, now) + held * p
end
return levels
