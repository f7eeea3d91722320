
-- refund: gives `cost` units back to each budget (never below empty).
--
-- KEYS  budget...
-- ARGV  (per_unit rate cost) of each budget, from [1]
-- reply each budget's level afterwards (ticks), in order
--
-- With one more key and one more argument (a marker, in the budgets' slot, and how long it
-- lasts, ms), the refund is made once: a resend (one whose first send timed out and may have
-- run) finds the marker and only reads the levels.

local budgets = #KEYS
local marker = nil
if #ARGV == 3 * #KEYS - 2 then
  budgets = #KEYS - 1
  marker = KEYS[#KEYS]
end
local levels = {}
if marker and redis.call('EXISTS', marker) == 1 then
  local now = now_us()
  for i = 1, budgets do
    levels[i] = level_at(KEYS[i], tonumber(ARGV[3 * i - 2]), tonumber(ARGV[3 * i - 1]), now)
  end
  return levels
end
adjust(-1, levels, budgets)
gave_back(KEYS)
if marker then redis.call('SET', marker, '1', 'PX', ARGV[#ARGV]) end
return levels
