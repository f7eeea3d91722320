#!lua
-- A capped route's slots and its fair queue, fleet-wide (DESIGN §8), on Redis TIME.
--
-- Every key is in the route's slot (`t:r{<route tag>}…`):
--   KEYS[1] `…f` the route's leases: sorted set, lease id -> expiry (µs)
--   KEYS[2] `…q` the waiters: sorted set, every score 0, member
--            `<key tag>:<seq, 16 digits>:<waiter id>`, so that a key's own waiters sort in
--            arrival order and ZRANGEBYLEX finds a key's oldest
--   KEYS[3] `…k` the keys whose oldest waiter may be served: member `<seq>:<key tag>`, the
--            seq since when the key has waited (its oldest waiter's, or the seq of its last
--            grant or freed lease, whichever is later), score = requests the key runs on the
--            route / its weight. The first member is the next to serve: fewest running per
--            weight, then the longest waiting (with one slot every key runs nothing at a
--            release, and by its oldest waiter alone a key's backlog would keep the slot)
--   KEYS[4] `…s` a hash: `seq` (the counter of arrivals, grants and freed leases); `cap`,
--            `share` (the route's max_in_flight and max_in_flight_per_key, 0 = none, from
--            the latest loaded config a caller had), `since` (that config's load time, ms);
--            `r:<key>` requests the key runs; `wt:<key>` its weight; `h:<key>` its member in
--            KEYS[3]; `e:<key>` the seq of its last grant or freed lease, while it waits;
--            `l:<lease>` the key a lease belongs to; `w:<waiter>` "<key>|<member of
--            KEYS[2]>|<instance>"; `i:<instance>` until when that instance is alive (µs);
--            `g:<instance>` the waiters granted to it, space-separated, until it collects them;
--            `gi:<lease>` the instance a granted lease waits on, until it confirms it;
--            `gw:<lease>` a job's lease (the fleet's, `jobs`): its member of KEYS[2], to queue
--            it again at its place should the lease lapse;
--            `n:<instance>` its waiters, and `insts` the instances with any;
--            `c:<waiter>` "<given_up_us> <charge>": what a waiting request was charged (opaque
--            here: the gateway's refund of it), until it is served, leaves, or its owed charge
--            is paid (KEYS[6]); `jk` until when (µs) queued jobs may wait; `rd:<waiter>`
--            when (µs) a job held for its `max_delay` turn may be served: until then it
--            waits at its place and is passed over (it keeps no slot idle).
--   KEYS[5] `…x` ids given up: sorted set, id -> until when (µs) an `enter` of that id is
--            refused. A `leave` or `release` that finds its id neither waiting nor holding a
--            lease leaves one: the `enter` it gave up on may still be on its way (a timed-out
--            call, a partition that delivers late), and must not take a slot nobody holds.
--   KEYS[6] `…o` charges owed: sorted set, waiter id -> when its charge (`c:<id>`) is due to
--            be refunded (µs). A waiter dropped as a dead instance's (or whose grant lapsed
--            unconfirmed) never ran: its charge is owed back (DESIGN §8), by whoever beats once
--            it is due, OWED_AFTER_US later. Until then its instance may come back for it (it
--            only stalled, or a failover made every instance look dead for a moment): an
--            `enter`, `leave` or `release` of the id takes the charge back as its own. Once a
--            beat hands it out the id is given up (a later `enter` is refused: it never runs on
--            a charge given back), and it stays here, due again OWED_RETRY_US later, until its
--            refunder says `paid` (the refund is made once by its marker, however often sent).
--
-- The `#!lua` line makes this a flagged script (Redis 7): Redis refuses it before running it
-- when it is out of memory (`maxmemory` + `noeviction`), a replica or otherwise unable to
-- write, so such an error reply means nothing was written.
--
-- A slot freed (released, or a lease lapsed) goes to the next waiter in the same call: its
-- waiter id becomes the lease id, held for `grant_ttl_us` until its instance confirms it
-- (renewing it for lease_ttl), and the instance is told on channel `tollgate:q:<instance>`
-- (and by its next `beat`). A waiter whose instance stopped beating is skipped and dropped.
-- The fleet's jobs (instance `jobs`) belong to no process: their waiters are never dropped,
-- only passed over while no instance collects them (none beat as `jobs` within its alive
-- time), and a job's lease that lapses (a grant nobody took: the fleet drained, a beat whose
-- reply was lost; or a runner cut off) puts the job back at its place in the queue. Its
-- record decides whether it runs: a job already claimed is not claimed again, and its grant
-- is released.
--
-- ARGV[1] is the operation; every operation's reply starts with a code:
--   enter  ARGV id key weight cap share max_queue lease_ttl_us instance alive_us grant_ttl_us
--          since (the caller's config's load time, ms: `limits`) [given_up_us charge] (kept
--          as `c:<id>` while it waits: should its instance die, its charge is owed, KEYS[6],
--          and once handed out its id is refused for given_up_us). An id already waiting
--          keeps its place, and one granted meanwhile takes its slot, confirmed (its instance
--          entered it again after beats failed). The fleet's jobs (instance `jobs`) give
--          [keep_us hold_us] instead: how long the job may wait (its record's life; the
--          route's queue then lives at least that long, `jk` in KEYS[4], calls or none), and
--          how long from now it is not to be served (`max_delay`: `rd:<id>`; 0 none).
--          -> {1 TAKEN} | {2 FULL} (max_queue waiters already, and it is no waiter taken back: nothing written) |
--             {0 QUEUED, position (the fleet's jobs: `place`; else the queue's length)} | {3 GIVEN_UP} (a `leave` or `release` of this id came
--             first: nothing written)
--   leave  ARGV id given_up_us -> {0 LEFT} | {1 GRANTED (the caller holds the lease: release
--          it)} | {2 GONE} (and the id is refused for given_up_us)
--   confirm ARGV id lease_ttl_us -> {1} (the granted lease, renewed for lease_ttl) | {0} (it
--          lapsed unconfirmed and went to another waiter: nothing written)
--   hold   ARGV id key lease_ttl_us -> {1}: renews lease `id` for lease_ttl; one the route
--          lost (Redis lost its data, it lapsed while its instance was paused, or a local
--          admission is registered) is made again as `key`'s, which runs one more
--   release ARGV id grant_ttl_us given_up_us -> {0} (the lease or the waiter of that id goes;
--          an id that was neither is refused for given_up_us)
--   beat   ARGV instance alive_us grant_ttl_us below n, then the n ids the instance has on
--          the route (waiting, entering, holding) -> {w, g, o, p, the g waiters granted to
--          it whose grant still holds..., o pairs (id, charge) of charges owed and due, now
--          the caller's to refund and then report `paid` (at most OWED_PER_BEAT; never to the
--          fleet's jobs), then those of the n that are neither waiting nor granted (the queue
--          lost them: a failover, a flush, or dropped as a dead instance's)}, p the charges
--          owed on the route, due or not (its instances beat while any are), w its waiters
--          still waiting
--          (for the fleet's jobs: the route's queued jobs). With `below` > 0, the instance's
--          own waiters and leases (`<instance>:<seq>`, seq < below) that it does not name go.
--   paid   ARGV ids... -> {0}: their owed charges were refunded (they go)
--   place  ARGV id -> {position} (`place`: 1 next, 0 not waiting)
--   jobs   ARGV most -> {id...}: the fleet's waiting jobs, oldest first, at most `most`,
--          among the first JOBS_SCAN waiters; not those held for their turn (`rd:`): none of
--          them has waited its `result_ttl`
--   peek   -> {running, queued, then per key: key, running, waiting}
--   cap    ARGV cap share grant_ttl_us since -> {1} (a reload: the route's cap and per-key
--          share from now on, and free slots to the waiters; kept as long as the queue's
--          state, a minute past its last call at least) | {0} (a later loaded config's
--          figures in force: nothing written)
--   full   ARGV key cap share max_queue since grant_ttl_us -> {1} when an `enter` of `key` now
--          would be refused FULL (no slot for it and max_queue waiters; after the upkeep an
--          `enter` makes: lapsed leases purged, free slots granted, 128 at most), else {0}: a job asks
--          before its body is read, so that a full queue refuses it at once.
-- Reads and checks come before the first write of each operation's own work; the upkeep
-- every operation starts with (the route's call time and the grace after a silence, `wake`;
-- lapsed leases, dead waiters) is safe to repeat, and is all a `{0}` of `confirm` writes.

local QUEUED, TAKEN, FULL, GIVEN_UP = 0, 1, 2, 3
local FLEET = 'jobs'
local OWED_PER_BEAT = 256
local OWED_AFTER_US, OWED_RETRY_US = 5000000, 30000000
local leases, waiters, heads, state, given_up, owed = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local op = ARGV[1]

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])

