
-- admit: decides one request and, when it passes, charges it and takes its slots.
--
-- KEYS  [1] budget, [2] key leases, [3] route leases (an unused set is the budget key
--       again: never touched), [4] the key's holds, [5..n-1] further budgets, [n] the
--       admission's record
-- ARGV  [1] per_unit [2] rate [3] capacity [4] max_delay [5] floor, [6] cost [7] key_cap
--       [8] route_cap [9] lease_id [10] lease_ttl_us [11] slice [12] unspent [13] settle_id
--       [14] grant_id [15] hold_ttl_us, then per_unit rate capacity max_delay floor of each
--       further budget (five from [16]), then the settled hold's units and grant time (as
--       `settle`'s, for a hold Redis lost), then record_ms
-- reply {code, a, remaining, reset_us, granted, now_us, level of each budget..., held ticks
--       of each budget...}, packed (`pack.lua`): code OVER_BUDGET (a = retry_after_us),
--       KEY_BUSY, ROUTE_BUSY, ADMITTED (a = delay_us), UNDONE (the id was given up: nothing written). With
--       further budgets the reply goes on: decisive budget's index, then remaining,
--       reset_us of each.
--
-- Charges only when admitted, and then every budget (all fit, or none is charged) -- except
-- the settling of hold `settle_id` ('' for none) with `unspent` units not spent, which is
-- done first, whatever the answer. `slice` asks for that many extra units as hold
-- `grant_id`, live for hold_ttl_us: granted in full when cost + slice fit every budget with
-- `floor` units of it still left and no max_delay in play, else not at all (granted 0, and
-- the request is decided exactly as without it). The figures describe the budgets as if the
-- granted units were not held (what the instance shows while it holds them); levels and
-- held ticks are the stored ones, at now_us.

local cost = tonumber(ARGV[6])
local key_cap = tonumber(ARGV[7])
local route_cap = tonumber(ARGV[8])
local lease = ARGV[9]
local ttl = tonumber(ARGV[10])
local slice = tonumber(ARGV[11])
local unspent = tonumber(ARGV[12])
local settle = ARGV[13]
local grant_id = ARGV[14]
local hold_ttl = tonumber(ARGV[15])
-- The settled hold's size and grant time, in case Redis lost it, then the record's life.
local settle_units = tonumber(ARGV[#ARGV - 2]) or 0
local settle_us = tonumber(ARGV[#ARGV - 1]) or 0
local record_ms = tonumber(ARGV[#ARGV])
local record = KEYS[#KEYS]
local holds = KEYS[4]
-- Every budget the request must fit: KEYS[1] (ARGV 1-5), then KEYS[5], KEYS[6], ... with
-- five ARGV each from ARGV[16] on (crate::budget::decide_all, all or nothing).
local function budget(key, j)
  return {key = key, p = tonumber(ARGV[j]), q = tonumber(ARGV[j + 1]),
          cap = tonumber(ARGV[j + 2]), delay = tonumber(ARGV[j + 3]),
          floor = tonumber(ARGV[j + 4]), own = keys_own(key)}
end
local b = {budget(KEYS[1], 1)}
for i = 1, math.floor((#ARGV - 18) / 5) do
  b[#b + 1] = budget(KEYS[4 + i], 16 + 5 * (i - 1))
end
local now = now_us()
local granted = 0
-- The reply: {code, a, remaining, reset_us, granted, now, levels..., helds...} of the
-- decisive budget and, when there are several, its index (from 0) and every budget's
-- remaining and reset_us. `after` = the levels after the charge; `decisive` = nil picks the
-- tightest (fewest left; of equals, the one full again last; then the first: as
-- `budget::tightest`).
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
      local r, d = figs[i][1], figs[decisive][1]
      if r < d or (r == d and figs[i][2] > figs[decisive][2]) then decisive = i end
    end
  end
  local out = {code, a, figs[decisive][1], figs[decisive][2], granted, now}
  for _, x in ipairs(b) do
    if after then out[#out + 1] = x.next else out[#out + 1] = x.level end
  end
  for _, x in ipairs(b) do
    out[#out + 1] = x.held + granted * x.p
  end
  if #b > 1 then
    out[#out + 1] = decisive - 1
    for i = 1, #b do
      out[#out + 1] = figs[i][1]
      out[#out + 1] = figs[i][2]
    end
  end
  return packed(out)
end
local seen = redis.call('GET', record)
if seen then
  -- This call ran before (a resend), or was given up and undone (a late delivery): it
  -- writes nothing, and says what its record says, with the budgets as they are now.
  local live = take_holds(holds, '', 0, now, false)
  for _, x in ipairs(b) do
    x.level = level_at(x.key, x.p, x.q, now)
    x.held = x.own and live * x.p or 0
    x.next = x.level
  end
  if seen == '1' then return reply(ADMITTED, 0, false, nil) end
  return reply(UNDONE, 0, false, nil)
end
local lost = lost_hold(holds, settle, settle_units, unspent, settle_us)
local live, charge, last, _, late = take_holds(holds, settle, unspent, now, true)
if lost then
  charge = charge + settle_units - unspent
  bury(holds, settle, now, 0)
end
if settle ~= '' and (unspent > 0 or late) then gave_back({holds}) end
local refused, retry = nil, 0
for i, x in ipairs(b) do
  x.level = level_at(x.key, x.p, x.q, now)
  x.held = 0
  if x.own then
    x.held = live * x.p
    if charge > 0 or late then
      -- A settled or expired hold's spent units: charged before anything is decided (and a
      -- late settling's unspent units given back).
      x.level = settled_level(x.level, charge, late, x.p, x.q, now)
      store_level(x.key, x.level, x.p, x.q, now)
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
redis.call('SET', record, '1', 'PX', int(record_px(keep, record_ms)))
for _, x in ipairs(b) do
  store_level(x.key, x.next, x.p, x.q, now)
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
