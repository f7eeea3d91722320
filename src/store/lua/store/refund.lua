
-- refund: gives `cost` units back to each budget (never below empty).
--
-- KEYS  budget...
-- ARGV  (per_unit rate cost) of each budget, from [1]
-- reply each budget's level afterwards (ticks), in order

local levels = {}
adjust(-1, levels)
gave_back(KEYS)
return levels
