
-- debit: charges `cost` units admitted elsewhere (by the fallback while Redis was
-- unreachable) to each budget, even past capacity: the key then waits out the debt.
--
-- KEYS  budget...
-- ARGV  (per_unit rate cost) of each budget, from [1], then id [tell]
-- reply 1
--
-- With `tell` '1' (a write-back of what the fallback admitted), a debit that charges is
-- published as a give-back is (`gave_back`): instances forget the key's refusals they keep,
-- whose moment it made too early. (Not a charge after the fact: one per request on a
-- `cost_per_second` route would keep every instance's deny cache from keeping anything.)
--
-- A debit with an id ('0': none) charges once: a write-back that may have run is sent again
-- with its id, and this key (in the first budget's slot) remembers it, as long as a send
-- delivered late may still arrive (write-backs are rare: outages only).
--
-- With two more keys, an admission's record (`t{tag}a<id>`) and its refund's marker, and
-- three more arguments ('0', how long the record lives, ms, and until when, Redis time in
-- µs, it surely lives, as its admission wrote it): the charge of a queued request that Redis lost
-- with its data, made again only if neither the record ('1', or 'u': undone) nor the marker
-- (refunded) is there, and only before that time (later a missing record may have lapsed);
-- then the record is written again, so that it is made once.

local WRITE_BACK_SEEN_MS = 1200000

if #ARGV == 3 * #KEYS - 3 then
  local record, marker = KEYS[#KEYS - 1], KEYS[#KEYS]
  if now_us() >= tonumber(ARGV[#ARGV]) then
    return 1
  end
  if redis.call('EXISTS', record) == 1 or redis.call('EXISTS', marker) == 1 then
    return 1
  end
  adjust(1, nil, #KEYS - 2)
  redis.call('SET', record, '1', 'PX', ARGV[#ARGV - 1])
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
-- A refusal another instance keeps in memory was decided before this debt: it would tell
-- its clients to come back too soon. Told as a give-back is, it asks Redis again.
if ARGV[2 + 3 * #KEYS] == '1' then gave_back(KEYS) end
return 1