local function int(x) return string.format('%.0f', x) end

local function num(field)
  return tonumber(redis.call('HGET', state, field) or '0') or 0
end

local function share() return num('share') end
local function cap() return num('cap') end

-- The key's oldest waiter's member of KEYS[2], if any.
local function oldest(key)
  local m = redis.call('ZRANGEBYLEX', waiters, '[' .. key .. ':', '(' .. key .. ';', 'LIMIT', 0, 1)
  return m[1]
end

-- Puts the key's entry in KEYS[3] right: its oldest waiter, at its running / weight, if it
-- may be served (below the route's per-key share).
local function refresh(key)
  local old = redis.call('HGET', state, 'h:' .. key)
  if old then
    redis.call('ZREM', heads, old)
    redis.call('HDEL', state, 'h:' .. key)
  end
  local m = oldest(key)
  if not m then
    redis.call('HDEL', state, 'e:' .. key)
    return
  end
  local running = num('r:' .. key)
  local s = share()
  if s > 0 and running >= s then return end
  -- Both 16 digits: compared as strings, as numbers.
  local seq = string.match(m, '^[^:]*:(%d+):')
  local turn = redis.call('HGET', state, 'e:' .. key)
  if turn and turn > seq then seq = turn end
  local member = seq .. ':' .. key
  local weight = math.max(1, num('wt:' .. key))
  redis.call('ZADD', heads, running / weight, member)
  redis.call('HSET', state, 'h:' .. key, member)
end

-- One of the key's requests got or freed a slot now: it waits from now among its equals
-- (`refresh` puts it in place, and drops the mark once the key has no waiter).
local function turn(key)
  local seq = redis.call('HINCRBY', state, 'seq', 1)
  redis.call('HSET', state, 'e:' .. key, string.format('%016d', seq))
end

-- `running` counts them all (every lease the state names, `l:<id>`), for `purge`.
local function add_running(key, n)
  local r = redis.call('HINCRBY', state, 'r:' .. key, n)
  if r <= 0 then redis.call('HDEL', state, 'r:' .. key) end
  if redis.call('HINCRBY', state, 'running', n) <= 0 then redis.call('HDEL', state, 'running') end
end

-- A lease gone (released or lapsed): its key runs one fewer.
-- (`owing`: its charge was just owed, KEYS[6], and stays until paid or taken back.)
local function lease_gone(id, owing)
  if owing then
    redis.call('HDEL', state, 'gi:' .. id, 'gw:' .. id)
  else
    redis.call('HDEL', state, 'gi:' .. id, 'gw:' .. id, 'c:' .. id)
  end
  local key = redis.call('HGET', state, 'l:' .. id)
  if key then
    redis.call('HDEL', state, 'l:' .. id)
    add_running(key, -1)
    turn(key)
    refresh(key)
  end
end

-- Takes every `word` out of the space-separated list in field `field` (gone once empty).
local function unlist(field, word)
  local list = redis.call('HGET', state, field)
  if not list then return end
  local kept = {}
  for w in string.gmatch(list, '%S+') do
    if w ~= word then kept[#kept + 1] = w end
  end
  if #kept == 0 then
    redis.call('HDEL', state, field)
  else
    redis.call('HSET', state, field, table.concat(kept, ' '))
  end
end

-- Waiters per instance (`n:<instance>`), and the instances that have any (`insts`, space-
-- separated): so that a beat looks for dead instances' waiters only when one of these died,
-- instead of walking the whole queue.
local function count_instance(instance, n)
  if instance == '' then return end
  local c = redis.call('HINCRBY', state, 'n:' .. instance, n)
  local list = redis.call('HGET', state, 'insts') or ''
  local listed = string.find(' ' .. list .. ' ', ' ' .. instance .. ' ', 1, true) ~= nil
  if c <= 0 then
    redis.call('HDEL', state, 'n:' .. instance)
    if listed then unlist('insts', instance) end
  elseif not listed then
    redis.call('HSET', state, 'insts', list == '' and instance or (list .. ' ' .. instance))
  end
end

local function drop_waiter(id, info)
  local key, member, instance = string.match(info, '^([^|]*)|([^|]*)|(.*)$')
  redis.call('ZREM', waiters, member)
  if redis.call('HDEL', state, 'w:' .. id) == 1 then count_instance(instance or '', -1) end
  if instance == FLEET then redis.call('HDEL', state, 'rd:' .. id) end
  return key
end

-- The seq of a waiter's member of KEYS[2] (its place among its key's waiters).
local function seq_of(member)
  return string.match(member, '^[^:]*:(%d+):')
end

-- Refuses a late `enter` of `id` for `for_us`.
local function give_up(id, for_us)
  redis.call('ZREMRANGEBYSCORE', given_up, '-inf', int(now))
  redis.call('ZADD', given_up, int(now + for_us), id)
  local ms = math.ceil(for_us / 1000) + 1000
  if redis.call('PTTL', given_up) < ms then redis.call('PEXPIRE', given_up, int(ms)) end
end

local function refused(id)
  local until_us = redis.call('ZSCORE', given_up, id)
  return until_us and tonumber(until_us) > now
end

-- Waiter `id` was dropped as a dead instance's (or its grant lapsed unconfirmed): its charge,
-- if it left one, is owed back (KEYS[6]), unless it still waits or holds a lease under that id
-- (then it is not the dropped one's to give back). `seq`: its place in the queue, kept
-- (`p:<id>`) for its instance to take back with its charge.
local function owe(id, seq)
  if redis.call('HEXISTS', state, 'c:' .. id) == 0 then return end
  if redis.call('HEXISTS', state, 'w:' .. id) == 1 or redis.call('ZSCORE', leases, id) then return end
  redis.call('ZADD', owed, 'NX', int(now + OWED_AFTER_US), id)
  if seq then redis.call('HSET', state, 'p:' .. id, seq) end
  -- Every key has a TTL: the state's (each op that keeps it alive keeps this too).
  local ms = math.max(redis.call('PTTL', state), 60000)
  if redis.call('PTTL', owed) < ms then redis.call('PEXPIRE', owed, ms) end
end

-- Its instance came back for waiter `id` (not given up) before its owed charge was handed out:
-- the charge is its own again, off the queue's books. Its seq in the queue when it was
-- dropped (a waiter's: it goes back to its place), or true, if it was owed; else false.
local function take_back(id)
  if redis.call('ZREM', owed, id) == 0 then return false end
  local seq = redis.call('HGET', state, 'p:' .. id)
  redis.call('HDEL', state, 'c:' .. id, 'p:' .. id)
  return tonumber(seq) or true
end

local function reclaim(id)
  return not refused(id) and take_back(id)
end

local function alive(instance)
  return num('i:' .. instance) >= now
end

-- Whether a waiter of `instance` goes as its instance's: never the fleet's jobs'.
local function dead(instance)
  return instance ~= FLEET and not alive(instance)
end

-- At most this many waiters are handed a slot in one call: a cap raised by more (or taken
-- away: the largest cap) hands the rest on at the next calls on the route (each beat, every
-- 500 ms, calls too), so that no one call holds Redis for long.
local MAX_GRANTS = 128
-- Set when `grant` stopped at MAX_GRANTS: slots may still be free while waiters wait, and a
-- newcomer then queues behind them (it neither takes a free slot nor finds the queue full).
local backlog = false

-- A job held for its `max_delay` turn until later than now (`rd:<id>`).
local function held(id)
  return num('rd:' .. id) > now
end

-- Gives free slots to the next waiters; returns the waiters granted. A key whose oldest
-- waiter is a job while no instance collects jobs, or a job held for its turn, is passed
-- over (`skip`), still queued (the fleet's beats, every 200 ms, grant it once it is due).
local function grant(grant_ttl)
  local granted = {}
  local skip, handed = 0, 0
  while redis.call('ZCARD', leases) < cap() do
    if handed >= MAX_GRANTS then
      backlog = true
      break
    end
    local top = redis.call('ZRANGE', heads, skip, skip)[1]
    if not top then break end
    local key = string.match(top, '^%d+:(.*)$')
    local m = oldest(key)
    local id = m and string.match(m, '^[^:]*:%d+:(.*)$')
    local info = id and redis.call('HGET', state, 'w:' .. id) or ''
    local instance = string.match(info, '|([^|]*)$') or ''
    if not m then
      redis.call('ZREM', heads, top)
      redis.call('HDEL', state, 'h:' .. key)
    elseif instance == FLEET and (not alive(FLEET) or held(id)) then
      skip = skip + 1
    else
      handed = handed + 1
      drop_waiter(id, info ~= '' and info or (key .. '|' .. m .. '|'))
      if alive(instance) then
        redis.call('ZADD', leases, now + grant_ttl, id)
        -- The grant's instance, and the waiter's seq (its place, should the grant lapse).
        redis.call('HSET', state, 'l:' .. id, key, 'gi:' .. id, instance .. '|' .. (seq_of(m) or ''))
        if instance == FLEET then redis.call('HSET', state, 'gw:' .. id, m) end
        add_running(key, 1)
        turn(key)
        local g = redis.call('HGET', state, 'g:' .. instance)
        redis.call('HSET', state, 'g:' .. instance, g and (g .. ' ' .. id) or id)
        redis.call('PUBLISH', 'tollgate:q:' .. instance, id)
        granted[#granted + 1] = id
      else
        owe(id, seq_of(m))
      end
      refresh(key)
    end
  end
  return granted
end

-- 1 + how many waiters the queue serves before waiter `id` if slots free one at a time and
-- nothing else changes (nobody comes or leaves, no running request ends): its place in the
-- fair order, as a job's `position` shows it (DESIGN §8; `store/fair.rs` `place` is the
-- memory store's). A key at its share is passed over while any other may be served; once
-- none may, the order goes on as if the blocked keys' own requests ended. 0: not waiting.
-- Past PLACE_WAITERS waiters or PLACE_WORK steps of the simulation (steps × keys waiting),
-- the queue's length stands for it (an upper bound): a poll never holds Redis for long.
local PLACE_WAITERS, PLACE_WORK = 10000, 200000
-- How many waiters `jobs` reads at most.
local JOBS_SCAN = 1000
local function place(id)
  if not redis.call('HGET', state, 'w:' .. id) then return 0 end
  local total = redis.call('ZCARD', waiters)
  if total > PLACE_WAITERS then return total end
  local sims, order = {}, {}
  for _, m in ipairs(redis.call('ZRANGE', waiters, 0, -1)) do
    local key, seq, wid = string.match(m, '^([^:]*):(%d+):(.*)$')
    local k = sims[key]
    if not k then
      k = {running = num('r:' .. key), weight = math.max(1, num('wt:' .. key)),
           turn = num('e:' .. key), seqs = {}, ids = {}, at = 1}
      sims[key] = k
      order[#order + 1] = k
    end
    k.seqs[#k.seqs + 1] = tonumber(seq)
    k.ids[#k.ids + 1] = wid
  end
  local s = share()
  local function before(a, b)
    local ra, rb = a.running * b.weight, b.running * a.weight
    if ra ~= rb then return ra < rb end
    return math.max(a.seqs[a.at], a.turn) < math.max(b.seqs[b.at], b.turn)
  end
  local function best(any)
    local found
    for _, k in ipairs(order) do
      if k.at <= #k.seqs and (any or s == 0 or k.running < s)
          and (not found or before(k, found)) then
        found = k
      end
    end
    return found
  end
  local clock = num('seq')
  local position, work = 1, 0
  while true do
    work = work + #order
    if work > PLACE_WORK then return total end
    local k = best(false) or best(true)
    if not k then return 0 end
    if k.ids[k.at] == id then return position end
    position = position + 1
    k.at = k.at + 1
    k.running = k.running + 1
    clock = clock + 1
    k.turn = clock
  end
end

-- A route's leases lapse by Redis's clock, which runs on while Redis answers nobody (a stall:
-- SIGSTOP, a long command, a fork on a large dataset) or nobody reaches it (a partition). A
-- holder that could not renew meanwhile would lose its slot to the first call after, and its
-- renewal then makes the lease again beside the one that took it: the cap run over. So a call
-- that finds the route silent for longer than a live lease's renewals ever leave it (`seen`,
-- the last call's time: longer than half `lt`, the lease time, as holders renew every third
-- of it, and than a second, as instances with anything on the route beat every 500 ms) gives
-- every lease that lapsed meanwhile its lease time once more, for its holder to renew -- when
-- the silence must be Redis's: the call comes from an instance with a stake on the route (a
-- lease it renews, confirms or releases, a waiter it names or leaves, waiters it has there),
-- or the fleet has jobs queued on the route (every live instance's collector beats it every
-- 200 ms). A route that went silent because its holder died is woken by a call with no stake
-- (a newcomer, another instance's look at it, the admin's), and the lapsed lease goes at once
-- (DESIGN §4: a dead gateway's slots come back within the lease time); a dead instance's
-- waiters are no stake of anyone's. (Jobs queued while the whole fleet was down for longer
-- than the lease time wait one lease time more for a dead runner's slot.) An instance whose
-- store was out for that long holds its own new requests back until the others registered
-- their leases again (`store/redis/lost.rs`).
local function silent_past_leases(last)
  local lt = num('lt')
  return lt > 0 and now - last > math.max(lt / 2, 1000000)
end

-- The lease set expires a second after its last lease does.
local function keep_leases()
  if redis.call('EXISTS', leases) == 1 then
    local last = redis.call('ZRANGE', leases, -1, -1, 'WITHSCORES')
    if last[2] then
      redis.call('PEXPIREAT', leases, int(math.ceil(tonumber(last[2]) / 1000) + 1000))
    end
  end
end

-- The same for the instances with waiters here, whose alive time (2 s after a beat) is much
-- shorter than a lease's: after a silence of over a second (each beats every 500 ms), one
-- that was alive at the last call and whose time ran out in the silence gets the silence's
-- length back, when the silence must be Redis's (the caller's stake, as above). Else the
-- first call after any stall of Redis over 2 s would drop every other instance's waiters as
-- dead's, and a slot freed before they came back went past them.
local function shift_alive(last)
  for inst in string.gmatch(redis.call('HGET', state, 'insts') or '', '%S+') do
    local t = num('i:' .. inst)
    if t >= last and t < now then
      redis.call('HSET', state, 'i:' .. inst, int(t + (now - last)))
    end
  end
end

-- Every call that purges starts with this (and those that renew or give up a lease or a
-- waiter): the route's call time, and after a silence the grace above. `stake`: the caller
-- has a lease or a waiter here.
local function wake(stake)
  if redis.call('EXISTS', state) == 0 then return end
  local last = num('seen')
  redis.call('HSET', state, 'seen', int(now))
  -- No silence (the usual call): nothing more to read.
  if last == 0 or now - last <= 1000000 then return end
  if not (stake or num('n:' .. FLEET) > 0) then return end
  shift_alive(last)
  if not silent_past_leases(last) then return end
  local lapsed = {}
  if redis.call('EXISTS', leases) == 1 then
    lapsed = redis.call('ZRANGEBYSCORE', leases, '-inf', int(now))
  elseif num('running') > 0 then
    -- The set itself expired with its leases (see `purge`): the state still names them.
    for _, f in ipairs(redis.call('HKEYS', state)) do
      local id = string.match(f, '^l:(.+)$')
      if id then lapsed[#lapsed + 1] = id end
    end
  end
  if #lapsed == 0 then return end
  local until_us = int(now + num('lt'))
  for _, id in ipairs(lapsed) do redis.call('ZADD', leases, until_us, id) end
  keep_leases()
end

-- The lease time holders renew for (`lt`, for `wake`).
local function note_ttl(lease_ttl)
  if num('lt') ~= lease_ttl then redis.call('HSET', state, 'lt', int(lease_ttl)) end
end

-- Leases past their expiry (their instance died or stalled) go, with their key's count. An
-- instance that let a grant lapse unconfirmed counts as dead until it beats again: its other
-- waiters are skipped at once instead of being granted, and lapsing, one after another (a
-- live one learns from its next beat that they are gone, and queues them again).
--
-- The lease set expires a second after its last lease does (`keep`, `lease`), and the state
-- outlives it: when the set is gone while the state still names leases (`running` > 0; a
-- dead instance's), they lapsed with it and go the same way, or their keys would count as
-- running. (Gone with no lease named is the idle route's state: nothing to read.)
local function purge()
  local lapsed
  if redis.call('EXISTS', leases) == 1 then
    lapsed = redis.call('ZRANGEBYSCORE', leases, '-inf', now)
  elseif num('running') > 0 then
    lapsed = {}
    for _, f in ipairs(redis.call('HKEYS', state)) do
      local id = string.match(f, '^l:(.+)$')
      if id then lapsed[#lapsed + 1] = id end
    end
  else
    return
  end
  for _, id in ipairs(lapsed) do
    redis.call('ZREM', leases, id)
    local instance, seq = string.match(redis.call('HGET', state, 'gi:' .. id) or '', '^([^|]+)|?(%d*)$')
    -- Not the fleet's own pseudo-instance of async jobs: its waiters belong to no process,
    -- and any instance's collector picks its grants up.
    local owing = instance and instance ~= FLEET
    if owing then
      redis.call('HDEL', state, 'i:' .. instance)
      -- Granted, never confirmed: it never ran.
      owe(id, seq ~= '' and seq or nil)
    end
    local member = redis.call('HGET', state, 'gw:' .. id)
    if member then
      -- A job's lease: the job goes back to its place (not behind its key's others).
      local key = redis.call('HGET', state, 'l:' .. id)
      redis.call('HDEL', state, 'gi:' .. id, 'gw:' .. id, 'l:' .. id)
      -- Off the list of grants to collect: no collector is handed it twice.
      unlist('g:' .. FLEET, id)
      if key then add_running(key, -1) end
      key = key or string.match(member, '^([^:]*)')
      redis.call('ZADD', waiters, 0, member)
      redis.call('HSET', state, 'w:' .. id, key .. '|' .. member .. '|' .. FLEET)
      count_instance(FLEET, 1)
      refresh(key)
    else
      lease_gone(id, owing)
    end
  end
end

-- The route's cap and share in force for a caller whose config gave `route_cap` and
-- `route_share` and was loaded at `since` (ms): its figures unless the stored ones come from
-- a config loaded later (a reload elsewhere in the fleet, or a request decided just before
-- its instance reloaded, must not undo a newer cap). With `write`, the caller's are stored
-- when they are the ones in force.
local function limits(route_cap, route_share, since, write)
  if since < num('since') then return cap(), share() end
  if write then redis.call('HSET', state, 'cap', route_cap, 'share', route_share, 'since', since) end
  return route_cap, route_share
end

-- Whether `key` may take a free slot now: one is free, the key runs fewer than its share, and
-- none of its own waiters is ahead of it.
local function takes(key, route_cap, route_share)
  return redis.call('ZCARD', leases) < route_cap
    and (route_share == 0 or num('r:' .. key) < route_share) and not oldest(key)
end

-- Every structure lives a while past the last call (renewals and beats keep it alive).
local function keep(ttl_us)
  -- Queued jobs wait as long as their records live, however long no instance calls (the
  -- whole fleet down): the queue lives as long.
  local jobs_for = (num('jk') - now) / 1000
  local ms = int(math.max(60000, math.ceil(ttl_us / 1000) * 4, math.ceil(jobs_for)))
  redis.call('PEXPIRE', waiters, ms)
  redis.call('PEXPIRE', heads, ms)
  redis.call('PEXPIRE', state, ms)
  if redis.call('EXISTS', owed) == 1 then redis.call('PEXPIRE', owed, ms) end
  keep_leases()
end

if op == 'enter' then
  local id, key, weight = ARGV[2], ARGV[3], tonumber(ARGV[4])
  local route_cap, route_share, max_queue = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
  local lease_ttl, instance, alive_us, grant_ttl = tonumber(ARGV[8]), ARGV[9], tonumber(ARGV[10]), tonumber(ARGV[11])
  if refused(id) then return {GIVEN_UP} end
  wake(num('n:' .. instance) > 0)
  route_cap, route_share = limits(route_cap, route_share, tonumber(ARGV[12]) or 0, true)
  redis.call('HSET', state, 'i:' .. instance, int(now + alive_us))
  note_ttl(lease_ttl)
  -- Dropped as dead and back before its charge was handed out: the charge is its own again
  -- (not given up, as checked above), and its place in the queue, among its key's waiters
  -- in arrival order (re-entering in whatever order its requests come back).
  local back = take_back(id)
  purge()
  grant(grant_ttl)
  if redis.call('HEXISTS', state, 'w:' .. id) == 1 then
    keep(lease_ttl)
    return {QUEUED, redis.call('ZCARD', waiters)}
  end
  if instance ~= FLEET and redis.call('ZSCORE', leases, id) then
    -- Granted (or held) meanwhile: it is the caller's, confirmed, not counted again.
    redis.call('ZADD', leases, now + lease_ttl, id)
    redis.call('HDEL', state, 'gi:' .. id, 'c:' .. id)
    keep(lease_ttl)
    return {TAKEN}
  end
  local hold_us = instance == FLEET and tonumber(ARGV[14]) or 0
  if not backlog and hold_us <= 0 and takes(key, route_cap, route_share) then
    redis.call('ZADD', leases, now + lease_ttl, id)
    redis.call('HSET', state, 'l:' .. id, key)
    add_running(key, 1)
    refresh(key)
    keep(lease_ttl)
    return {TAKEN}
  end
  local queued = redis.call('ZCARD', waiters)
  -- One taken back joined before (it was counted then): newcomers that came while it was
  -- away do not push it out.
  if max_queue > 0 and queued >= max_queue and not backlog and type(back) ~= 'number' then
    keep(lease_ttl)
    return {FULL}
  end
  local seq = type(back) == 'number' and back or redis.call('HINCRBY', state, 'seq', 1)
  local member = key .. ':' .. string.format('%016d', seq) .. ':' .. id
  redis.call('ZADD', waiters, 0, member)
  redis.call('HSET', state, 'w:' .. id, key .. '|' .. member .. '|' .. instance, 'wt:' .. key, weight)
  if ARGV[14] and instance ~= FLEET then
    redis.call('HSET', state, 'c:' .. id, ARGV[13] .. ' ' .. ARGV[14])
  elseif ARGV[13] and instance == FLEET then
    local until_us = now + tonumber(ARGV[13])
    if until_us > num('jk') then
      redis.call('HSET', state, 'jk', int(until_us))
    end
    if hold_us > 0 then redis.call('HSET', state, 'rd:' .. id, int(now + hold_us)) end
  end
  count_instance(instance, 1)
  refresh(key)
  keep(lease_ttl)
  -- A job's 202 shows its place in the fair order; a request's wait has no use for it.
  return {QUEUED, instance == FLEET and place(id) or queued + 1}
elseif op == 'leave' then
  local id = ARGV[2]
  wake(true)
  local info = redis.call('HGET', state, 'w:' .. id)
  if info then
    local key = drop_waiter(id, info)
    redis.call('HDEL', state, 'c:' .. id)
    refresh(key)
    return {0}
  end
  if redis.call('ZSCORE', leases, id) then return {1} end
  -- Dropped as dead, its charge not handed out: its instance gives it back itself.
  if reclaim(id) then return {0} end
  give_up(id, tonumber(ARGV[3]))
  return {2}
elseif op == 'confirm' then
  local id, lease_ttl = ARGV[2], tonumber(ARGV[3])
  wake(true)
  if not redis.call('ZSCORE', leases, id) then return {0} end
  note_ttl(lease_ttl)
  redis.call('ZADD', leases, 'XX', now + lease_ttl, id)
  redis.call('HDEL', state, 'gi:' .. id, 'c:' .. id)
  keep(lease_ttl)
  return {1}
elseif op == 'hold' then
  local id, key, lease_ttl = ARGV[2], ARGV[3], tonumber(ARGV[4])
  wake(true)
  redis.call('ZADD', leases, now + lease_ttl, id)
  note_ttl(lease_ttl)
  if not redis.call('HGET', state, 'l:' .. id) then
    redis.call('HSET', state, 'l:' .. id, key)
    add_running(key, 1)
    refresh(key)
  end
  keep(lease_ttl)
  return {1}
elseif op == 'release' then
  local id, grant_ttl = ARGV[2], tonumber(ARGV[3])
  wake(true)
  local info = redis.call('HGET', state, 'w:' .. id)
  if info then
    -- Still waiting (its `leave` failed): it goes, like a lease.
    refresh(drop_waiter(id, info))
  elseif not redis.call('ZSCORE', leases, id) and not reclaim(id) then
    give_up(id, tonumber(ARGV[4]))
  end
  redis.call('ZREM', leases, id)
  lease_gone(id)
  purge()
  grant(grant_ttl)
  return {0}
elseif op == 'beat' then
  local instance, alive_us, grant_ttl = ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
  local below, n = tonumber(ARGV[5]) or 0, tonumber(ARGV[6]) or 0
  -- Nothing on the route and nothing named: nothing to keep alive or to clear (and an idle
  -- route leaves no keys behind).
  if n == 0 and redis.call('EXISTS', leases) == 0 and redis.call('EXISTS', waiters) == 0
      and redis.call('EXISTS', owed) == 0 then
    return {0, 0, 0, 0}
  end
  -- Alive: not an instance that has nothing here (another's look at a route with waiters,
  -- `below` 0): its field would stay for good. The fleet is, whenever a collector beats for
  -- it: its jobs may be granted slots for as long as one takes them, not only for a while
  -- after the last submission.
  wake(n > 0)
  if n > 0 or below > 0 or instance == FLEET then
    redis.call('HSET', state, 'i:' .. instance, int(now + alive_us))
  end
  purge()
  -- Waiters of instances that stopped beating leave the queue (the queue is walked only
  -- when an instance with waiters stopped; waiters from before this count are found by
  -- `grant` as it reaches them).
  local any_dead = false
  for inst in string.gmatch(redis.call('HGET', state, 'insts') or '', '%S+') do
    if dead(inst) then any_dead = true; break end
  end
  local seen = {}
  for _, m in ipairs(any_dead and redis.call('ZRANGE', waiters, 0, -1) or {}) do
    local id = string.match(m, '^[^:]*:%d+:(.*)$')
    local info = redis.call('HGET', state, 'w:' .. id) or ''
    local inst = string.match(info, '|([^|]*)$') or ''
    if seen[inst] == nil then seen[inst] = not dead(inst) end
    if not seen[inst] then
      local key = drop_waiter(id, info ~= '' and info or (string.match(m, '^([^:]*)') .. '|' .. m .. '|'))
      owe(id, seq_of(m))
      refresh(key)
    end
  end
  -- The ids the instance names are all it has here (waiting, entering, confirming, holding).
  -- Each that the queue has neither waiting nor holding is reported: the queue lost it. (Every
  -- named id is checked: a count that matches can hide one lost beside one that should have
  -- left, as a failover leaves them.)
  local named, named_waiting, lost = {}, 0, {}
  for i = 1, n do
    local id = ARGV[6 + i]
    named[id] = true
    if redis.call('HGET', state, 'w:' .. id) then
      named_waiting = named_waiting + 1
    elseif not redis.call('ZSCORE', leases, id) then
      lost[#lost + 1] = id
    end
  end
  -- And the queue's waiters and leases of this instance that it does not name, from before
  -- the list was made (ids `<instance>:<seq>`, seq below `below`), go: a release or a leave
  -- that a failover lost (the primary acknowledged it, then died before its replica had it)
  -- would otherwise hold a slot until its lease lapses, and count as running for its key.
  if below > 0 then
    local prefix = instance .. ':'
    local function stale(id)
      if not id or named[id] or string.sub(id, 1, #prefix) ~= prefix then return false end
      local seq = tonumber(string.sub(id, #prefix + 1))
      return seq ~= nil and seq < below
    end
    for _, id in ipairs(redis.call('ZRANGE', leases, 0, -1)) do
      if stale(id) then
        redis.call('ZREM', leases, id)
        lease_gone(id)
      end
    end
    if num('n:' .. instance) > named_waiting then
      for _, m in ipairs(redis.call('ZRANGE', waiters, 0, -1)) do
        local id = string.match(m, '^[^:]*:%d+:(.*)$')
        if stale(id) then
          local info = redis.call('HGET', state, 'w:' .. id) or ''
          refresh(drop_waiter(id, info ~= '' and info or (string.match(m, '^([^:]*)') .. '|' .. m .. '|')))
          redis.call('HDEL', state, 'c:' .. id)
        end
      end
    end
  end
  grant(grant_ttl)
  local mine = redis.call('HGET', state, 'g:' .. instance)
  redis.call('HDEL', state, 'g:' .. instance)
  local out = {num('n:' .. instance), 0, 0, 0}
  if mine then
    local given = {}
    for id in string.gmatch(mine, '%S+') do
      if not given[id] and redis.call('ZSCORE', leases, id) then
        given[id] = true
        out[#out + 1] = id
      end
    end
  end
  out[2] = #out - 4
  if instance ~= FLEET then
    for _, id in ipairs(redis.call('ZRANGEBYSCORE', owed, '-inf', int(now), 'LIMIT', 0, OWED_PER_BEAT)) do
      local c = redis.call('HGET', state, 'c:' .. id)
      local for_us, charge = string.match(c or '', '^(%d+) (.*)$')
      if charge then
        -- Handed out: the id is refused from now on, and the charge due again should its
        -- refunder not say it paid.
        give_up(id, tonumber(for_us))
        redis.call('ZADD', owed, 'XX', int(now + OWED_RETRY_US), id)
        out[#out + 1] = id
        out[#out + 1] = charge
        out[3] = out[3] + 1
      else
        redis.call('ZREM', owed, id)
        redis.call('HDEL', state, 'c:' .. id, 'p:' .. id)
      end
    end
  end
  out[4] = redis.call('ZCARD', owed)
  for _, id in ipairs(lost) do out[#out + 1] = id end
  keep(alive_us)
  return out
elseif op == 'paid' then
  for i = 2, #ARGV do
    redis.call('ZREM', owed, ARGV[i])
    redis.call('HDEL', state, 'c:' .. ARGV[i], 'p:' .. ARGV[i])
  end
  return {0}
elseif op == 'place' then
  wake(false)
  purge()
  -- (A lapsed job's lease puts its waiter back: what that writes expires too.)
  keep(num('lt'))
  return {place(ARGV[2])}
elseif op == 'jobs' then
  -- Reads only: the ids of the fleet's jobs waiting here, oldest first, at most ARGV[2],
  -- among the first JOBS_SCAN waiters (by key, then seq): a look that never holds Redis for
  -- long, however long the queue.
  local found = {}
  for _, m in ipairs(redis.call('ZRANGE', waiters, 0, JOBS_SCAN - 1)) do
    local seq, id = string.match(m, '^[^:]*:(%d+):(.*)$')
    local info = id and redis.call('HGET', state, 'w:' .. id) or ''
    if string.match(info, '|([^|]*)$') == FLEET and not held(id) then found[#found + 1] = {seq, id} end
  end
  table.sort(found, function(a, b) return a[1] < b[1] end)
  local out = {}
  for i = 1, math.min(#found, tonumber(ARGV[2])) do out[i] = found[i][2] end
  return out
elseif op == 'cap' then
  if tonumber(ARGV[5]) < num('since') then return {0} end
  -- Written even for a route with no queue state now (idle past its expiry): an instance
  -- not reloaded yet must find the newer figures, not set its own.
  limits(ARGV[2], ARGV[3], tonumber(ARGV[5]), true)
  if redis.call('PTTL', state) < 60000 then redis.call('PEXPIRE', state, 60000) end
  wake(false)
  purge()
  -- Each waiting key's place in the serving order under the new share (a key held at the
  -- old share may be served again, or no longer).
  local seen = {}
  for _, m in ipairs(redis.call('ZRANGE', waiters, 0, -1)) do
    local key = string.match(m, '^([^:]*):')
    if key and not seen[key] then
      seen[key] = true
      refresh(key)
    end
  end
  grant(tonumber(ARGV[4]))
  return {1}
elseif op == 'full' then
  local key, max_queue = ARGV[2], tonumber(ARGV[5])
  -- As an `enter` would: the caller's figures if newer, then the upkeep under them.
  local route_cap, route_share = limits(tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[6]) or 0, true)
  wake(false)
  purge()
  grant(tonumber(ARGV[7]))
  -- `limits` may have made the state: it expires like the rest (the job may never enter).
  keep(num('lt'))
  if backlog or max_queue == 0 or redis.call('ZCARD', waiters) < max_queue
      or takes(key, route_cap, route_share) then
    return {0}
  end
  return {1}
elseif op == 'peek' then
  wake(false)
  purge()
  keep(num('lt'))
  local out = {redis.call('ZCARD', leases), redis.call('ZCARD', waiters)}
  local per = {}
  local order = {}
  for _, f in ipairs(redis.call('HKEYS', state)) do
    local key = string.match(f, '^r:(.*)$')
    if key then per[key] = {num(f), 0}; order[#order + 1] = key end
  end
  for _, m in ipairs(redis.call('ZRANGE', waiters, 0, -1)) do
    local key = string.match(m, '^([^:]*):')
    if not per[key] then per[key] = {0, 0}; order[#order + 1] = key end
    per[key][2] = per[key][2] + 1
  end
  for _, key in ipairs(order) do
    out[#out + 1] = key
    out[#out + 1] = per[key][1]
    out[#out + 1] = per[key][2]
  end
  return out
end
return redis.error_reply('unknown queue operation ' .. tostring(op))
