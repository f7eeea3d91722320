
-- undo: gives back what admission `lease_id` took -- its charge to every budget and its key
-- lease -- if Redis admitted it, once; and makes sure it never will. Safe to send again.
--
-- KEYS  [1] the admission's record, [2] key leases (the record again: none), [3..] budgets
-- ARGV  [1] lease_id [2] tombstone_ms, then (per_unit rate cost) of each budget
-- reply 1 (the admission had charged: refunded, its key lease released) or 0 (it had not, or
--       was undone already). Leaves 'u' for tombstone_ms, so that the admission, should it
--       arrive later, writes nothing.

local record, lease_set, tomb_ms = KEYS[1], KEYS[2], tonumber(ARGV[2])
local seen = redis.call('GET', record)
if seen and seen ~= '1' then return 0 end
if seen == '1' then
  local now = now_us()
  for i = 3, #KEYS do
    local j = 3 + 3 * (i - 3)
    local p, q = tonumber(ARGV[j]), tonumber(ARGV[j + 1])
    store_level(KEYS[i], level_at(KEYS[i], p, q, now) - tonumber(ARGV[j + 2]) * p, p, q, now)
  end
  if lease_set ~= record then redis.call('ZREM', lease_set, ARGV[1]) end
  gave_back(KEYS)
end
redis.call('SET', record, 'u', 'PX', int(tomb_ms))
if seen == '1' then return 1 end
return 0
