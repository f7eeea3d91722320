#!/usr/bin/env bash
# bench/instructions.sh — user-space instructions per request (valgrind callgrind), a figure that
# does not depend on what else the machine is running: for comparing two builds of tollgate, or
# tollgate with the bare Pingora floor, while other work shares the cores. `bare` is bench/run.sh's
# (g), an empty Pingora proxy; `headers` is its (i), the same proxy writing tollgate's headers.
#
#   bash bench/instructions.sh [tollgate|bare|headers] [-d SECONDS] [-c CONNS] [--exact-redis]
#                              [--access-log]
#                                                                  (default: tollgate, 5 s, 8)
#
# Starts an nginx upstream and the proxy under callgrind (memory store, or with --exact-redis
# a redis-server started here and store.slices off: every request decided in Redis; server.threads 1,
# RUST_LOG=warn, or with --access-log RUST_LOG=info: the access log on, written to a file, as
# bench/run.sh's (e); TOLLGATE_BIN / BARE_PINGORA_BIN pick the binaries), warms it up, zeroes the
# counters, drives it with wrk (1000 keys, as bench/run.sh), dumps the counters and prints
# instructions (Ir) per request. Kernel time is not counted. Loopback only, bounded in time.
set -euo pipefail
WHAT=${1:-tollgate}; [[ $WHAT == tollgate || $WHAT == bare || $WHAT == headers ]] && shift || WHAT=tollgate
DURATION=5; CONNS=8; REDIS=; LOG=warn
while [[ $# -gt 0 ]]; do
  case "$1" in
    -d) DURATION=$2; shift ;;
    -c) CONNS=$2; shift ;;
    --exact-redis) REDIS=1 ;;
    --access-log) LOG=info ;;
    *) echo "unknown option: $1" >&2; exit 2 ;;
  esac
  shift
done
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BIN=${TOLLGATE_BIN:-$ROOT/target/release/tollgate}
BARE_BIN=${BARE_PINGORA_BIN:-$ROOT/target/release/examples/bare_pingora}
for t in nginx wrk curl valgrind callgrind_control; do command -v "$t" >/dev/null || { echo "missing: $t" >&2; exit 1; }; done
TMP=$(mktemp -d "${TMPDIR:-/tmp}/tollgate-instr.XXXXXX"); chmod 755 "$TMP"
PIDS=()
cleanup() {
  local pid
  for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
  done
  rm -rf "$TMP"
}
trap cleanup EXIT
free_port() { local p; for _ in $(seq 200); do p=$((20000 + RANDOM % 30000)); (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null || { echo "$p"; return; }; done; return 1; }
UP=$(free_port); PX=$(free_port); ADMIN=$(free_port)
mkdir -p "$TMP/nginx/tmp"
cat >"$TMP/nginx/nginx.conf" <<NGX
worker_processes 1;
pid $TMP/nginx/nginx.pid;
error_log $TMP/nginx/error.log warn;
events { worker_connections 1024; }
http {
  access_log off;
  client_body_temp_path $TMP/nginx/tmp/body; proxy_temp_path $TMP/nginx/tmp/proxy;
  fastcgi_temp_path $TMP/nginx/tmp/fastcgi; uwsgi_temp_path $TMP/nginx/tmp/uwsgi; scgi_temp_path $TMP/nginx/tmp/scgi;
  keepalive_requests 1000000;
  server { listen 127.0.0.1:$UP; location / { default_type application/json; return 200 '{"id":42,"name":"widget","ok":true}\n'; } }
}
NGX
nginx -p "$TMP/nginx" -e "$TMP/nginx/error.log" -c "$TMP/nginx/nginx.conf" -g 'daemon off;' &
PIDS+=($!)
STORE="  backend: memory"
if [[ -n $REDIS ]]; then
  command -v redis-server >/dev/null || { echo "missing: redis-server" >&2; exit 1; }
  RD=$(free_port)
  redis-server --port "$RD" --bind 127.0.0.1 --save '' --appendonly no --daemonize no >"$TMP/redis.log" 2>&1 &
  PIDS+=($!)
  for _ in $(seq 100); do [[ $(redis-cli -p "$RD" ping 2>/dev/null || true) == PONG ]] && break; sleep 0.1; done
  # valgrind runs the gateway ~50x slower: a timeout that a native build never meets.
  STORE="  backend: redis
  url: \"redis://127.0.0.1:$RD/0\"
  timeout: 2s
  slices: false"
fi
cat >"$TMP/tollgate.yaml" <<YAML
server:
  listen: "127.0.0.1:$PX"
  admin_listen: "127.0.0.1:$ADMIN"
  threads: 1
  grace_period: 1s
upstream:
  url: "http://127.0.0.1:$UP"
store:
$STORE
rate_limits:
  default: {cost: 1, window: 1s, max_cost: 100000000}
  endpoints:
    "GET /api/items/{id}": {cost: 1}
YAML
if [[ $WHAT == bare || $WHAT == headers ]]; then
  [[ $WHAT == headers ]] && export BARE_PINGORA_HEADERS=1
  valgrind --tool=callgrind --collect-atstart=yes --callgrind-out-file="$TMP/cg.out" "$BARE_BIN" "127.0.0.1:$PX" "127.0.0.1:$UP" >"$TMP/proxy.log" 2>&1 &
else
  RUST_LOG=$LOG valgrind --tool=callgrind --callgrind-out-file="$TMP/cg.out" "$BIN" run -c "$TMP/tollgate.yaml" >"$TMP/proxy.log" 2>&1 &
fi
VG=$!; PIDS+=("$VG")
URL="http://127.0.0.1:$PX/api/items/42"
for _ in $(seq 600); do [[ $(curl -s -o /dev/null -w '%{http_code}' -m 2 -H 'X-API-Key: bench-key-0001' "$URL" || true) == 200 ]] && break; sleep 0.1; done
TG_KEYS=1000 wrk -t 1 -c "$CONNS" -d 2s -s "$ROOT/bench/keys.lua" "$URL" >/dev/null 2>&1 || true   # warm-up
callgrind_control -z "$VG" >/dev/null
TG_KEYS=1000 wrk -t 1 -c "$CONNS" -d "${DURATION}s" --timeout 10s -s "$ROOT/bench/keys.lua" "$URL" >"$TMP/wrk.txt" 2>&1 || true
callgrind_control -d "$VG" >/dev/null
sleep 1
REQS=$(awk '/ requests in / { print $1 }' "$TMP/wrk.txt")
IR=$(cat "$TMP"/cg.out* | awk '/^summary:/ { s += $2 } END { printf "%d", s }')
echo "$WHAT${REDIS:+ (exact redis)}$([[ $LOG == info ]] && echo ' (access log)'): $REQS requests, $IR instructions → $((IR / (REQS > 0 ? REQS : 1))) instructions per request"
if [[ -n ${KEEP:-} ]]; then mkdir -p "$KEEP"; cp "$TMP"/cg.out* "$KEEP"/; fi
