#!lua
-- tollgate's shared store: every operation on budgets and leases, atomically, on Redis TIME.
--
-- The budget arithmetic is a transcription of crate::budget (decide, refund, level_at); tests
-- drive the memory and Redis stores with one sequence and compare. Every number stays an
-- integer below 2^53 (the config refuses limits that could not), so doubles are exact here.
-- Numbers go back to Redis as integer strings: tostring() would use an exponent above 1e14.
--
-- A budget is the string "level:at_us:rate" (ticks, µs, ticks drained per µs); a lease set is
-- a sorted set of lease ids scored by expiry (µs).
--
-- A key's budget slices (crate::store::redis::slices) are *holds*: the hash `t{tag}h` maps a
-- hold id (`<instance>:s<n>`) to "units:expiry_us". A live hold counts as charged in every one
-- of the key's budgets (`t{` keys; never a route's `t:r{`) and never drains: what an instance
-- spends of it is charged to the level only when it settles the hold (`settle`, or the
-- settle part of its next `admit`), so no unit drains before it was admitted and a burst never
-- exceeds max_cost. A hold past its expiry (its instance died) is charged in full by the next
-- call that sees it. Settling is idempotent: a hold that is gone (settled, or charged as
-- expired) is not settled again. The hash's field `~` dates it ('@' and the Redis TIME when
-- it was made):
-- a hold missing from a hash made after it was granted (or from no hash) was lost with
-- Redis's data (a restart without persistence, an empty replica promoted), so `settle`
-- charges what its instance spent of it then, once (a tombstone answers a resend).
--
-- The `#!lua` line makes this a flagged script (Redis 7): Redis refuses it before running it
-- when it is out of memory (`maxmemory` + `noeviction`), a replica (READONLY) or otherwise
-- unable to write, so such an error reply means nothing was written. Every operation makes
-- its checks and reads before its first write as well, so a script error means the same.
--
-- Admission ids: every `admit` names its call (`lease_id`, unique across the fleet) and a
-- record key in the key's slot, `t{tag}a<id>`. An admission that charges records '1' there
-- (for `record_ms`, or less: until its budgets are full again); `undo` of an id refunds and releases what its admission took, once, and
-- leaves 'u'. An `admit` that finds its record already there (a resend, or a call delivered
-- late after the gateway gave it up and undid it) writes nothing and answers from it:
-- admitted (the charge stands, not charged again) or UNDONE.
--
-- ARGV[1] is the operation:
--   admit  KEYS budget, key leases, route leases, the key's holds, further budgets...,
--               the admission's record
--          ARGV per_unit rate capacity max_delay floor, cost key_cap route_cap lease_id
--               lease_ttl_us slice unspent settle_id grant_id hold_ttl_us, then per_unit
--               rate capacity max_delay floor of each further budget, then the settled
--               hold's units and grant time (as `settle`'s, for a hold Redis lost), then
--               record_ms
--          -> {code, a, remaining, reset_us, granted, now_us, level of each budget...,
--             held ticks of each budget...}:
--             code 0 over budget (a = retry_after_us), 1 key cap full, 2 route cap full,
--             3 admitted (a = delay_us), 4 undone (the id was given up: nothing written).
--             Charges only when admitted, and then every budget
--             (all fit, or none is charged) -- except the settling of hold `settle_id` ('' for
--             none) with `unspent` units not spent, which is done first, whatever the answer.
--             `slice` asks for that many extra units as hold `grant_id`, live for
--             hold_ttl_us: granted in full when cost + slice fit every budget with `floor`
--             units of it still left and no max_delay in play, else not at all (granted 0,
--             and the request is decided exactly as without it). The figures describe the
--             budgets as if the granted units were not held (what the instance shows while it
--             holds them); levels and held ticks are the stored ones, at now_us. With
--             further budgets the reply goes on: decisive budget's index, then remaining,
--             reset_us of each.
--   settle KEYS the key's holds, its budgets...  ARGV hold_id unspent (per_unit rate)...
--          units granted_us
--          -> 1 (charges what hold_id spent, and expired holds, to each budget; a hold of
--          `units` granted at granted_us that Redis lost: units - unspent)
--   unspend KEYS the key's holds, its budgets...  ARGV hold_id cost (per_unit rate)...
--          -> 1 (a request spent from hold_id refunded: out of the hold while it is not
--          settled, else out of each budget)
--   refund KEYS budget...        ARGV (per_unit rate cost)...     -> 1
--   debit  KEYS budget...        ARGV (per_unit rate cost)... id  -> 1 (charges even past
--          capacity: units already admitted elsewhere; the key then waits out the debt;
--          once per id unless it is '0')
--   peek   KEYS the key's holds, its budgets...  ARGV '' 0 (per_unit rate)...
--          -> each budget's level now, holds included (ticks), one atomic view
--   lease  KEYS lease sets...    ARGV lease_id ttl_us (0 = release) -> 1 (a renewal
--          re-creates a lease that is missing)
--   take   KEYS route leases     ARGV route_cap lease_id lease_ttl_us -> 3 (ADMITTED: slot
--          taken) or 2 (ROUTE_BUSY: nothing written). On Redis Cluster a route's lease set is
--          in another slot than the key's budget: `admit` (without the route) then `take`.
--   undo   KEYS record, key leases (the record again: none), budget...
--          ARGV lease_id tombstone_ms (per_unit rate cost)...
--          -> 1 (the admission had charged: refunded, its key lease released) or 0 (it had
--          not, or was undone already). Leaves 'u' for tombstone_ms, so that the admission,
--          should it arrive later, writes nothing; safe to send again.

