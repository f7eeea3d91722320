#!lua
-- tollgate's shared store, the part every operation's script starts with: each operation on
-- budgets and leases is a script of its own (the other files here; `script.rs` prepends this
-- one to each), atomic, on Redis TIME.
--
-- The `#!lua` line makes each a flagged script (Redis 7): Redis refuses it before running it
-- when it is out of memory (`maxmemory` + `noeviction`), a replica (READONLY) or otherwise
-- unable to write, so such an error reply means nothing was written. Every operation makes
-- its checks and reads before its first write as well, so a script error means the same.
-- Every key of one call is in one hash slot (`{tag}`; Redis Cluster refuses others).
--
-- The budget arithmetic is a transcription of crate::budget (decide, refund, level_at); tests
-- drive the memory and Redis stores with one sequence and compare. Every number stays an
-- integer below 2^53 (the config refuses limits that could not), so doubles are exact here.
-- Numbers go back to Redis as integer strings: tostring() would use an exponent above 1e14.
--
-- A budget is the string "level:at_us:rate:per_unit" (ticks, µs, ticks drained per µs, ticks
-- per unit; one stored before tollgate kept per_unit has three fields); a lease set is a sorted
-- set of lease ids scored by expiry (µs).
--
-- A key's budget slices (crate::store::redis::slices) are *holds*: the hash `t{tag}h` maps a
-- hold id (`<instance>:s<n>`) to "units:expiry_us". A live hold counts as charged in every one
-- of the key's budgets (`t{` keys; never a route's `t:r{`) and never drains: what an instance
-- spends of it is charged to the level only when it settles the hold (`settle`, or the
-- settle part of its next `admit`), so no unit drains before it was admitted and a burst never
-- exceeds max_cost. A hold past its expiry (its instance died, or its settling is late) is
-- charged in full by the next call that sees it, and a settling that still comes gives back
-- what was not spent (`take_holds`). Settling is idempotent: a hold that is gone (settled)
-- is not settled again. The hash's field `~` dates it ('@' and the Redis TIME when it was
-- made):
-- a hold missing from a hash made after it was granted (or from no hash) was lost with
-- Redis's data (a restart without persistence, an empty replica promoted), so `settle`
-- charges what its instance spent of it then, once (a tombstone answers a resend).
--
-- Admission ids: every `admit` names its call (`lease_id`, unique across the fleet) and a
-- record key in the key's slot, `t{tag}a<id>`. An admission that charges records '1' there
-- (for `record_ms`, or less: until its budgets are full again); `undo` of an id refunds and
-- releases what its admission took, once, and leaves 'u'. An `admit` that finds its record
-- already there (a resend, or a call delivered late after the gateway gave it up and undid
-- it) writes nothing and answers from it: admitted (the charge stands, not charged again) or
-- UNDONE.

-- How long an admission's record lives (ms): no longer than `keep` (until its budgets are
-- full again: undoing it would give nothing back then; no shorter than its leases), nor than
-- `record_ms` -- except when `record_ms` is negative: then exactly -record_ms. A capped
-- route's charge is recorded so, for as long as its request may wait in the queue and a
-- while more, whatever its budgets, so that its refund can tell a charge Redis lost from one
-- it holds (`refund.lua`); written with the charge, the two are lost together or not at all.
local function record_px(keep, record_ms)
  if record_ms < 0 then return -record_ms end
  return math.min(keep, record_ms)
end

-- admit's reply codes (crate::store::redis::script::AdmitCode mirrors them; a test compares).
local OVER_BUDGET, KEY_BUSY, ROUTE_BUSY, ADMITTED, UNDONE = 0, 1, 2, 3, 4

-- Every number here is an integer (below 2^53), so '%d' (an integer conversion) writes it
-- exactly, where '%.0f' runs the floating-point formatter: ~10 % of a call's CPU in Redis.
local function int(x) return string.format('%d', x) end

-- A batch (`admit_batch`) reads TIME once and decides each of its calls at that instant.
local batch_now = nil
-- The hot scripts' tonumber of an argument: `tonumber` in a call alone; a batch
-- (`admit_batch`) puts one in its place that converts each string once per batch.
local num = tonumber

local function now_us()
  if batch_now then return batch_now end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end

local function ceil_div(a, b)
  return math.floor((a + b - 1) / b)
end

