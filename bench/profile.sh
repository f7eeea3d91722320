#!/usr/bin/env bash
# bench/profile.sh — where does tollgate's time per request go? Loopback only, bounded load.
#
#   bash bench/profile.sh perf       [-d 10] [-c 64]  # perf record -e cpu-clock (sampling, real speed,
#                                                     # kernel included; hardware counters are not needed)
#   bash bench/profile.sh callgrind  [-d 5]  [-c 8]   # valgrind --tool=callgrind (~50x slower;
#                                                     # instruction counts, user space only)
#   bash bench/profile.sh syscalls   [-d 5]  [-c 64]  # system calls per request, tollgate vs an
#                                                     # nginx proxy_pass (perf stat on syscall tracepoints)
#   bash bench/profile.sh perf-nginx [-d 10] [-c 64]  # as perf, of the nginx proxy_pass worker instead
#   bash bench/profile.sh perf-bare  [-d 10] [-c 64]  # as perf, of examples/bare_pingora (the floor)
#
# Starts an nginx upstream (return 200, 1 worker) and tollgate (memory store, server.threads 1,
# RUST_LOG=warn) built as target/release/tollgate (release has debug=1: symbols and lines), drives
# it with wrk for the given seconds, and writes the reports into --out DIR (default: a temp dir
# whose path is printed; kept). Prints the top entries. Everything it starts is stopped at exit.
set -euo pipefail

TOOL=${1:-}
[[ $TOOL == perf || $TOOL == perf-nginx || $TOOL == perf-bare || $TOOL == callgrind || $TOOL == syscalls ]] || { echo "usage: bench/profile.sh perf|perf-nginx|perf-bare|callgrind|syscalls [-d S] [-c N] [--keys N] [--out DIR]" >&2; exit 2; }
shift
case $TOOL in
  perf|perf-nginx|perf-bare) DURATION=10; CONNS=64 ;;
  callgrind) DURATION=5; CONNS=8 ;;
  syscalls) DURATION=5; CONNS=64 ;;
esac
KEYS=1000
OUT=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    -d|--duration) DURATION=$2; shift ;;
    -c|--connections) CONNS=$2; shift ;;
    -k|--keys) KEYS=$2; shift ;;
    --out) OUT=$2; shift ;;
    *) echo "unknown option: $1" >&2; exit 2 ;;
  esac
  shift
done
[[ $DURATION =~ ^[0-9]+$ && $CONNS =~ ^[0-9]+$ && $KEYS =~ ^[0-9]+$ ]] || { echo "numbers expected" >&2; exit 2; }

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BIN=${TOLLGATE_BIN:-$ROOT/target/release/tollgate}
BARE_BIN=${BARE_PINGORA_BIN:-$ROOT/target/release/examples/bare_pingora}
[[ $TOOL != perf-bare || -x $BARE_BIN ]] || { echo "no $BARE_BIN: cargo build --release --example bare_pingora first" >&2; exit 1; }
[[ -x $BIN ]] || { echo "no $BIN: cargo build --release first" >&2; exit 1; }
NGINX=${NGINX:-$(command -v nginx || echo /usr/sbin/nginx)}
for t in "$NGINX" wrk curl; do command -v "$t" >/dev/null || { echo "missing: $t" >&2; exit 1; }; done
if [[ $TOOL != callgrind ]]; then command -v perf >/dev/null || { echo "missing: perf" >&2; exit 1; }
else command -v valgrind >/dev/null && command -v callgrind_annotate >/dev/null || { echo "missing: valgrind" >&2; exit 1; }; fi

