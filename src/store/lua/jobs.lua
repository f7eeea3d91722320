-- An async job's record (DESIGN §8), a hash at KEYS[1] (`t:j:<id>`), on Redis TIME (ms):
--   key (hex of the key's hash), route, state (queued | running | done | failed | cancelled |
--   expired), runner (instance), alive (ms until which the runner vouches for it), ttl (ms a
--   result is kept), method, target, headers, body (the request), status,
--   rheaders, rbody (the result), lost (1: the runner died), sub (submitted, ms), delay (ms
--   after `sub` before it may be sent: `max_delay`'s hold), by (the token of the call that
--   took it out of its queue: a claim, a cancel, an expire), gone_at (ms: an expired job
--   reads as gone from then; its record is kept a little longer for its expiry's resends).
--
-- ARGV[1] is the operation:
--   put    ttl_ms, then field value pairs -> 1 (a new record, kept ttl_ms)
--   get    -> the record's fields and values (empty: none), then the pair `due_in <ms>`
--             (until it may be sent, `max_delay`; 0 once due; `get kept`: an expired job
--             past its `gone_at` too), `overdue 1` for a queued job
--             that has waited result_ttl since (to `expire`), and `lapsed <ms>` for a
--             running job whose runner's word for it has lapsed (it may have died, or Redis
--             was silent meanwhile: the reader decides whether to `lose` it): how long reads
--             have found it so, counting at most a second between two of them (Redis may
--             have been silent between: `lapsed_seen`, `lapsed_for`; a renewal clears them)
--   lose   -> as `get`; a running job whose runner's word for it has lapsed becomes failed
--             (lost) first, never to run again, and `uncounted` until an instance takes its
--             end to count and log (`count`)
--   count  -> the record's fields and values when this call took the end of a job found lost
--             to count and log (it was `uncounted`), else empty: one instance counts it, the
--             reader that found it lost, or, should that reader's answer be lost (a call that
--             timed out and ran later), the next reader or its runner
--   claim  runner alive_ms token -> {1, ms until it may be sent} (queued -> running, this
--          runner's; or already so by a claim with this token, sent again: its answer was lost)
--          | {0} (cancelled, finished, gone, or its runner stopped vouching for it) | {2} (it
--          waited result_ttl: queued -> expired, or already so by a claim with this token,
--          sent again; the caller refunds it) | {3} (running, and
--          its runner vouches for it: the slot granted is that run's, its lease having lapsed
--          and come back through the queue; the caller leaves it to the runner)
--   renew  alive_ms -> 1 | 0 (no longer this job's run)
--   (claim and renew keep a running job's record at least `ttl` past its runner's word)
--   finish state, then field value pairs -> 1 (running -> state, kept `ttl` from now; or
--          already that state and not lost: a resend) | 0
--   cancel token -> 1 (queued -> cancelled; or already so by a cancel with this token, sent
--          again: its answer was lost) | 0
--   expire token -> 1 (queued for result_ttl since it may be sent -> expired, kept `ttl`; or
--          already so by an expire with this token, sent again) | 0
-- Every check comes before the first write.

local job = KEYS[1]
local op = ARGV[1]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local function state() return redis.call('HGET', job, 'state') end
local function ttl() return tonumber(redis.call('HGET', job, 'ttl') or '60000') end
local function keep() redis.call('PEXPIRE', job, ttl()) end
-- When the job may be sent (`max_delay`: `delay` after `sub`).
local function due()
  return tonumber(redis.call('HGET', job, 'sub') or '0') + tonumber(redis.call('HGET', job, 'delay') or '0')
end
-- A queued job that has waited result_ttl since it may be sent no longer runs.
local function overdue() return now > due() + ttl() end
-- ms until the job may be sent, 0 once it may.
local function due_in() return math.max(0, due() - now) end
-- A running job's record outlives its runner's word for it (`alive_ms` from now) by `ttl`:
-- however long the run, a reader finds it running, or lost once that word lapses, and its
-- runner finishes it.
local function outlive(alive_ms)
  if redis.call('PTTL', job) < alive_ms + ttl() then redis.call('PEXPIRE', job, alive_ms + ttl()) end
end
-- Whether this call is a resend of the one that took the job out of its queue (a claim, a
-- cancel, an expire, with this `token`): its answer was lost, and it is answered as it was.
local function again(token)
  return (token or '') ~= '' and redis.call('HGET', job, 'by') == token
end
-- A queued job that waited result_ttl: expired by the call with `token`, read as such for
-- `ttl` (then as gone), its record kept at least `resends_ms` (a resend of that call, with
-- its token, still finds it: a result_ttl of a second is shorter than those resends).
local function expire(token, resends_ms)
  redis.call('HSET', job, 'state', 'expired', 'gone_at', now + ttl(), 'by', token or '')
  redis.call('HDEL', job, 'body', 'headers')
  redis.call('PEXPIRE', job, math.max(ttl(), resends_ms))
end

if op == 'put' then
  local ttl = tonumber(ARGV[2])
  local fields = {}
  for i = 3, #ARGV do fields[#fields + 1] = ARGV[i] end
  redis.call('HSET', job, unpack(fields))
  redis.call('HSET', job, 'sub', now)
  redis.call('PEXPIRE', job, ttl)
  return 1
elseif op == 'get' or op == 'lose' then
  local gone_at = tonumber(redis.call('HGET', job, 'gone_at') or '')
  if gone_at and state() == 'expired' and now >= gone_at and ARGV[2] ~= 'kept' then return {} end
  local lapsed = state() == 'running' and tonumber(redis.call('HGET', job, 'alive') or '0') < now
  if lapsed and op == 'lose' then
    redis.call('HSET', job, 'state', 'failed', 'lost', '1', 'uncounted', '1')
    keep()
    lapsed = false
  end
  local lapsed_for = 0
  if lapsed then
    local seen = tonumber(redis.call('HGET', job, 'lapsed_seen') or '0')
    if seen > 0 then
      lapsed_for = tonumber(redis.call('HGET', job, 'lapsed_for') or '0')
        + math.min(math.max(0, now - seen), 1000)
    end
    redis.call('HSET', job, 'lapsed_seen', now, 'lapsed_for', lapsed_for)
  end
  local all = redis.call('HGETALL', job)
  if #all > 0 then
    all[#all + 1] = 'due_in'
    all[#all + 1] = tostring(due_in())
    if state() == 'queued' and overdue() then
      all[#all + 1] = 'overdue'
      all[#all + 1] = '1'
    end
    if lapsed then
      all[#all + 1] = 'lapsed'
      all[#all + 1] = tostring(lapsed_for)
    end
  end
  return all
elseif op == 'claim' then
  local token = ARGV[4] or ''
  if again(token) then
    -- This claim, sent again (its answer was lost): what the first found, said again.
    if state() == 'running' then
      redis.call('HSET', job, 'alive', now + tonumber(ARGV[3]))
      outlive(tonumber(ARGV[3]))
      return {1, due_in()}
    end
    if state() == 'expired' then return {2} end
  end
  if state() == 'running' and tonumber(redis.call('HGET', job, 'alive') or '0') >= now then
    return {3}
  end
  if state() ~= 'queued' then return {0} end
  if overdue() then
    -- The claim that expired it says so again if sent again: its caller refunds it.
    expire(token, tonumber(ARGV[3]))
    return {2}
  end
  redis.call('HSET', job, 'state', 'running', 'runner', ARGV[2], 'alive', now + tonumber(ARGV[3]), 'by', token)
  outlive(tonumber(ARGV[3]))
  return {1, due_in()}
elseif op == 'renew' then
  if state() ~= 'running' then return 0 end
  redis.call('HSET', job, 'alive', now + tonumber(ARGV[2]))
  redis.call('HDEL', job, 'lapsed_seen', 'lapsed_for')
  outlive(tonumber(ARGV[2]))
  return 1
elseif op == 'finish' then
  if state() ~= 'running' then
    -- A resend of this run's own finish, whose first may have run (a job runs once, and only
    -- its runner finishes it): said so again. A job declared lost is not.
    if state() == ARGV[2] and redis.call('HGET', job, 'lost') ~= '1' then return 1 end
    return 0
  end
  local fields = {'state', ARGV[2]}
  for i = 3, #ARGV do fields[#fields + 1] = ARGV[i] end
  redis.call('HSET', job, unpack(fields))
  redis.call('HDEL', job, 'body', 'headers')
  keep()
  return 1
elseif op == 'count' then
  if redis.call('HDEL', job, 'uncounted') == 0 then return {} end
  return redis.call('HGETALL', job)
elseif op == 'cancel' then
  if state() == 'cancelled' and again(ARGV[2]) then return 1 end
  if state() ~= 'queued' then return 0 end
  redis.call('HSET', job, 'state', 'cancelled', 'by', ARGV[2] or '')
  redis.call('HDEL', job, 'body', 'headers')
  redis.call('PEXPIRE', job, 60000)
  return 1
elseif op == 'expire' then
  if state() == 'expired' and again(ARGV[2]) then return 1 end
  if state() ~= 'queued' or not overdue() then return 0 end
  expire(ARGV[2], 10000)
  return 1
end
return redis.error_reply('unknown job operation ' .. tostring(op))
