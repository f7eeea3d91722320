
-- refund: gives `cost` units back to each budget (never below empty).
--
-- KEYS  budget...
-- ARGV  (per_unit rate cost) of each budget, from [1]
-- reply 1

adjust(-1)
gave_back(KEYS)
return 1