if [[ -n $OUT ]]; then mkdir -p "$OUT"; TMP=$(cd "$OUT" && pwd); else TMP=$(mktemp -d "${TMPDIR:-/tmp}/tollgate-profile.XXXXXX"); fi
chmod 755 "$TMP"
PIDS=()
cleanup() {
  local rc=$? pid
  trap - EXIT INT TERM
  for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  done
  echo "[profile] outputs in $TMP" >&2
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

free_port() {
  local p
  for _ in $(seq 200); do
    p=$((20000 + RANDOM % 30000))
    if ! (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; then echo "$p"; return; fi
  done
  return 1
}
UP_PORT=$(free_port); GW_PORT=$(free_port); ADMIN=$(free_port); PX_PORT=$(free_port)
[[ $(printf '%s\n' "$UP_PORT" "$GW_PORT" "$ADMIN" "$PX_PORT" | sort -u | wc -l) == 4 ]] || { echo "port clash, run again" >&2; exit 1; }

mkdir -p "$TMP/nginx/tmp"; chmod 755 "$TMP/nginx" "$TMP/nginx/tmp"
cat >"$TMP/nginx/nginx.conf" <<EOF
worker_processes 1;
pid $TMP/nginx/nginx.pid;
error_log $TMP/nginx/error.log warn;
events { worker_connections 4096; }
http {
  access_log off;
  client_body_temp_path $TMP/nginx/tmp/body;
  proxy_temp_path $TMP/nginx/tmp/proxy;
  fastcgi_temp_path $TMP/nginx/tmp/fastcgi;
  uwsgi_temp_path $TMP/nginx/tmp/uwsgi;
  scgi_temp_path $TMP/nginx/tmp/scgi;
  keepalive_requests 1000000;
  server {
    listen 127.0.0.1:$UP_PORT;
    location / { default_type application/json; return 200 '{"id":42,"name":"widget","ok":true}\n'; }
  }
}
EOF
"$NGINX" -p "$TMP/nginx" -e "$TMP/nginx/error.log" -c "$TMP/nginx/nginx.conf" -g 'daemon off;' >>"$TMP/nginx/stdout.log" 2>&1 &
PIDS+=($!)
if [[ $TOOL == syscalls || $TOOL == perf-nginx ]]; then
  # the nginx proxy_pass of bench/run.sh (b), to compare with
  mkdir -p "$TMP/proxy/tmp"; chmod 755 "$TMP/proxy" "$TMP/proxy/tmp"
  sed -e "s#$TMP/nginx#$TMP/proxy#g" -e '/^  server {/,$d' "$TMP/nginx/nginx.conf" >"$TMP/proxy/nginx.conf"
  cat >>"$TMP/proxy/nginx.conf" <<EOF
  upstream backend { server 127.0.0.1:$UP_PORT; keepalive 128; keepalive_requests 1000000; }
  server {
    listen 127.0.0.1:$PX_PORT;
    location / {
      proxy_pass http://backend;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_set_header X-Forwarded-For \$proxy_add_x_forwarded_for;
      proxy_set_header X-Forwarded-Host \$host;
      proxy_set_header X-Forwarded-Proto \$scheme;
    }
  }
}
EOF
  "$NGINX" -p "$TMP/proxy" -e "$TMP/proxy/error.log" -c "$TMP/proxy/nginx.conf" -g 'daemon off;' >>"$TMP/proxy/stdout.log" 2>&1 &
  PX_PID=$!
  PIDS+=("$PX_PID")
fi

cat >"$TMP/tollgate.yaml" <<EOF
server:
  listen: "127.0.0.1:$GW_PORT"
  admin_listen: "127.0.0.1:$ADMIN"
  threads: 1
  grace_period: 1s
upstream:
  url: "http://127.0.0.1:$UP_PORT"
store:
  backend: memory
rate_limits:
  default: {cost: 1, window: 1s, max_cost: 100000000}
  endpoints:
    /reports/generate: {cost: 20, max_in_flight: 5, queue_timeout: 2s}
    "GET /api/items/{id}": {cost: 1}
EOF

if [[ $TOOL == callgrind ]]; then
  RUST_LOG=warn valgrind --tool=callgrind --callgrind-out-file="$TMP/callgrind.out" \
    "$BIN" run -c "$TMP/tollgate.yaml" >"$TMP/tollgate.log" 2>&1 &
else
  RUST_LOG=warn "$BIN" run -c "$TMP/tollgate.yaml" >"$TMP/tollgate.log" 2>&1 &
fi
GW_PID=$!
PIDS+=("$GW_PID")

URL="http://127.0.0.1:$GW_PORT/api/items/42"
ok=0
for _ in $(seq 600); do   # up to 60 s: valgrind starts slowly
  if [[ $(curl -s -o /dev/null -w '%{http_code}' -m 2 -H 'X-API-Key: bench-key-0001' "$URL" || true) == 200 ]]; then ok=1; break; fi
  sleep 0.1
done
[[ $ok == 1 ]] || { echo "tollgate did not answer; see $TMP/tollgate.log" >&2; tail -20 "$TMP/tollgate.log" >&2; exit 1; }

if [[ $KEYS -gt 1 ]]; then KEYARGS=(-s "$ROOT/bench/keys.lua"); else KEYARGS=(-H 'X-API-Key: bench-key-0001'); fi
metric() { curl -s -m 5 "http://127.0.0.1:$ADMIN/metrics" | awk '/^tollgate_requests_total\{/ { s += $NF } END { printf "%d\n", s }'; }
R0=$(metric)

echo "[profile] $TOOL: wrk ${DURATION}s, $CONNS connections, $KEYS key(s) → $URL" >&2
if [[ $TOOL == syscalls ]]; then
  # System calls per request: perf stat on the syscall tracepoints of the process (all its
  # threads; for nginx, its worker), over a window that covers the whole wrk run.
  count_syscalls() { # name pid url
    local name=$1 pid=$2 url=$3
    timeout $((DURATION + 30)) perf stat -x, -e 'syscalls:sys_enter_*' -p "$pid" -o "$TMP/syscalls-$name.csv" -- sleep $((DURATION + 2)) &
    local st=$!
    sleep 0.5
    TG_KEYS=$KEYS timeout $((DURATION + 30)) wrk -t 1 -c "$CONNS" -d "${DURATION}s" "${KEYARGS[@]}" "$url" >"$TMP/wrk-$name.txt" 2>&1
    wait "$st" || true
    local reqs
    reqs=$(awk '/ requests in / { print $1 }' "$TMP/wrk-$name.txt")
    echo "== $name: $reqs requests, $(grep Requests/sec "$TMP/wrk-$name.txt" | awk '{print $2}') req/s; system calls per request =="
    awk -F, -v q="$reqs" '$1 ~ /^[0-9]+$/ && $1 > 0 { sub("syscalls:sys_enter_", "", $3); n += $1; printf "  %-16s %8.3f\n", $3, $1 / q } END { printf "  %-16s %8.3f\n", "TOTAL", n / q }' \
      "$TMP/syscalls-$name.csv" | sort -k2 -g -r
  }
  for _ in $(seq 100); do [[ $(curl -s -o /dev/null -w '%{http_code}' -m 1 "http://127.0.0.1:$PX_PORT/" || true) == 200 ]] && break; sleep 0.1; done
  PX_WORKER=$(pgrep -P "$PX_PID" | head -1)
  count_syscalls tollgate "$GW_PID" "$URL"
  count_syscalls nginx-proxy "$PX_WORKER" "http://127.0.0.1:$PX_PORT/api/items/42"
  if [[ -x $BARE_BIN ]]; then
    BP_PORT=$(free_port)
    "$BARE_BIN" "127.0.0.1:$BP_PORT" "127.0.0.1:$UP_PORT" >"$TMP/bare-pingora.log" 2>&1 &
    BP_PID=$!
    PIDS+=("$BP_PID")
    for _ in $(seq 100); do [[ $(curl -s -o /dev/null -w '%{http_code}' -m 1 "http://127.0.0.1:$BP_PORT/" || true) == 200 ]] && break; sleep 0.1; done
    count_syscalls bare-pingora "$BP_PID" "http://127.0.0.1:$BP_PORT/api/items/42"
  fi
elif [[ $TOOL == perf || $TOOL == perf-nginx || $TOOL == perf-bare ]]; then
  TARGET_PID=$GW_PID
  if [[ $TOOL == perf-bare ]]; then
    "$BARE_BIN" "127.0.0.1:$PX_PORT" "127.0.0.1:$UP_PORT" >"$TMP/bare-pingora.log" 2>&1 &
    TARGET_PID=$!
    PIDS+=("$TARGET_PID")
    for _ in $(seq 100); do [[ $(curl -s -o /dev/null -w '%{http_code}' -m 1 "http://127.0.0.1:$PX_PORT/" || true) == 200 ]] && break; sleep 0.1; done
    URL="http://127.0.0.1:$PX_PORT/api/items/42"
  fi
  if [[ $TOOL == perf-nginx ]]; then
    for _ in $(seq 100); do [[ $(curl -s -o /dev/null -w '%{http_code}' -m 1 "http://127.0.0.1:$PX_PORT/" || true) == 200 ]] && break; sleep 0.1; done
    TARGET_PID=$(pgrep -P "$PX_PID" | head -1)
    URL="http://127.0.0.1:$PX_PORT/api/items/42"
  fi
  TG_KEYS=$KEYS timeout $((DURATION + 30)) wrk -t 1 -c "$CONNS" -d "$((DURATION + 2))s" --latency "${KEYARGS[@]}" "$URL" >"$TMP/wrk.txt" 2>&1 &
  WRK=$!
  PIDS+=("$WRK")
  sleep 1
  # cpu-clock: a software event, so it works where hardware counters are not exposed (VMs).
  timeout $((DURATION + 30)) perf record -e cpu-clock -F 1999 --call-graph dwarf,16384 -p "$TARGET_PID" \
    -o "$TMP/perf.data" -- sleep "$DURATION" 2>"$TMP/perf-record.log" || true
  wait "$WRK" || true
  R1=$(metric)
  echo "[profile] requests during the load: $((R1 - R0)); wrk: $(grep 'Requests/sec' "$TMP/wrk.txt")" >&2
  tidy() { sed 's/ \+- \+- *$//; s/[[:space:]]\+$//'; }
  perf report -i "$TMP/perf.data" --no-children --sort symbol --stdio --percent-limit 0.3 -g none \
    2>/dev/null | tidy >"$TMP/perf-self.txt" || true
  perf report -i "$TMP/perf.data" --children --sort symbol --stdio --percent-limit 0.3 -g none \
    2>/dev/null | tidy >"$TMP/perf-inclusive.txt" || true
  perf report -i "$TMP/perf.data" --no-children --sort dso --stdio -g none 2>/dev/null | tidy >"$TMP/perf-dso.txt" || true
  echo "== self (top 40) =="; grep -v '^#' "$TMP/perf-self.txt" | grep -v '^$' | head -40
  echo "== inclusive (top 60) =="; grep -v '^#' "$TMP/perf-inclusive.txt" | grep -v '^$' | grep -v '(inlined)' | head -60
  echo "== tollgate's own code, inclusive =="; grep -E '\] (<)?tollgate::' "$TMP/perf-inclusive.txt" | head -30
  echo "== by object =="; grep -v '^#' "$TMP/perf-dso.txt" | grep -v '^$' | head -10
else
  TG_KEYS=$KEYS timeout $((DURATION + 60)) wrk -t 1 -c "$CONNS" -d "${DURATION}s" --timeout 10s --latency "${KEYARGS[@]}" "$URL" >"$TMP/wrk.txt" 2>&1 || true
  R1=$(metric)
  echo "[profile] requests during the load: $((R1 - R0)); wrk: $(grep 'Requests/sec' "$TMP/wrk.txt")" >&2
  # SIGTERM: tollgate drains and exits; callgrind writes its file at exit.
  kill -TERM "$GW_PID"
  for _ in $(seq 600); do kill -0 "$GW_PID" 2>/dev/null || break; sleep 0.1; done
  callgrind_annotate --inclusive=yes "$TMP/callgrind.out" >"$TMP/callgrind-inclusive.txt" 2>/dev/null || true
  callgrind_annotate --inclusive=no "$TMP/callgrind.out" >"$TMP/callgrind-self.txt" 2>/dev/null || true
  echo "== inclusive (top 60) =="; sed -n '/^Ir/,$p' "$TMP/callgrind-inclusive.txt" | head -65
  echo "== self (top 40) =="; sed -n '/^Ir/,$p' "$TMP/callgrind-self.txt" | head -45
fi
