-- wrk script: spreads requests over TG_KEYS distinct API keys (X-API-Key: bench-key-0001 ...).
-- The requests are formatted once in init(); request() only hands out the next one, so the
-- script costs wrk about the same for every target (nginx ignores the header, tollgate charges
-- the key). Used by bench/run.sh unless --keys 1 (then a static `-H 'X-API-Key: …'`).
local n = tonumber(os.getenv("TG_KEYS") or "1000")
local reqs = {}
local i = 0

function init(args)
  for k = 1, n do
    reqs[k] = wrk.format(nil, nil, { ["X-API-Key"] = string.format("bench-key-%04d", k) })
  end
  -- threads start at different keys
  i = math.random(n) - 1
end

function request()
  i = i % n + 1
  return reqs[i]
end
