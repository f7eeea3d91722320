#!/usr/bin/env bash
# bench/jobs.sh — async jobs on Redis (DESIGN §8, issue 26), on loopback only: how fast jobs
# are submitted, what a job adds to the synchronous request's latency, and what a queued job
# and a kept result cost Redis in memory.
#
# Starts (127.0.0.1, free ports, a temp dir): a redis-server, the sample API (through
# `tollgate demo`, whose own gateway is not used), and one tollgate (release build, threads 1,
# RUST_LOG=warn) on Redis with `/reports/generate: {cost: 1, max_in_flight: 5, async:
# {result_ttl: 1h}}`. Then:
#   1. submissions: 5 synchronous requests hold the route's slots (the upstream answers them
#      after HOLD_S s) while wrk submits jobs (`Prefer: respond-async`, a BODY-byte body) on
#      CONNS connections for DURATION s: every job queues. Reports submissions/s and their
#      p50/p99, and Redis's used_memory per queued job (INFO memory, before and after).
#   2. the same jobs run once the slots free (upstream answers at once); when none is queued
#      or running, used_memory per kept result (each holds the upstream's answer).
#   3. latency: one client, SAMPLES times each, a synchronous request and a job on the same
#      route (upstream UP_MS ms, slots free), the job polled every POLL_MS ms until its result;
#      p50/p99 of both and of the difference (submission to result, over the request).
# Everything it starts is stopped at exit. No traffic leaves 127.0.0.1; loads are bounded by
# wrk's -d and `timeout`.
set -euo pipefail

CONNS=${CONNS:-32}
DURATION=${DURATION:-5}
HOLD_S=${HOLD_S:-15}
BODY=${BODY:-200}
UP_MS=${UP_MS:-20}
SAMPLES=${SAMPLES:-200}
POLL_MS=${POLL_MS:-1}
TARGET=${CARGO_TARGET_DIR:-target}/release/tollgate

NAME=jobs
USAGE="usage: bench/jobs.sh [--no-build]   (env: CONNS=$CONNS DURATION=$DURATION HOLD_S=$HOLD_S BODY=$BODY UP_MS=$UP_MS SAMPLES=$SAMPLES POLL_MS=$POLL_MS)"
TOOLS=(wrk redis-server redis-cli curl python3)
# shellcheck source=bench/fleet_lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/fleet_lib.sh"
fleet_prepare "$@"
start_fleet "$(cat <<'YAML'
    /reports/generate:
      cost: 1
      max_in_flight: 5
      queue_timeout: 60s
      async: {result_ttl: 1h}
YAML
)"
ROUTE="http://127.0.0.1:$GW_PORT/reports/generate"

used_memory() {
  redis-cli -p "$REDIS_PORT" INFO memory | awk -F: '/^used_memory:/ { print $2 + 0 }'
}
jobs_gauge() {  # state
  curl -s "http://127.0.0.1:$ADMIN_PORT/metrics" |
    awk -v s="$1" '$1 == "tollgate_jobs{route=\"/reports/generate\",state=\"" s "\"}" { print $2 + 0 }'
}
job_records() {
  redis-cli -p "$REDIS_PORT" --raw EVAL "return #redis.call('KEYS', 't:j:*')" 0
}

# 1. Submissions, every job queued behind 5 held slots.
log "1. submissions: $CONNS connections for ${DURATION}s, slots held"
HOLDERS=()
for _ in 1 2 3 4 5; do
  curl -s -o /dev/null -X POST -H 'X-API-Key: holder' "$ROUTE?delay_ms=$((HOLD_S * 1000))" &
  HOLDERS+=($!)
done
for _ in $(seq 100); do
  [[ $(redis-cli -p "$REDIS_PORT" --raw EVAL "local n = 0 for _, k in ipairs(redis.call('KEYS', 't:r*f')) do n = n + redis.call('ZCARD', k) end return n" 0) == 5 ]] && break
  sleep 0.1
done
cat >"$TMP/submit.lua" <<EOF
wrk.method = "POST"
wrk.body = string.rep("x", $BODY)
wrk.headers["Prefer"] = "respond-async"
wrk.headers["X-API-Key"] = "submitter"
wrk.headers["Content-Type"] = "application/octet-stream"
local accepted, other = 0, 0
response = function(status)
  if status == 202 then accepted = accepted + 1 else other = other + 1 end
end
done = function() end
EOF
MEM0=$(used_memory)
timeout $((DURATION + 10)) wrk -t1 -c "$CONNS" -d "${DURATION}s" --latency -s "$TMP/submit.lua" \
  "$ROUTE?delay_ms=0" >"$TMP/submit-wrk.txt" 2>&1