-- Most ticks a converted level keeps (crate::budget::level_at's MAX_TICKS * 2).
local MAX_LEVEL = 4503599627370496

local function store_level(key, level, p, q, now)
  if level <= 0 then
    redis.call('DEL', key)
    return
  end
  -- expire exactly when the bucket is empty again
  local px = math.max(1, ceil_div(ceil_div(level, q), 1000))
  -- one format call: three and a concatenation cost ~3,000 instructions more in Redis
  redis.call('SET', key, string.format('%d:%d:%d:%d', level, now, q, p), 'PX', int(px))
end

-- The budget's level at `now` in ticks of `p` per unit, drained at `q` per µs (0 when absent
-- or drained). A level stored under another budget (a reload changed it) is converted and
-- stored again, in the new budget's units and with its expiry: a refusal writes nothing else,
-- and the old expiry would drop what was carried. (The rewrite changes no figure, so a script
-- that fails after it has still written nothing that counts.)
local function level_at(key, p, q, now)
  local v = redis.call('GET', key)
  if not v then return 0 end
  local l, at, r, u = string.match(v, '^(%d+):(%d+):(%d+):?(%d*)$')
  if not l then return 0 end
  l = tonumber(l)
  at = tonumber(at)
  local converted = false
  if u ~= '' then
    u = num(u)
    if u ~= p and u > 0 then
      -- A reload changed the budget: carry the units spent. `l` ticks of `u` per unit in
      -- ticks of `p`, rounded up, as crate::budget::level_at (exact in u128) has them: the
      -- ratio in lowest terms, then the whole units' part and the rest's apart, so that no
      -- product passes 2^53 for the windows and costs a config can hold. (Inline: a local
      -- function would be made on every call of every script.)
      local a, b = p, u
      while b ~= 0 do a, b = b, a % b end
      local pp, uu = p / a, u / a
      local whole = math.floor(l / uu)
      local rest = l - whole * uu
      if rest < 0 then
        whole, rest = whole - 1, rest + uu
      elseif rest >= uu then
        whole, rest = whole + 1, rest - uu
      end
      l = math.min(whole * pp + ceil_div(rest * pp, uu), MAX_LEVEL)
      converted = true
    end
  else
    r = num(r)
    if r ~= q and r > 0 then
      -- stored before per_unit was kept: keep the time until empty
      l = math.min(math.ceil(l * q / r), MAX_LEVEL)
      converted = true
    end
  end
  local elapsed = now - at
  if elapsed < 0 then elapsed = 0 end
  local level = 0
  if elapsed * q < l then level = l - elapsed * q end
  if converted then store_level(key, level, p, q, now) end
  return level
end

-- A key's holds at `now`: the units of live ones, the units to charge now -- what hold
-- `settle` spent (all but `unspent`) and all of every expired one -- when the last live one
-- expires (0: none), and the holds so charged (`gone`, for `drop_holds`). With `write`,
-- those are dropped (the caller charges them); without, nothing is written (a peek, or a
-- caller that decides first and drops them with `drop_holds` if it writes at all).
--
-- A hold that expires unsettled becomes a tombstone, "0:<until>:<units charged>": if its
-- settling comes after all (delayed by an outage or a failover), `take_holds` says what it
-- gives back (`late`: the units not spent, which the expiry charged; `settled_level` on each
-- budget). The tombstone is then dropped as any settled hold is.
local BORN = '~'
-- How long a tombstone answers a settling sent late or again (past the instance's last one).
local TOMBSTONE_US = 60000000

-- Makes hold `id` a tombstone until TOMBSTONE_US from now, the hash living as long:
-- `charged` > 0 for one charged in full at expiry, 0 for a lost one whose spent units were
-- charged (a settling sent again finds nothing to charge).
local function bury(holds, id, now, charged)
  local v = '0:' .. int(now + TOMBSTONE_US)
  if charged > 0 then
    v = v .. ':' .. int(charged)
  else
    -- (a lost hold's: the hash may be new; an expired one's hash keeps its date)
    redis.call('HSETNX', holds, BORN, '@' .. int(now))
  end
  redis.call('HSET', holds, id, v)
  local pttl = redis.call('PTTL', holds)
  if pttl < 0 or pttl < TOMBSTONE_US / 1000 then
    redis.call('PEXPIRE', holds, int(TOMBSTONE_US / 1000))
  end
end

-- Drops the holds `take_holds` charged: settled ones and spent tombstones removed (one
-- command), expired ones buried.
local function drop_holds(holds, gone, now)
  if #gone > 0 then redis.call('HDEL', holds, unpack(gone)) end
  local expired = gone.expired
  if expired then
    for i = 1, #expired, 2 do bury(holds, expired[i], now, expired[i + 1]) end
  end
end

local function take_holds(holds, settle, unspent, now, write)
  local live, charge, last, gone, late = 0, 0, 0, {}, nil
  local all = redis.call('HGETALL', holds)
  for i = 1, #all, 2 do
    local units, exp, charged = string.match(all[i + 1], '^(%d+):(%d+):?(%d*)$')
    units, exp, charged = tonumber(units) or 0, tonumber(exp) or 0, tonumber(charged)
    if all[i] == BORN then
      -- the hash's date, not a hold
    elseif all[i] == settle then
      charge = charge + units - math.min(units, unspent)
      if charged then
        late = {units = math.min(charged, unspent), charged = charged, at = exp - TOMBSTONE_US}
      end
      -- A lost hold's tombstone ("0:<until>") stays until its end, answering every resend:
      -- gone, the hash's date (set when it was buried, after the grant) would call the hold
      -- lost again and charge it twice.
      if units > 0 or charged then gone[#gone + 1] = all[i] end
    elseif exp <= now then
      charge = charge + units
      if units > 0 then
        local e = gone.expired or {}
        e[#e + 1] = all[i]
        e[#e + 1] = units
        gone.expired = e
      else
        gone[#gone + 1] = all[i]
      end
    else
      live = live + units
      if units > 0 and exp > last then last = exp end
    end
  end
  if write then drop_holds(holds, gone, now) end
  return live, charge, last, gone, late
end

-- Holds count in the key's own budgets only, never in a route's shared one.
local function keys_own(key)
  return string.sub(key, 1, 2) == 't{'
end

-- The figures `admit` answers with: how many units fit below `cap` at `level`.
local function remaining(cap, level, p)
  if cap > level then return math.floor((cap - level) / p) end
  return 0
end
