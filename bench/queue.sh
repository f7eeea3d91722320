#!/usr/bin/env bash
# bench/queue.sh — the fleet-wide fair queue of a capped route on Redis (DESIGN §8), on
# loopback only: what a waiter costs while it waits, and how fast a full route hands off.
#
# Starts (127.0.0.1, free ports, a temp dir): a redis-server, the sample API (through
# `tollgate demo`, whose own gateway is not used), and one tollgate (release build, threads 1,
# RUST_LOG=warn) on Redis with `/reports/generate: {cost: 1, max_in_flight: 5,
# queue_timeout: 60s}`. Then:
#   1. idle waiters: 5 requests hold the route's slots (the upstream answers them after
#      HOLD_S s) while wrk keeps WAITERS more connections waiting on it; over IDLE_S s, with
#      nothing finishing, it counts Redis calls per second (INFO commandstats): what 1,000
#      waiters cost Redis while they wait.
#   2. hand-offs: wrk with WAITERS connections on the route, the upstream answering after
#      UP_MS ms, for DURATION s: every request but 5 queues, so each response is a hand-off.
#      Reports hand-offs per second, Redis calls and Redis CPU (usec) per hand-off, and the
#      latency a queued request pays over the ideal (WAITERS / 5 × UP_MS for a request that
#      queues behind all the others), p50 and p99.
# Everything it starts is stopped at exit. No traffic leaves 127.0.0.1; loads are bounded by
# wrk's -d and `timeout`.
set -euo pipefail

WAITERS=${WAITERS:-1000}
DURATION=${DURATION:-10}
UP_MS=${UP_MS:-5}
HOLD_S=${HOLD_S:-12}
IDLE_S=${IDLE_S:-5}
TARGET=${CARGO_TARGET_DIR:-target}/release/tollgate

NAME=queue
USAGE="usage: bench/queue.sh [--no-build]   (env: WAITERS=$WAITERS DURATION=$DURATION UP_MS=$UP_MS HOLD_S=$HOLD_S IDLE_S=$IDLE_S)"
TOOLS=(wrk redis-server redis-cli curl)
# shellcheck source=bench/fleet_lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/fleet_lib.sh"
fleet_prepare "$@"
start_fleet "$(cat <<'YAML'
    /reports/generate:
      cost: 1
      max_in_flight: 5
      queue_timeout: 60s
YAML
)"

# Redis calls (all commands, EVALSHA included) and their usec so far.
redis_calls() {
  redis-cli -p "$REDIS_PORT" INFO commandstats |
    awk -F'[:=,]' '/^cmdstat_/ && $1 != "cmdstat_info" { c += $3; u += $5 } END { printf "%d %d\n", c, u }'
}
# What each command (scripts' own calls included) ran between two INFO commandstats dumps.
by_command() {
  python3 - "$1" "$2" <<'PY'
import re, sys
def calls(f):
    return {m[1]: int(m[2]) for m in re.finditer(r"cmdstat_(\S+?):calls=(\d+)", open(f).read())}
a, b = calls(sys.argv[1]), calls(sys.argv[2])
print(", ".join(f"{k} {b[k] - a.get(k, 0)}" for k in sorted(b) if k != "info" and b[k] > a.get(k, 0)))
PY
}
# Round trips: the calls a client sends (tollgate sends every operation as a script).
round_trips() {
  redis-cli -p "$REDIS_PORT" INFO commandstats |
    awk -F'[:=,]' '/^cmdstat_(evalsha|eval|evalsha_ro|script|ping|role|subscribe|psubscribe)[:]/ { c += $3 } END { print c + 0 }'
}
queued() {
  curl -s "http://127.0.0.1:$ADMIN_PORT/metrics" |
    awk '/^tollgate_queued\{route="\/reports\/generate"\}/ { print $2 }'
}
ROUTE="http://127.0.0.1:$GW_PORT/reports/generate"

# 1. Idle waiters.
log "1. $WAITERS waiters behind 5 held slots"
HOLDERS=()
for _ in 1 2 3 4 5; do
  curl -s -o /dev/null -X POST -H 'X-API-Key: holder' "$ROUTE?delay_ms=$((HOLD_S * 1000))" &
  HOLDERS+=($!)
done
for _ in $(seq 100); do
  [[ $(redis-cli -p "$REDIS_PORT" --raw EVAL "local n = 0 for _, k in ipairs(redis.call('KEYS', 't:r*f')) do n = n + redis.call('ZCARD', k) end return n" 0) == 5 ]] && break
  sleep 0.1
