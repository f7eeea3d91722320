
-- refund: gives `cost` units back to each budget (never below empty).
--
-- KEYS  budget...
-- ARGV  (per_unit rate cost) of each budget, from [1]
-- reply each budget's level afterwards (ticks), in order
--
-- With one more key and one more argument (a marker, in the budgets' slot, and how long it
-- lasts, ms), the refund is made once: a resend (one whose first send timed out and may have
-- run) finds the marker and only reads the levels.
--
-- With two more keys (the marker, then the charge's admission record) and two more arguments
-- (how long the marker lasts, then until when, Redis time in µs, the record surely lives, as
-- its admission wrote it), the refund made before then is made only if the record is there ('1'):
-- missing, Redis lost the charge with its data (a restart without persistence, an empty
-- replica promoted) and there is nothing to give back -- giving it back would cancel what
-- was charged since (the fallback's write-back of what ran while Redis was away). The record
-- is then left 'u', so that a charge made again late (`debit.lua`) does nothing. After that
-- time, the refund is made as with the marker alone.

local budgets = #KEYS
local marker, record, until_us = nil, nil, nil
if #ARGV == 3 * #KEYS - 2 then
  budgets = #KEYS - 1
  marker = KEYS[#KEYS]
elseif #ARGV == 3 * #KEYS - 4 then
  budgets = #KEYS - 2
  marker, record = KEYS[#KEYS - 1], KEYS[#KEYS]
  until_us = tonumber(ARGV[#ARGV])
end
local lasts = ARGV[3 * budgets + 1]
local levels = {}
local lost = record and now_us() < until_us and redis.call('GET', record) ~= '1'
if lost or (marker and redis.call('EXISTS', marker) == 1) then
  if lost then
    redis.call('SET', marker, '1', 'PX', lasts)
    redis.call('SET', record, 'u', 'PX', lasts)
  end
  local now = now_us()
  for i = 1, budgets do
    levels[i] = level_at(KEYS[i], tonumber(ARGV[3 * i - 2]), tonumber(ARGV[3 * i - 1]), now)
  end
  return levels
end
adjust(-1, levels, budgets)
gave_back(KEYS)
if marker then redis.call('SET', marker, '1', 'PX', lasts) end
return levels
