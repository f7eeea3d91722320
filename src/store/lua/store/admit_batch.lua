
-- admit_batch: group commit. Several `admit` calls of one instance, decided in one script
-- call, one after another in the order sent, each exactly as if it had been sent alone
-- then: each is the very `admit` or `admit_one` (`script.rs` wraps each file in a function
-- of its KEYS and ARGV, above this one), on its own keys, after the ones before it.
--
-- KEYS  every call's KEYS, one call's after the other's
-- ARGV  [1] the number of calls, then for each call: its script (1 admit_one, 2 admit), its
--       number of KEYS, its number of ARGV, then its ARGV
-- reply {each call's reply, in order}. A call that stopped with an error answers {-1}, and
--       the others stand: `admit` makes its checks and reads before it writes, so such a
--       call wrote nothing of its decision (as one sent alone that failed).

local calls = tonumber(ARGV[1])
local out = {}
local k, a = 1, 2
for i = 1, calls do
  local which, nk, na = tonumber(ARGV[a]), tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
  local keys, argv = {}, {}
  for j = 1, nk do keys[j] = KEYS[k + j - 1] end
  for j = 1, na do argv[j] = ARGV[a + 2 + j] end
  k, a = k + nk, a + 3 + na
  local run = admit
  if which == 1 then run = admit_one end
  local ok, reply = pcall(run, keys, argv)
  if ok then out[i] = reply else out[i] = {-1} end
end
return out