-- admit's reply codes (crate::store::redis::script::AdmitCode mirrors them; a test compares).
local OVER_BUDGET, KEY_BUSY, ROUTE_BUSY, ADMITTED, UNDONE = 0, 1, 2, 3, 4

local function int(x) return string.format('%.0f', x) end

local function now_us()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end

local function ceil_div(a, b)
  return math.floor((a + b - 1) / b)
end

-- The budget's level at `now` in ticks of drain rate `q` (0 when absent or drained).
local function level_at(key, q, now)
  local v = redis.call('GET', key)
  if not v then return 0 end
  local l, at, r = string.match(v, '^(%d+):(%d+):(%d+)$')
  if not l then return 0 end
  l = tonumber(l)
  at = tonumber(at)
  r = tonumber(r)
  if r ~= q and r > 0 then
    -- a reload changed the rate: keep the time until empty
    l = math.ceil(l * q / r)
  end
  local elapsed = now - at
  if elapsed < 0 then elapsed = 0 end
  if elapsed * q >= l then return 0 end
  return l - elapsed * q
end

local function store_level(key, level, q, now)
  if level <= 0 then
    redis.call('DEL', key)
    return
  end
  -- expire exactly when the bucket is empty again
  local px = math.max(1, ceil_div(ceil_div(level, q), 1000))
  redis.call('SET', key, int(level) .. ':' .. int(now) .. ':' .. int(q), 'PX', int(px))
end

-- A lease set lives as long as its longest lease (whatever lease_ttl each instance uses).
local function expire_with_last_lease(set)
  local last = redis.call('ZRANGE', set, -1, -1, 'WITHSCORES')
  if last[2] then
    redis.call('PEXPIREAT', set, int(ceil_div(tonumber(last[2]), 1000) + 1000))
  end
end

local function remaining(cap, level, p)
  if cap > level then return math.floor((cap - level) / p) end
  return 0
end

-- A key's holds at `now`: the units of live ones, the units to charge now -- what hold
-- `settle` spent (all but `unspent`) and all of every expired one -- and when the last live
-- one expires (0: none). With `write`, the charged holds are removed (the caller charges
-- them); without, nothing is written (a peek).
local BORN = '~'

local function take_holds(holds, settle, unspent, now, write)
  local live, charge, last = 0, 0, 0
  local all = redis.call('HGETALL', holds)
  for i = 1, #all, 2 do
    local units, exp = string.match(all[i + 1], '^(%d+):(%d+)$')
    units, exp = tonumber(units) or 0, tonumber(exp) or 0
    if all[i] == BORN then
      -- the hash's date, not a hold
    elseif all[i] == settle then
      charge = charge + units - math.min(units, unspent)
    elseif exp <= now then
      charge = charge + units
    else
      live = live + units
      if units > 0 and exp > last then last = exp end
    end
    if write and all[i] ~= BORN and (all[i] == settle or exp <= now) then
      redis.call('HDEL', holds, all[i])
    end
  end
  return live, charge, last
end

-- How long a lost hold's tombstone answers a resent settling (past the instance's last one).
local TOMBSTONE_US = 60000000

-- Reads only: was hold `id` (of `units`, `unspent` of them not spent, granted at Redis TIME
-- `granted_us`) lost with Redis's data? It is missing from a hash made after the grant, or
-- from no hash. Only a hold something was spent of matters.
local function lost_hold(holds, id, units, unspent, granted_us)
  if id == '' or units <= unspent or redis.call('HEXISTS', holds, id) == 1 then
    return false
  end
  local born = tonumber(string.sub(redis.call('HGET', holds, BORN) or '', 2))
  return born == nil or born > granted_us
