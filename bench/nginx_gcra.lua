-- bench/nginx_gcra.lua — the "Kong/APISIX way" anchor of bench/run.sh (letter h): an nginx
-- access phase that charges every request against a per-API-key GCRA budget in Redis with one
-- EVALSHA over a pooled cosocket, then lets proxy_pass forward it.
--
-- Debian ships no cosocket Redis client (lua-redis is blocking LuaSocket, which would stall the
-- worker), so this file speaks the little RESP it needs itself: one command out, one reply in.
--
-- The script does the work tollgate's admit does for a route without caps: TIME, GET, parse,
-- SET PX, in the same integer-ticks arithmetic (level in ticks; `per_unit` ticks per unit,
-- `rate` ticks drained per µs), so that the two are compared for the same Redis work.
-- Keys are `ng{<X-API-Key>}b`, the identifier in the clear as Kong and APISIX key theirs.
--
-- nginx.conf:  init_by_lua_block { require("nginx_gcra").configure{ redis_port = N,
--                limit = 100000000, window_us = 1000000 } }
--              access_by_lua_block { require("nginx_gcra").access() }

local M = {}

-- KEYS[1] the budget; ARGV per_unit rate capacity cost.
-- -> {1, remaining, reset_us} admitted, or {0, retry_after_us, reset_us}. Writes only when admitted.
local SCRIPT = [[
local p = tonumber(ARGV[1])
local q = tonumber(ARGV[2])
local cap = tonumber(ARGV[3])
local cost = tonumber(ARGV[4])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local level = 0
local v = redis.call('GET', KEYS[1])
if v then
  local l, at = string.match(v, '^(%d+):(%d+)$')
  if l then
    local elapsed = now - tonumber(at)
    if elapsed < 0 then elapsed = 0 end
    level = tonumber(l) - elapsed * q
    if level < 0 then level = 0 end
  end
end
local next_level = level + cost * p
if next_level > cap then
  return {0, math.floor((next_level - cap + q - 1) / q), math.floor((level + q - 1) / q)}
end
local px = math.max(1, math.floor((math.floor((next_level + q - 1) / q) + 999) / 1000))
redis.call('SET', KEYS[1], string.format('%.0f', next_level) .. ':' .. string.format('%.0f', now), 'PX', px)
return {1, math.floor((cap - next_level) / p), math.floor((next_level + q - 1) / q)}
]]

local function hex(bin)
  return (bin:gsub('.', function(c) return string.format('%02x', string.byte(c)) end))
end

local function gcd(a, b)
  while b ~= 0 do a, b = b, a % b end
  return a
end

local conf = {}
local SHA

-- Called from init_by_lua: the budget as "limit units per window_us", as tollgate's config has it.
function M.configure(c)
  conf.host = c.redis_host or '127.0.0.1'
  conf.port = assert(tonumber(c.redis_port), 'redis_port')
  conf.timeout_ms = c.timeout_ms or 50
  -- at least the client connections, so that no request has to connect to Redis again
  conf.pool_size = c.pool_size or 1024
  local limit, window = assert(c.limit, 'limit'), assert(c.window_us, 'window_us')
  local g = gcd(limit, window)
  conf.per_unit = string.format('%.0f', window / g)
  conf.rate = string.format('%.0f', limit / g)
  conf.capacity = string.format('%.0f', limit * (window / g))
  conf.limit_header = string.format('%.0f', limit)
  SHA = hex(ngx.sha1_bin(SCRIPT))
end

-- RESP: an array of bulk strings.
local function command(args)
  local out = { '*', #args, '\r\n' }
  for _, a in ipairs(args) do
    out[#out + 1] = '$'
    out[#out + 1] = #a
    out[#out + 1] = '\r\n'
    out[#out + 1] = a
    out[#out + 1] = '\r\n'
  end
  return out
end

-- One reply. An error reply comes back as nil, message, true (the connection is still in step);
-- a socket or protocol error as nil, message (the connection must not be reused).
local function read_reply(sock)
  local line, err = sock:receive('*l')
  if not line then return nil, err end
  local kind, rest = line:sub(1, 1), line:sub(2)
  if kind == ':' then return tonumber(rest) end
  if kind == '+' then return rest end
  if kind == '-' then return nil, rest, true end
  if kind == '$' then
    local n = tonumber(rest)
    if n < 0 then return ngx.null end
    local data, e = sock:receive(n + 2)
    if not data then return nil, e end
    return data:sub(1, n)
  end
  if kind == '*' then
    local n = tonumber(rest)
    if n < 0 then return ngx.null end
    local arr = {}
    for i = 1, n do
      local v, e, replied = read_reply(sock)
      if v == nil then return nil, e, replied end
      arr[i] = v
    end
    return arr
  end
  return nil, 'bad reply: ' .. line
end

local function call(sock, args)
  local ok, err = sock:send(command(args))
  if not ok then return nil, err end
  return read_reply(sock)
end

local function charge(key)
  local sock = ngx.socket.tcp()
  sock:settimeouts(conf.timeout_ms, conf.timeout_ms, conf.timeout_ms)
  -- reuses a connection from the worker's pool for host:port when there is one
  local ok, err = sock:connect(conf.host, conf.port)
  if not ok then return nil, err end
  local res, replied
  res, err, replied = call(sock, { 'EVALSHA', SHA, '1', key, conf.per_unit, conf.rate, conf.capacity, '1' })
  if res == nil and replied and err:sub(1, 8) == 'NOSCRIPT' then
    -- as redis-rs's Script::invoke_async: EVAL once, which also caches the script
    res, err, replied = call(sock, { 'EVAL', SCRIPT, '1', key, conf.per_unit, conf.rate, conf.capacity, '1' })
  end
  if res == nil and not replied then
    sock:close()
  else
    sock:setkeepalive(60000, conf.pool_size)
  end
  return res, err
end

function M.access()
  local api_key = ngx.var.http_x_api_key or ngx.var.remote_addr
  local res, err = charge('ng{' .. api_key .. '}b')
  if type(res) ~= 'table' then
    ngx.log(ngx.ERR, 'redis: ', err)
    return ngx.exit(ngx.HTTP_SERVICE_UNAVAILABLE)
  end
  local h = ngx.header
  h['X-RateLimit-Limit'] = conf.limit_header
  if res[1] == 1 then
    h['X-RateLimit-Remaining'] = res[2]
    h['X-RateLimit-Reset'] = math.ceil(res[3] / 1000000)
    return
  end
  h['X-RateLimit-Remaining'] = 0
  h['Retry-After'] = math.ceil(res[2] / 1000000)
  return ngx.exit(429)
end

return M