MEM1=$(used_memory)
JOBS=$(job_records)
NON2XX=$(awk '/Non-2xx/ { print $NF }' "$TMP/submit-wrk.txt")
SUB_RPS=$(awk '/^Requests\/sec/ { print $2 }' "$TMP/submit-wrk.txt")
SUB_P50=$(awk '$1 == "50%" { print $2 }' "$TMP/submit-wrk.txt")
SUB_P99=$(awk '$1 == "99%" { print $2 }' "$TMP/submit-wrk.txt")
PER_QUEUED=$(awk -v a="$MEM0" -v b="$MEM1" -v n="$JOBS" 'BEGIN { printf "%.0f", (b - a) / n }')
log "   $JOBS jobs queued (non-2xx: ${NON2XX:-0}); used_memory $MEM0 -> $MEM1"

# 2. They run; results are kept.
log "2. the queued jobs run"
for pid in "${HOLDERS[@]}"; do wait "$pid" 2>/dev/null || true; done
RUN_START=$(date +%s.%N)
DRAINED=0
for _ in $(seq 6000); do
  if [[ $(jobs_gauge queued) == 0 && $(jobs_gauge running) == 0 ]]; then DRAINED=1; break; fi
  sleep 0.1
done
[[ $DRAINED == 1 ]] || { echo "the queued jobs did not all run within 600 s" >&2; exit 1; }
RUN_END=$(date +%s.%N)
sleep 0.5
MEM2=$(used_memory)
PER_RESULT=$(awk -v a="$MEM0" -v b="$MEM2" -v n="$JOBS" 'BEGIN { printf "%.0f", (b - a) / n }')
RUN_RATE=$(awk -v a="$RUN_START" -v b="$RUN_END" -v n="$JOBS" 'BEGIN { printf "%.0f", n / (b - a) }')
log "   used_memory with $JOBS results kept: $MEM2"

# 3. Latency of a job over the synchronous request.
log "3. latency: $SAMPLES requests and $SAMPLES jobs, upstream ${UP_MS} ms"
LAT=$(python3 - "$GW_PORT" "$UP_MS" "$SAMPLES" "$POLL_MS" <<'PY'
import http.client, json, sys, time
port, up_ms, n, poll_ms = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
c = http.client.HTTPConnection("127.0.0.1", port)
target = f"/reports/generate?delay_ms={up_ms}"
def call(method, path, headers):
    c.request(method, path, body=b"" if method == "POST" else None, headers=headers)
    r = c.getresponse()
    r.read()
    return r
sync, job = [], []
key = {"X-API-Key": "latency"}
for _ in range(n):
    t = time.perf_counter()
    assert call("POST", target, key).status == 200
    sync.append(time.perf_counter() - t)
    t = time.perf_counter()
    r = call("POST", target, {**key, "Prefer": "respond-async"})
    assert r.status == 202, r.status
    loc = r.getheader("Location")
    while True:
        r = call("GET", loc, key)
        if r.status != 202:
            break
        time.sleep(poll_ms / 1000)
    assert r.status == 200, r.status
    job.append(time.perf_counter() - t)
def pct(v, p):
    v = sorted(v)
    return v[min(len(v) - 1, int(len(v) * p))] * 1000
extra = [j - s for s, j in zip(sync, job)]
print(" ".join(f"{pct(v, p):.2f}" for v in (sync, job, extra) for p in (0.5, 0.99)))
PY
)
read -r S50 S99 J50 J99 X50 X99 <<<"$LAT"

cat <<EOF

### Async jobs on Redis: one gateway (threads 1), cap 5

| measure | value |
|---|---:|
| submissions/s ($CONNS connections, every job queued, ${BODY}-byte body) | $SUB_RPS |
| submission latency p50 / p99 | $SUB_P50 / $SUB_P99 |
| jobs queued in ${DURATION}s | $JOBS |
| Redis used_memory per queued job | $PER_QUEUED B |
| jobs run per second afterwards (upstream at once, cap 5) | $RUN_RATE |
| Redis used_memory per kept result | $PER_RESULT B |
| synchronous request p50 / p99 (upstream ${UP_MS} ms) | $S50 / $S99 ms |
| job, submission to result, p50 / p99 (polled every ${POLL_MS} ms) | $J50 / $J99 ms |
| extra latency of a job p50 / p99 | $X50 / $X99 ms |
EOF