end

-- A lost hold whose spent units are being charged: a 0-unit tombstone answers a resend.
local function bury(holds, id, now)
  redis.call('HSET', holds, id, '0:' .. int(now + TOMBSTONE_US))
  redis.call('HSETNX', holds, BORN, '@' .. int(now))
  local pttl = redis.call('PTTL', holds)
  if pttl < 0 or pttl < TOMBSTONE_US / 1000 then
    redis.call('PEXPIRE', holds, int(TOMBSTONE_US / 1000))
  end
end

-- Holds count in the key's own budgets only, never in a route's shared one.
local function keys_own(key)
  return string.sub(key, 1, 2) == 't{'
end

local op = ARGV[1]

if op == 'admit' then
  local cost = tonumber(ARGV[7])
  local key_cap = tonumber(ARGV[8])
  local route_cap = tonumber(ARGV[9])
  local lease = ARGV[10]
  local ttl = tonumber(ARGV[11])
  local slice = tonumber(ARGV[12])
  local unspent = tonumber(ARGV[13])
  local settle = ARGV[14]
  local grant_id = ARGV[15]
  local hold_ttl = tonumber(ARGV[16])
  -- The settled hold's size and grant time, in case Redis lost it, then the record's life.
  local settle_units = tonumber(ARGV[#ARGV - 2]) or 0
  local settle_us = tonumber(ARGV[#ARGV - 1]) or 0
  local record_ms = tonumber(ARGV[#ARGV])
  local record = KEYS[#KEYS]
  local holds = KEYS[4]
  -- Every budget the request must fit: KEYS[1] (ARGV 2-6), then KEYS[5], KEYS[6], ... with
  -- five ARGV each from ARGV[17] on (crate::budget::decide_all, all or nothing).
  local function budget(key, j)
    return {key = key, p = tonumber(ARGV[j]), q = tonumber(ARGV[j + 1]),
            cap = tonumber(ARGV[j + 2]), delay = tonumber(ARGV[j + 3]),
            floor = tonumber(ARGV[j + 4]), own = keys_own(key)}
  end
  local b = {budget(KEYS[1], 2)}
  for i = 1, math.floor((#ARGV - 19) / 5) do
    b[#b + 1] = budget(KEYS[4 + i], 17 + 5 * (i - 1))
  end
  local now = now_us()
  local granted = 0
  -- The reply: {code, a, remaining, reset_us, granted, now, levels..., helds...} of the
  -- decisive budget and, when there are several, its index (from 0) and every budget's
  -- remaining and reset_us. `after` = the levels after the charge; `decisive` = nil picks the
  -- tightest (fewest left, first of equals).
  local function reply(code, a, after, decisive)
    local figs = {}
    for i, x in ipairs(b) do
      local l = x.level + x.held
      if after then l = x.next + x.held end
      figs[i] = {remaining(x.cap, l, x.p), ceil_div(l, x.q)}
    end
    if decisive == nil then
      decisive = 1
      for i = 2, #b do
        if figs[i][1] < figs[decisive][1] then decisive = i end
      end
    end
    local out = {code, a, figs[decisive][1], figs[decisive][2], granted, int(now)}
    for _, x in ipairs(b) do
      if after then out[#out + 1] = int(x.next) else out[#out + 1] = int(x.level) end
    end
    for _, x in ipairs(b) do
      out[#out + 1] = int(x.held + granted * x.p)
    end
    if #b > 1 then
      out[#out + 1] = decisive - 1
      for i = 1, #b do
        out[#out + 1] = figs[i][1]
        out[#out + 1] = figs[i][2]
      end
    end
    return out
  end
  local seen = redis.call('GET', record)
  if seen then
    -- This call ran before (a resend), or was given up and undone (a late delivery): it
    -- writes nothing, and says what its record says, with the budgets as they are now.
    local live = take_holds(holds, '', 0, now, false)
    for _, x in ipairs(b) do
      x.level = level_at(x.key, x.q, now)
      x.held = x.own and live * x.p or 0
      x.next = x.level
    end
    if seen == '1' then return reply(ADMITTED, 0, false, nil) end
    return reply(UNDONE, 0, false, nil)
  end
  local lost = lost_hold(holds, settle, settle_units, unspent, settle_us)
  local live, charge, last = take_holds(holds, settle, unspent, now, true)
  if lost then
    charge = charge + settle_units - unspent
    bury(holds, settle, now)
  end
  local refused, retry = nil, 0
  for i, x in ipairs(b) do
    x.level = level_at(x.key, x.q, now)
    x.held = 0
    if x.own then
      x.held = live * x.p
      if charge > 0 then
        -- A settled or expired hold's spent units: charged before anything is decided.
        x.level = x.level + charge * x.p
        store_level(x.key, x.level, x.q, now)
      end
    end
    x.next = x.level + cost * x.p
    if x.next + x.held > x.cap + x.delay then
      local r = ceil_div(x.next + x.held - x.cap - x.delay, x.q)
      -- Held units count as charged until settled, and drain only from then: at the latest
      -- when their holds expire. A level that runs dry before that makes the wait longer.
      local after_held = x.held + cost * x.p - x.cap - x.delay
      if x.held > 0 and after_held > 0 then
        r = math.max(r, last - now + ceil_div(after_held, x.q))
      end
      if refused == nil or r > retry then refused, retry = i, r end
    end
  end
  if refused == nil and slice > 0 and grant_id ~= '' and key_cap == 0 and route_cap == 0 then
    granted = slice
    for _, x in ipairs(b) do
      if x.delay > 0 or not x.own
          or x.level + x.held + (cost + slice + x.floor) * x.p > x.cap then
        granted = 0
      end
    end
  end
  if refused then
    return reply(OVER_BUDGET, retry, false, refused)
  end
  if key_cap > 0 and redis.call('ZCOUNT', KEYS[2], int(now), '+inf') >= key_cap then
    return reply(KEY_BUSY, 0, false, nil)
  end
  if route_cap > 0 and redis.call('ZCOUNT', KEYS[3], int(now), '+inf') >= route_cap then
    return reply(ROUTE_BUSY, 0, false, nil)
  end
  local delay = 0
  -- The record lives no longer than the budgets take to be full again (then undoing the
  -- admission would give nothing back: its charge has drained), nor than record_ms.
  local keep = 1
  for _, x in ipairs(b) do keep = math.max(keep, ceil_div(ceil_div(x.next, x.q), 1000)) end
  -- ...and no shorter than its leases: an undo must find them.
  if key_cap > 0 or route_cap > 0 then keep = math.max(keep, ceil_div(ttl, 1000)) end
  redis.call('SET', record, '1', 'PX', int(math.min(keep, record_ms)))
  for _, x in ipairs(b) do
    store_level(x.key, x.next, x.q, now)
    if x.next + x.held > x.cap then
      delay = math.max(delay, ceil_div(x.next + x.held - x.cap, x.q))
    end
  end
  if granted > 0 then
    redis.call('HSET', holds, grant_id, int(granted) .. ':' .. int(now + hold_ttl))
    redis.call('HSETNX', holds, BORN, '@' .. int(now))
    -- The hash outlives its last hold by the time the key's budgets take to drain a full
    -- bucket twice: a hold of a dead instance that no call saw expire has drained by then
    -- as if charged at its expiry.
    local drain = 0
    for _, x in ipairs(b) do drain = math.max(drain, ceil_div(2 * x.cap, x.q)) end
    local until_ms = ceil_div(now + hold_ttl + drain, 1000)
    local pttl = redis.call('PTTL', holds)
    if pttl < 0 or now / 1000 + pttl < until_ms then
      redis.call('PEXPIREAT', holds, int(until_ms))
    end
  end
  for i, limit in ipairs({key_cap, route_cap}) do
    if limit > 0 then
      local set = KEYS[i + 1]
      redis.call('ZREMRANGEBYSCORE', set, '-inf', '(' .. int(now))
      redis.call('ZADD', set, int(now + ttl), lease)
      expire_with_last_lease(set)
    end
  end
  return reply(ADMITTED, delay, true, nil)
end

-- refund and debit take one budget per key: KEYS[i] with ARGV per_unit, rate, cost from
-- ARGV[2 + 3 (i - 1)] (several budgets of one request in one call).
local function adjust(sign)
  local now = now_us()
  for i = 1, #KEYS do
    local j = 2 + 3 * (i - 1)
    local p = tonumber(ARGV[j])
    local q = tonumber(ARGV[j + 1])
    store_level(KEYS[i], level_at(KEYS[i], q, now) + sign * tonumber(ARGV[j + 2]) * p, q, now)
  end
  return 1
end

if op == 'refund' then
  return adjust(-1)
end

-- A debit with an id (the trailing ARGV, '0': none) charges once: a write-back that may have
-- run is sent again with its id, and this key (in the first budget's slot) remembers it, as
-- long as a send delivered late may still arrive (write-backs are rare: outages only).
local WRITE_BACK_SEEN_MS = 1200000

if op == 'debit' then
  local id = ARGV[2 + 3 * #KEYS]
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
end

-- settle, unspend and peek: KEYS[1] the key's holds, KEYS[2..] its budgets with ARGV
-- per_unit, rate from ARGV[4]. The per_unit and rate of budget KEYS[i]:
local function hold_budget(i)
  local j = 4 + 2 * (i - 2)
  return tonumber(ARGV[j]), tonumber(ARGV[j + 1])
end

-- Adds `units` (negative: takes) to each budget's level.
local function charge_budgets(units, now)
  for i = 2, #KEYS do
    local p, q = hold_budget(i)
    store_level(KEYS[i], level_at(KEYS[i], q, now) + units * p, q, now)
  end
end

if op == 'settle' then
  local now = now_us()
  local holds, id, unspent = KEYS[1], ARGV[2], tonumber(ARGV[3])
  local units = tonumber(ARGV[4 + 2 * (#KEYS - 1)]) or 0
  local granted_us = tonumber(ARGV[5 + 2 * (#KEYS - 1)]) or 0
  local lost = lost_hold(holds, id, units, unspent, granted_us)
  local _, charge = take_holds(holds, id, unspent, now, true)
  if lost then
    charge = charge + units - unspent
    bury(holds, id, now)
  end
  if charge > 0 then charge_budgets(charge, now) end
  return 1
end

if op == 'unspend' then
  -- A request spent from hold ARGV[2] got its cost ARGV[3] back: the hold shrinks if it is
  -- not settled yet, else (its units are in the levels now) the budgets get it back.
  local v = redis.call('HGET', KEYS[1], ARGV[2])
  local cost = tonumber(ARGV[3])
  if v then
    local units, exp = string.match(v, '^(%d+):(%d+)$')
    if units then
      units = math.max(0, tonumber(units) - cost)
      redis.call('HSET', KEYS[1], ARGV[2], int(units) .. ':' .. exp)
      return 1
    end
  end
  charge_budgets(-cost, now_us())
  return 1
end

if op == 'peek' then
  local now = now_us()
  local live, charge = take_holds(KEYS[1], '', 0, now, false)
  local levels = {}
  for i = 2, #KEYS do
    local p, q = hold_budget(i)
    -- Holds count in the key's own budgets only, as in admit (a route's is never passed).
    local held = keys_own(KEYS[i]) and (live + charge) or 0
    levels[#levels + 1] = level_at(KEYS[i], q, now) + held * p
  end
  return levels
end

if op == 'lease' then
  local ttl = tonumber(ARGV[3])
  if ttl == 0 then
    for i = 1, #KEYS do redis.call('ZREM', KEYS[i], ARGV[2]) end
    return 1
  end
  local now = now_us()
  for i = 1, #KEYS do
    -- A renewal re-creates a lease that is missing: Redis lost it with its data (a restart
    -- without persistence, an empty replica promoted), or it lapsed while its instance was
    -- paused. Its request is still running, so its slot is taken, whoever else took it
    -- meanwhile (DESIGN §4 bounds that).
    redis.call('ZADD', KEYS[i], int(now + ttl), ARGV[2])
    expire_with_last_lease(KEYS[i])
  end
  return 1
end

if op == 'take' then
  local route_cap = tonumber(ARGV[2])
  local now = now_us()
  if redis.call('ZCOUNT', KEYS[1], int(now), '+inf') >= route_cap then
    return ROUTE_BUSY
  end
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. int(now))
  redis.call('ZADD', KEYS[1], int(now + tonumber(ARGV[4])), ARGV[3])
  expire_with_last_lease(KEYS[1])
  return ADMITTED
end

if op == 'undo' then
  local record, lease_set, tomb_ms = KEYS[1], KEYS[2], tonumber(ARGV[3])
  local seen = redis.call('GET', record)
  if seen and seen ~= '1' then return 0 end
  if seen == '1' then
    local now = now_us()
    for i = 3, #KEYS do
      local j = 4 + 3 * (i - 3)
      local p, q = tonumber(ARGV[j]), tonumber(ARGV[j + 1])
      store_level(KEYS[i], level_at(KEYS[i], q, now) - tonumber(ARGV[j + 2]) * p, q, now)
    end
    if lease_set ~= record then redis.call('ZREM', lease_set, ARGV[2]) end
  end
  redis.call('SET', record, 'u', 'PX', int(tomb_ms))
  if seen == '1' then return 1 end
  return 0
end

return redis.error_reply('tollgate: unknown operation ' .. tostring(op))
