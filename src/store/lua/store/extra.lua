-- The helpers `admit_one` does not call, after common.lua in every other script. A script's
-- local functions are closures made anew on each call (about 800 instructions each in
-- Redis), so the hot call alone makes only those it calls.

-- Units went back into the budgets of the API key whose keys are among `keys` (a refund, an
-- undone admission, a slice's unspent units), or a debt was charged to them (a write-back):
-- every instance that refuses the key from memory (its deny cache, `redis/deny_cache.rs`)
-- hears it and asks again. Named by the key's tag.
local function gave_back(keys)
  for _, k in ipairs(keys) do
    if keys_own(k) then
      -- pcall: after the writes, an error (a Redis user whose ACL denies the channel: its
      -- instances cannot subscribe either, so none keeps refusals) must not make the caller
      -- send what already ran again.
      redis.pcall('PUBLISH', 'tollgate:given-back', string.sub(k, 3, 12))
      return
    end
  end
end

-- A lease set lives as long as its longest lease (whatever lease_ttl each instance uses).
local function expire_with_last_lease(set)
  local last = redis.call('ZRANGE', set, -1, -1, 'WITHSCORES')
  if last[2] then
    redis.call('PEXPIREAT', set, int(ceil_div(tonumber(last[2]), 1000) + 1000))
  end
end

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

-- A budget's level (per_unit `p`, draining `q`) once a settling is applied: `charge` units
-- (from `take_holds`) added, and a late settling's unspent units (`late`) given back -- as
-- far as the expiry's full charge of them has not drained since: what drained stands for
-- other requests' charges now, and giving it back would let a burst pass the bucket.
local function settled_level(level, charge, late, p, q, now)
  level = level + charge * p
  if late then
    local left = math.max(0, late.charged * p - q * (now - late.at))
    level = math.max(0, level - math.min(late.units * p, left))
  end
  return level
end

-- settle, unspend and peek: KEYS[1] the key's holds, KEYS[2..] its budgets with ARGV
-- per_unit, rate from ARGV[first]. The per_unit and rate of budget KEYS[i]:
local function hold_budget(i, first)
  local j = first + 2 * (i - 2)
  return tonumber(ARGV[j]), tonumber(ARGV[j + 1])
end

-- Adds `units` (negative: takes) to the level of each budget KEYS[2..] (ARGV from `first`).
local function charge_budgets(units, now, first)
  for i = 2, #KEYS do
    local p, q = hold_budget(i, first)
    store_level(KEYS[i], level_at(KEYS[i], p, q, now) + units * p, p, q, now)
  end
end

-- refund and debit take one budget per key: KEYS[i] with ARGV per_unit, rate, cost from
-- ARGV[1 + 3 (i - 1)] (several budgets of one request in one call). With `levels`, each
-- budget's level afterwards goes into it, in order.
local function adjust(sign, levels, budgets)
  local now = now_us()
  for i = 1, budgets or #KEYS do
    local j = 1 + 3 * (i - 1)
    local p = tonumber(ARGV[j])
    local q = tonumber(ARGV[j + 1])
    local level = level_at(KEYS[i], p, q, now) + sign * tonumber(ARGV[j + 2]) * p
    store_level(KEYS[i], level, p, q, now)
    if levels then levels[i] = math.max(0, level) end
  end
  return 1
end
