
-- debit: charges `cost` units admitted elsewhere (by the fallback while Redis was
-- unreachable) to each budget, even past capacity: the key then waits out the debt.
--
-- KEYS  budget...
-- ARGV  (per_unit rate cost) of each budget, from [1], then id
-- reply 1
--
-- A debit with an id ('0': none) charges once: a write-back that may have run is sent again
-- with its id, and this key (in the first budget's slot) remembers it, as long as a send
-- delivered late may still arrive (write-backs are rare: outages only).
--
-- With one more key, an admission's record (`t{tag}a<id>`), and one more argument, how long
-- it lives (ms): the charge of a queued request that Redis lost with its data, made again
-- only if the record is missing (else it stands, or was undone), and the record written
-- again, so that it is made once.

local WRITE_BACK_SEEN_MS = 1200000

if #ARGV == 3 * #KEYS - 1 then
  local record = KEYS[#KEYS]
  if redis.call('EXISTS', record) == 1 then
    return 1
  end
  adjust(1, nil, #KEYS - 1)
  redis.call('SET', record, '1', 'PX', ARGV[#ARGV])
  return 1
end

local id = ARGV[1 + 3 * #KEYS]
if id == nil or id == '0' then
  return adjust(1)
end
local seen = KEYS[1] .. ':w:' .. id
if redis.call('EXISTS', seen) == 1 then
  return 1
end
adjust(1)
redis.call('SET', seen, '1', 'PX', WRITE_BACK_SEEN_MS)
return 1
