
-- admit_batch: group commit. Several `admit` calls of one instance, decided in one script
-- call, one after another in the order sent, each exactly as if it had been sent alone at
-- the batch's instant: each is the very `admit` or `admit_one` (`script.rs` wraps each file
-- in a function of its KEYS and ARGV, above this one), on its own keys, after the ones before
-- it, at one Redis TIME read once for the batch (`batch_now`: a call sent alone a few µs
-- later would see a few µs more drained, never less).
--
-- KEYS  every call's KEYS, one call's after the other's
-- ARGV  [1] the number of calls, then for each call: its script (1 admit_one, 2 admit), its
--       number of KEYS, its number of ARGV, then its ARGV
-- reply each call's reply, in order, packed into one string (`pack.lua`). A call that stopped
--       with an error answers {-1} (packed: count 1, then -1), and the others stand: `admit`
--       makes its checks and reads before it writes, so such a call wrote nothing of its
--       decision (as one sent alone that failed).

-- The calls of a batch repeat the same figures (their argument counts, their limits and
-- costs), and Lua's tonumber of a string runs glibc's strtod (~1,200 instructions in Redis):
-- `num` (common.lua) converts each string once per batch (`admit_one` and `level_at` use it).
local numbers = {}
num = function(s)
  local v = numbers[s]
  if v then return v end
  v = tonumber(s)
  if v then numbers[s] = v end
  return v
end

local FAILED = struct.pack('<i8i8', 1, -1)
local calls = tonumber(ARGV[1])
batch_now = now_us()
local out = {}
local k, a = 1, 2
for i = 1, calls do
  local which, nk, na = num(ARGV[a]), num(ARGV[a + 1]), num(ARGV[a + 2])
  local keys, argv = {unpack(KEYS, k, k + nk - 1)}, {unpack(ARGV, a + 3, a + 2 + na)}
  k, a = k + nk, a + 3 + na
  local run = admit
  if which == 1 then run = admit_one end
  local ok, reply = pcall(run, keys, argv)
  if not ok then reply = FAILED end
  out[i] = reply
end
return table.concat(out)
