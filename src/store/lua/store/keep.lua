
-- keep: a queued request's admission record (`t{tag}a<id>`, '1' while its charge stands) kept
-- for `ms` from now: as long as the request may still wait, and a while after. Its refund can
-- then tell a charge Redis still holds from one it lost with its data (`refund.lua`), and its
-- charge be made again once if lost (`debit.lua`).
--
-- KEYS  [1] the record
-- ARGV  [1] ms
-- reply Redis's time (µs) when kept; 0 if the record is not there as '1' (then nothing is
--       known of it: refunds are made as without it)

if redis.call('GET', KEYS[1]) ~= '1' then
  return 0
end
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return now_us()
