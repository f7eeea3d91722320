
-- pack: how `admit`, `admit_one` and `admit_batch` answer the gateway. A reply of n integers
-- is one string: n, then each integer, every one a signed 64-bit little-endian word (Redis's
-- `struct` library; every figure is an integer below 2^53, so the double converts exactly).
-- A batch answers its calls' packed replies one after another, in one string.
--
-- One bulk string, where a table came back as a RESP array of integers: the gateway's Redis
-- client parses every RESP value with a general parser (~850 instructions each), so an
-- admission's reply of eight figures cost it ~7,700 instructions to read; this is one value
-- per call, or per batch (`crate::store::redis::script::Packed`). Redis itself makes no table
-- for `admit_one`'s reply, and converts one string where it converted each figure.

-- Packing comes after a call's writes, so it must never raise (common.lua: an error means
-- nothing was written): every figure given it is a Lua number, whole, below 2^53.

-- `admit_one`'s reply, and `admit`'s with one budget: eight figures.
local PACK8 = '<i8i8i8i8i8i8i8i8i8'

local function packed8(a, b, c, d, e, f, g, h)
  return struct.pack(PACK8, 8, a, b, c, d, e, f, g, h)
end

local function packed(r)
  local n = #r
  if n == 8 then return struct.pack(PACK8, 8, unpack(r)) end
  return struct.pack('<' .. string.rep('i8', n + 1), n, unpack(r))
end