done
timeout $((HOLD_S + 10)) wrk -t1 -c "$WAITERS" -d "$((HOLD_S - 1))s" --timeout 60s \
  -H 'X-API-Key: waiter' "$ROUTE?delay_ms=0" >"$TMP/idle-wrk.txt" 2>&1 &
WRK=$!
for _ in $(seq 200); do
  q=$(queued); [[ ${q%.*} -ge $((WAITERS - 5)) ]] && break
  sleep 0.05
done
log "   queued: $(queued)"
r0=$(round_trips)
read -r c0 _ < <(redis_calls)
redis-cli -p "$REDIS_PORT" INFO commandstats >"$TMP/idle-before.txt"
sleep "$IDLE_S"
read -r c1 _ < <(redis_calls)
r1=$(round_trips)
redis-cli -p "$REDIS_PORT" INFO commandstats >"$TMP/idle-after.txt"
log "   commands while idle (inside scripts included): $(by_command "$TMP/idle-before.txt" "$TMP/idle-after.txt")"
log "   queued after ${IDLE_S}s: $(queued)"
IDLE_RATE=$(awk -v a="$c0" -v b="$c1" -v s="$IDLE_S" 'BEGIN { printf "%.1f", (b - a) / s }')
IDLE_TRIPS=$(awk -v a="$r0" -v b="$r1" -v s="$IDLE_S" 'BEGIN { printf "%.1f", (b - a) / s }')
wait "$WRK" 2>/dev/null || true
for pid in "${HOLDERS[@]}"; do wait "$pid" 2>/dev/null || true; done

# 2. Hand-offs.
log "2. hand-offs: $WAITERS connections, upstream ${UP_MS} ms, ${DURATION}s"
timeout $((DURATION + 5)) wrk -t1 -c "$WAITERS" -d 2s --timeout 60s \
  -H 'X-API-Key: warm' "$ROUTE?delay_ms=$UP_MS" >/dev/null 2>&1 || true
read -r h0 u0 < <(redis_calls)
t0=$(round_trips)
redis-cli -p "$REDIS_PORT" INFO commandstats >"$TMP/handoff-before.txt"
timeout $((DURATION + 70)) wrk -t1 -c "$WAITERS" -d "${DURATION}s" --timeout 60s --latency \
  -H 'X-API-Key: busy' "$ROUTE?delay_ms=$UP_MS" >"$TMP/handoff-wrk.txt" 2>&1
read -r h1 u1 < <(redis_calls)
t1=$(round_trips)
redis-cli -p "$REDIS_PORT" INFO commandstats >"$TMP/handoff-after.txt"
log "   commands during the hand-offs: $(by_command "$TMP/handoff-before.txt" "$TMP/handoff-after.txt")"
REQS=$(awk '/requests in/ { print $1 }' "$TMP/handoff-wrk.txt")
RPS=$(awk '/^Requests\/sec/ { print $2 }' "$TMP/handoff-wrk.txt")
P50=$(awk '$1 == "50%" { print $2 }' "$TMP/handoff-wrk.txt")
P99=$(awk '$1 == "99%" { print $2 }' "$TMP/handoff-wrk.txt")
IDEAL_MS=$(awk -v w="$WAITERS" -v u="$UP_MS" 'BEGIN { printf "%.0f", w / 5 * u }')
SLOT_RATE=$(awk -v u="$UP_MS" 'BEGIN { printf "%.0f", 5 * 1000 / u }')

cat <<EOF

### Fair queue on Redis: one gateway (threads 1), cap 5, $WAITERS waiters

| measure | value |
|---|---:|
| Redis round trips/s while $WAITERS wait and nothing finishes | $IDLE_TRIPS |
| Redis commands/s then (inside scripts included) | $IDLE_RATE |
| hand-offs/s (upstream ${UP_MS} ms; the cap allows at most $SLOT_RATE/s) | $RPS |
| Redis round trips per hand-off | $(awk -v a="$t0" -v b="$t1" -v n="$REQS" 'BEGIN { printf "%.2f", (b - a) / n }') |
| Redis commands per hand-off (inside scripts included) | $(awk -v a="$h0" -v b="$h1" -v n="$REQS" 'BEGIN { printf "%.1f", (b - a) / n }') |
| Redis CPU per hand-off (usec, INFO commandstats) | $(awk -v a="$u0" -v b="$u1" -v n="$REQS" 'BEGIN { printf "%.1f", (b - a) / n }') |
| latency of a queued request, p50 / p99 | $P50 / $P99 |
| the ideal for a request behind all others ($WAITERS / 5 × ${UP_MS} ms) | ${IDEAL_MS}ms |
EOF
