#!/usr/bin/env bash
# bench/run.sh — one benchmark run of tollgate against its anchors (nginx, a bare Pingora proxy,
# nginx + Lua + Redis), on loopback only.
#
# Starts (all on 127.0.0.1, free ports, everything in a temp dir):
#   upstream  nginx `return 200` with a small body, 1 worker, keepalive
#   (a) the upstream direct
#   (b) nginx proxy_pass to the upstream, upstream keepalive, worker_processes 1
#   (c) tollgate, store.backend memory, server.threads 1, RUST_LOG=warn (no access log)
#   (d) tollgate, store.backend redis (a redis-server started here), threads 1, RUST_LOG=warn,
#       store.slices on (--exact-redis: off, one round trip per request)
#   (e) tollgate memory as (c) but RUST_LOG=info: the access log on (written to a file)
#   (f) only with --preload LIB: tollgate memory as (c) with LD_PRELOAD=LIB (another malloc,
#       e.g. /usr/lib/x86_64-linux-gnu/libjemalloc.so.2), to price the allocator without a rebuild
#   (g) a bare Pingora 0.9 proxy (examples/bare_pingora.rs: an empty ProxyHttp, jemalloc, one
#       worker thread, work_stealing false, no logging) to the same upstream: the Pingora floor
#   (i) the same bare Pingora doing only the header work tollgate does on every proxied request
#       (BARE_PINGORA_HEADERS=1: Host replaced, X-Forwarded-Host/-For/-Proto and X-Request-Id
#       upstream, the six rate-limit headers on the response; fixed values, through Pingora's
#       header API): what is left of (g) for everything else tollgate does
#   (h) nginx (1 worker) with a Lua access phase doing one EVALSHA of a GCRA script per request
#       on the redis-server of (d), over a pooled cosocket (bench/nginx_gcra.lua), then
#       proxy_pass as (b): the Kong/APISIX way of a Redis-backed limiter
# and measures each with wrk at fixed connections and duration, ROUNDS times interleaved
# (a b c d e g i h, a b c d e g i h, ...), then prints a markdown table of medians, the ratios
# against nginx and against the two anchors with issue 11's targets, Redis round trips per
# request and Redis bytes per budget key.
#
# Preflight: missing tools and packages (nginx, wrk, redis, curl; libnginx-mod-http-lua for h)
# are installed with apt-get when run as root, and named otherwise.
#
# Everything it starts is stopped at exit, Ctrl-C included. No traffic leaves 127.0.0.1, and
# every load is bounded by wrk's -d (and a `timeout` around it).
set -euo pipefail

usage() {
  cat <<'EOF'
usage: bench/run.sh [options]
  --no-build          use the existing binaries in ${CARGO_TARGET_DIR:-target}/release: tollgate,
                      examples/bare_pingora (default: cargo build --release --bin tollgate
                      --example bare_pingora, one invocation so both share dependency builds)
  -c, --connections N wrk connections                      (env CONNS, default 64)
  -d, --duration S    seconds per measurement              (env DURATION, default 10)
  -t, --threads N     wrk threads                          (env WRK_THREADS, default 1)
  -r, --rounds N      interleaved rounds; median reported  (env ROUNDS, default 3)
  -k, --keys N        distinct API keys (wrk lua script);
                      1 = one static X-API-Key header      (env KEYS, default 1000)
  -w, --warmup S      warm-up seconds per target, not measured (env WARMUP, default 2)
      --no-info-log   skip (e), the RUST_LOG=info run
      --exact-redis   (d) with store.slices off: one Redis round trip per request
      --preload LIB   add (f): tollgate memory store with LD_PRELOAD=LIB (an allocator)
      --only "c g"    measure only these configurations (letters above; g, i and h are only
                      built and started when selected)
      --out DIR       keep configs, wrk outputs and logs in DIR (default: a temp dir, removed)
      --tollgate-yaml FILE  append FILE to every tollgate config (e.g. a `tracing:` block);
                      @UP_PORT@ in it becomes the upstream nginx's port (it answers 200 to
                      any request, an OTLP export included)
      --syscalls      after the rounds, one more wrk run per selected letter (b c d g i h) under
                      `perf stat`: system calls (tracepoints) and allocations (uprobes on the
                      malloc family of libc and of jemalloc) per request, side by side
      --sched         per configuration, what the scheduler did with each process during the
                      rounds (/proc/PID/task/*/schedstat): the share of one CPU it ran, the share
                      it was runnable but waiting for a CPU, and its context switches per second;
                      for the server, its upstream nginx and, in (d) and (h), redis-server
  -h, --help
EOF
}

CONNS=${CONNS:-64}
DURATION=${DURATION:-10}
WRK_THREADS=${WRK_THREADS:-1}
ROUNDS=${ROUNDS:-3}
KEYS=${KEYS:-1000}
WARMUP=${WARMUP:-2}
BUILD=1
WITH_INFO=1
PRELOAD=""
ONLY=""
TOLLGATE_YAML=""
OUT=""
SYSCALLS=0
SCHED=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --no-build) BUILD=0 ;;
    -c|--connections) CONNS=$2; shift ;;
    -d|--duration) DURATION=$2; shift ;;
    -t|--threads) WRK_THREADS=$2; shift ;;
    -r|--rounds) ROUNDS=$2; shift ;;
    -k|--keys) KEYS=$2; shift ;;
    -w|--warmup) WARMUP=$2; shift ;;
    --no-info-log) WITH_INFO=0 ;;
    --exact-redis) SLICES=false ;;
    --preload) PRELOAD=$2; shift ;;
    --only) ONLY=$2; shift ;;
    --out) OUT=$2; shift ;;
    --tollgate-yaml) TOLLGATE_YAML=$2; shift ;;
    --syscalls) SYSCALLS=1 ;;
    --sched) SCHED=1 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "unknown option: $1" >&2; usage >&2; exit 2 ;;
  esac
  shift
done
for v in CONNS DURATION WRK_THREADS ROUNDS KEYS WARMUP; do
  [[ ${!v} =~ ^[0-9]+$ && ${!v} -ge 0 ]] || { echo "$v must be a whole number, got '${!v}'" >&2; exit 2; }
done
[[ $CONNS -ge 1 && $DURATION -ge 1 && $WRK_THREADS -ge 1 && $ROUNDS -ge 1 && $KEYS -ge 1 ]] ||
  { echo "connections, duration, threads, rounds and keys must be >= 1" >&2; exit 2; }

# The configurations to measure (letters in the header), in the order of each round.
NAMES=(a b c d)
[[ $WITH_INFO == 1 ]] && NAMES+=(e)
[[ -n $PRELOAD ]] && NAMES+=(f)
NAMES+=(g i h)
if [[ -n $ONLY ]]; then
  KEEP=()
  for n in "${NAMES[@]}"; do [[ " $ONLY " == *" $n "* ]] && KEEP+=("$n"); done
  [[ ${#KEEP[@]} -gt 0 ]] || { echo "--only '$ONLY' selects nothing from: ${NAMES[*]}" >&2; exit 2; }
  NAMES=("${KEEP[@]}")
fi
has() { [[ " ${NAMES[*]} " == *" $1 "* ]]; }

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# Where cargo puts the binaries: it honours CARGO_TARGET_DIR, so must we.
TARGET_DIR=${CARGO_TARGET_DIR:-$ROOT/target}
BIN=${TOLLGATE_BIN:-$TARGET_DIR/release/tollgate}
BARE_BIN=${BARE_PINGORA_BIN:-$TARGET_DIR/release/examples/bare_pingora}
NGINX=${NGINX:-$(command -v nginx || echo /usr/sbin/nginx)}
NGINX_MODULES=${NGINX_MODULES:-/usr/lib/nginx/modules}

# Preflight: each missing tool with the Debian package that has it. As root with apt-get they
# are installed; otherwise the script names them and stops.
MISSING=()
for tp in "$NGINX:nginx" wrk:wrk redis-server:redis-server redis-cli:redis-tools curl:curl \
          ss:iproute2 awk:mawk sort:coreutils getconf:libc-bin; do
  command -v "${tp%:*}" >/dev/null || MISSING+=("${tp##*:}")
done
# (h): the Lua module and the resty.core library it loads at start (packaged as dependencies).
if has h && ! [[ -r $NGINX_MODULES/ngx_http_lua_module.so && -r $NGINX_MODULES/ndk_http_module.so &&
                 -r /usr/share/lua/5.1/resty/core.lua ]]; then
  MISSING+=(libnginx-mod-http-lua)
fi
if [[ ${#MISSING[@]} -gt 0 ]]; then
  if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
    echo "[bench] installing missing packages: ${MISSING[*]}" >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${MISSING[@]}" >&2 ||
      { DEBIAN_FRONTEND=noninteractive apt-get update -q >&2 &&
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${MISSING[@]}" >&2; } ||
      { echo "apt-get could not install: ${MISSING[*]}" >&2; exit 1; }
  else
    echo "missing (Debian packages): ${MISSING[*]} — as root: apt-get install ${MISSING[*]}" >&2
    exit 1
  fi
fi

log() { echo "[bench] $*" >&2; }

# ---------------------------------------------------------------------------------------------
# Processes we start, and their cleanup (on any exit, Ctrl-C included).
PIDS=()
WRK_PID=""
if [[ -n $OUT ]]; then
  mkdir -p "$OUT"
  TMP=$(cd "$OUT" && pwd)
else
  TMP=$(mktemp -d "${TMPDIR:-/tmp}/tollgate-bench.XXXXXX")
fi
# nginx workers drop to `nobody` when started as root: they must be able to enter the dir.
chmod 755 "$TMP"

cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  if [[ -n $WRK_PID ]]; then kill "$WRK_PID" 2>/dev/null || true; fi
  local pid
  for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  done
  if [[ -z $OUT ]]; then rm -rf "$TMP"; else log "kept outputs in $TMP"; fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# A free loopback port, into the variable named $1 (not in a $(...) subshell, so that
# USED_PORTS remembers what this run handed out). Taken below the kernel's ephemeral range:
# there, an outgoing connection (ours to an upstream or Redis, or another process's) can hold
# the port between this check and the bind. Free means no socket of any state uses it.
USED_PORTS=" "
EPHEMERAL_LOW=$(awk '{ print $1 }' /proc/sys/net/ipv4/ip_local_port_range 2>/dev/null || echo 32768)
if [[ $EPHEMERAL_LOW -gt 11000 ]]; then PORT_LO=10000; PORT_HI=$EPHEMERAL_LOW; else PORT_LO=20000; PORT_HI=50000; fi
free_port() {
  local -n out=$1
  local p
  for _ in $(seq 200); do
    p=$((PORT_LO + RANDOM % (PORT_HI - PORT_LO)))
    [[ $USED_PORTS == *" $p "* ]] && continue
    [[ -z $(ss -Htan "( sport = :$p )" 2>/dev/null) ]] || continue
    if ! (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; then
      USED_PORTS+="$p "
      out=$p
      return
    fi
  done
  echo "no free port found" >&2
  return 1
}

# Waits (bounded) until URL answers 200 with the bench key.
wait_http() {
  local url=$1 what=$2
  for _ in $(seq 100); do
    if [[ $(curl -s -o /dev/null -w '%{http_code}' -m 1 -H 'X-API-Key: bench-key-0001' "$url" || true) == 200 ]]; then
      return 0
    fi
    sleep 0.1
  done
  echo "$what did not answer 200 at $url; logs in $TMP" >&2
  [[ -z $OUT ]] && for f in "$TMP"/*.log "$TMP"/*/*.log; do [[ -f $f ]] && { echo "== $f" >&2; tail -20 "$f" >&2; }; done
  return 1
}

# ---------------------------------------------------------------------------------------------
# Build.
if [[ $BUILD == 1 ]]; then
  # One invocation for both: the example pulls in the dev-dependencies' features, and building
  # them together links tollgate and the bare proxy against the very same Pingora and tokio.
  CARGO_ARGS=(build --release --bin tollgate)
  { has g || has i; } && CARGO_ARGS+=(--example bare_pingora)
  log "cargo ${CARGO_ARGS[*]}"
  (cd "$ROOT" && cargo "${CARGO_ARGS[@]}") >&2
fi
[[ -x $BIN ]] || { echo "no binary at $BIN (build it, or drop --no-build)" >&2; exit 1; }
if { has g || has i; } && [[ ! -x $BARE_BIN ]]; then
  echo "no binary at $BARE_BIN (cargo build --release --example bare_pingora, or drop --no-build)" >&2
  exit 1
fi

for v in UP_PORT PX_PORT RD_PORT TM_PORT TM_ADMIN TR_PORT TR_ADMIN TI_PORT TI_ADMIN TP_PORT TP_ADMIN \
         BP_PORT BI_PORT NL_PORT; do
  free_port "$v"
done
if [[ -n $PRELOAD && ! -r $PRELOAD ]]; then echo "--preload: cannot read $PRELOAD" >&2; exit 1; fi
PATH_UNDER_TEST=/api/items/42

# ---------------------------------------------------------------------------------------------
# nginx: the upstream, and the nginx proxy (b). Temp, pid and log paths in $TMP.
nginx_conf() { # name listen-port http-block-body [main-context lines]
  local dir=$TMP/$1
  mkdir -p "$dir/tmp"
  chmod 755 "$dir" "$dir/tmp"
  cat >"$dir/nginx.conf" <<EOF
${4:-}
worker_processes 1;
pid $dir/nginx.pid;
error_log $dir/error.log warn;
events { worker_connections 4096; }
http {
  access_log off;
  client_body_temp_path $dir/tmp/body;
  proxy_temp_path $dir/tmp/proxy;
  fastcgi_temp_path $dir/tmp/fastcgi;
  uwsgi_temp_path $dir/tmp/uwsgi;
  scgi_temp_path $dir/tmp/scgi;
  keepalive_timeout 75s;
  keepalive_requests 1000000;
$3
}
EOF
}
start_nginx() { # name → the master's pid in NGINX_PID
  local dir=$TMP/$1
  "$NGINX" -t -q -p "$dir" -e "$dir/error.log" -c "$dir/nginx.conf" >&2
  "$NGINX" -p "$dir" -e "$dir/error.log" -c "$dir/nginx.conf" -g 'daemon off;' >>"$dir/stdout.log" 2>&1 &
  NGINX_PID=$!
  PIDS+=("$NGINX_PID")
}

nginx_conf upstream "$UP_PORT" "
  server {
    listen 127.0.0.1:$UP_PORT;
    location / {
      default_type application/json;
      return 200 '{\"id\":42,\"name\":\"widget\",\"ok\":true}\n';
    }
  }"
# (b): what tollgate does besides charging: proxy with a keepalive pool and X-Forwarded-* headers.
nginx_conf proxy "$PX_PORT" "
  upstream backend {
    server 127.0.0.1:$UP_PORT;
    keepalive 128;
    keepalive_requests 1000000;
  }
  server {
    listen 127.0.0.1:$PX_PORT;
    location / {
      proxy_pass http://backend;
      proxy_http_version 1.1;
      proxy_set_header Connection \"\";
      proxy_set_header X-Forwarded-For \$proxy_add_x_forwarded_for;
      proxy_set_header X-Forwarded-Host \$host;
      proxy_set_header X-Forwarded-Proto \$scheme;
    }
  }"

log "starting upstream nginx on :$UP_PORT and nginx proxy on :$PX_PORT"
start_nginx upstream; UP_PID=$NGINX_PID
start_nginx proxy;    PX_PID=$NGINX_PID
wait_http "http://127.0.0.1:$UP_PORT$PATH_UNDER_TEST" "upstream nginx"
wait_http "http://127.0.0.1:$PX_PORT$PATH_UNDER_TEST" "nginx proxy"

# ---------------------------------------------------------------------------------------------
# redis-server for (d).
mkdir -p "$TMP/redis"
log "starting redis-server on :$RD_PORT"
redis-server --port "$RD_PORT" --bind 127.0.0.1 --save '' --appendonly no \
  --dir "$TMP/redis" --logfile "$TMP/redis/redis.log" --daemonize no &
RD_PID=$!
PIDS+=("$RD_PID")
for _ in $(seq 100); do
  [[ $(redis-cli -p "$RD_PORT" ping 2>/dev/null || true) == PONG ]] && break
  sleep 0.1
done
[[ $(redis-cli -p "$RD_PORT" ping 2>/dev/null || true) == PONG ]] || { echo "redis-server did not start" >&2; exit 1; }

# ---------------------------------------------------------------------------------------------
# The anchors of issue 11, started only when selected.
BP_PID=""
if has g; then
  log "starting bare Pingora on :$BP_PORT"
  # TMPDIR: Pingora's pid file and upgrade socket go to the process's temp dir.
  TMPDIR=$TMP "$BARE_BIN" "127.0.0.1:$BP_PORT" "127.0.0.1:$UP_PORT" >>"$TMP/bare-pingora.log" 2>&1 &
  BP_PID=$!
  PIDS+=("$BP_PID")
  wait_http "http://127.0.0.1:$BP_PORT$PATH_UNDER_TEST" "bare Pingora"
fi
BI_PID=""
if has i; then
  log "starting bare Pingora with tollgate's headers on :$BI_PORT"
  BARE_PINGORA_HEADERS=1 TMPDIR=$TMP "$BARE_BIN" "127.0.0.1:$BI_PORT" "127.0.0.1:$UP_PORT" >>"$TMP/bare-pingora-headers.log" 2>&1 &
  BI_PID=$!
  PIDS+=("$BI_PID")
  wait_http "http://127.0.0.1:$BI_PORT$PATH_UNDER_TEST" "bare Pingora with headers"
fi
NL_PID=""
if has h; then
  # The same budget as tollgate's BENCH_BUDGET below (100000000 units per 1 s: nothing refused),
  # on (d)'s redis-server; keys ng{...}b do not meet tollgate's t{...}b.
  mkdir -p "$TMP/nginx-lua/lua"
  cp "$ROOT/bench/nginx_gcra.lua" "$TMP/nginx-lua/lua/"
  chmod -R a+rX "$TMP/nginx-lua"
  nginx_conf nginx-lua "$NL_PORT" "
  lua_package_path \"$TMP/nginx-lua/lua/?.lua;/usr/share/lua/5.1/?.lua;;\";
  init_by_lua_block {
    require(\"nginx_gcra\").configure{ redis_port = $RD_PORT, timeout_ms = 50,
                                      limit = 100000000, window_us = 1000000 }
  }
  upstream backend {
    server 127.0.0.1:$UP_PORT;
    keepalive 128;
    keepalive_requests 1000000;
  }
  server {
    listen 127.0.0.1:$NL_PORT;
    location / {
      access_by_lua_block { require(\"nginx_gcra\").access() }
      proxy_pass http://backend;
      proxy_http_version 1.1;
      proxy_set_header Connection \"\";
      proxy_set_header X-Forwarded-For \$proxy_add_x_forwarded_for;
      proxy_set_header X-Forwarded-Host \$host;
      proxy_set_header X-Forwarded-Proto \$scheme;
    }
  }" "load_module $NGINX_MODULES/ndk_http_module.so;
load_module $NGINX_MODULES/ngx_http_lua_module.so;"
  log "starting nginx + Lua + Redis on :$NL_PORT"
  start_nginx nginx-lua; NL_PID=$NGINX_PID
  wait_http "http://127.0.0.1:$NL_PORT$PATH_UNDER_TEST" "nginx + Lua + Redis"
fi

# ---------------------------------------------------------------------------------------------
# tollgate configs: a budget so large nothing is refused; one route matches the path under test.
tollgate_conf() { # file port admin store-yaml budget-yaml
  cat >"$1" <<EOF
server:
  listen: "127.0.0.1:$2"
  admin_listen: "127.0.0.1:$3"
  threads: 1
  grace_period: 1s
upstream:
  url: "http://127.0.0.1:$UP_PORT"
store:
$4
rate_limits:
  default: $5
  endpoints:
    /reports/generate: {cost: 20, max_in_flight: 5, queue_timeout: 2s}
    /exports/bulk: {cost: 15}
    /analytics/query: {cost: 10}
    "GET /reports/{id}": {cost: 1}
    "GET /api/items/{id}": {cost: 1}
EOF
  if [[ -n $TOLLGATE_YAML ]]; then sed "s/@UP_PORT@/$UP_PORT/g" "$TOLLGATE_YAML" >>"$1"; fi
}
BENCH_BUDGET='{cost: 1, window: 1s, max_cost: 100000000}'
MEM_STORE='  backend: memory'
REDIS_STORE="  backend: redis
  url: \"redis://127.0.0.1:$RD_PORT/0\"
  timeout: 50ms
  slices: ${SLICES:-true}"
tollgate_conf "$TMP/tollgate-memory.yaml" "$TM_PORT" "$TM_ADMIN" "$MEM_STORE" "$BENCH_BUDGET"
tollgate_conf "$TMP/tollgate-redis.yaml" "$TR_PORT" "$TR_ADMIN" "$REDIS_STORE" "$BENCH_BUDGET"
tollgate_conf "$TMP/tollgate-info.yaml" "$TI_PORT" "$TI_ADMIN" "$MEM_STORE" "$BENCH_BUDGET"
tollgate_conf "$TMP/tollgate-preload.yaml" "$TP_PORT" "$TP_ADMIN" "$MEM_STORE" "$BENCH_BUDGET"

start_tollgate() { # name rust_log [LD_PRELOAD]
  # stderr in append mode, so that truncating the file between runs keeps it small.
  if [[ -n ${3:-} ]]; then
    LD_PRELOAD=$3 RUST_LOG=$2 "$BIN" run -c "$TMP/tollgate-$1.yaml" >>"$TMP/tollgate-$1.log" 2>&1 &
  else
    RUST_LOG=$2 "$BIN" run -c "$TMP/tollgate-$1.yaml" >>"$TMP/tollgate-$1.log" 2>&1 &
  fi
  PIDS+=($!)
}
log "starting tollgate memory :$TM_PORT, redis :$TR_PORT$([[ $WITH_INFO == 1 ]] && echo ", memory+info-log :$TI_PORT")"
start_tollgate memory warn;  TM_PID=${PIDS[-1]}
start_tollgate redis warn;   TR_PID=${PIDS[-1]}
TI_PID=""
if [[ $WITH_INFO == 1 ]]; then start_tollgate info info; TI_PID=${PIDS[-1]}; fi
TP_PID=""
if [[ -n $PRELOAD ]]; then start_tollgate preload warn "$PRELOAD"; TP_PID=${PIDS[-1]}; fi
wait_http "http://127.0.0.1:$TM_PORT$PATH_UNDER_TEST" "tollgate (memory)"
wait_http "http://127.0.0.1:$TR_PORT$PATH_UNDER_TEST" "tollgate (redis)"
[[ -n $TI_PID ]] && wait_http "http://127.0.0.1:$TI_PORT$PATH_UNDER_TEST" "tollgate (memory, info log)"
[[ -n $TP_PID ]] && wait_http "http://127.0.0.1:$TP_PORT$PATH_UNDER_TEST" "tollgate (memory, LD_PRELOAD)"

# ---------------------------------------------------------------------------------------------
# Measurement helpers.
declare -A LABEL PORT PIDOF
LABEL[a]="a. upstream direct (nginx return 200)";        PORT[a]=$UP_PORT; PIDOF[a]=$UP_PID
LABEL[b]="b. nginx proxy_pass, keepalive, 1 worker";     PORT[b]=$PX_PORT; PIDOF[b]=$PX_PID
LABEL[c]="c. tollgate, memory store, threads 1";         PORT[c]=$TM_PORT; PIDOF[c]=$TM_PID
LABEL[d]="d. tollgate, redis store (slices ${SLICES:-true}), threads 1";          PORT[d]=$TR_PORT; PIDOF[d]=$TR_PID
LABEL[e]="e. tollgate, memory store, RUST_LOG=info";     PORT[e]=$TI_PORT; PIDOF[e]=$TI_PID
LABEL[f]="f. tollgate, memory store, LD_PRELOAD=$(basename "${PRELOAD:-none}")"; PORT[f]=$TP_PORT; PIDOF[f]=$TP_PID
LABEL[g]="g. bare Pingora 0.9 (empty ProxyHttp), threads 1"; PORT[g]=$BP_PORT; PIDOF[g]=$BP_PID
LABEL[i]="i. bare Pingora + tollgate's headers (fixed values)";   PORT[i]=$BI_PORT; PIDOF[i]=$BI_PID
LABEL[h]="h. nginx + Lua, 1 Redis EVALSHA (GCRA)/req";   PORT[h]=$NL_PORT; PIDOF[h]=$NL_PID

WRK_KEY_ARGS=()
if [[ $KEYS -gt 1 ]]; then
  WRK_KEY_ARGS=(-s "$ROOT/bench/keys.lua")
else
  WRK_KEY_ARGS=(-H 'X-API-Key: bench-key-0001')
fi

run_wrk() { # name seconds outfile
  local url="http://127.0.0.1:${PORT[$1]}$PATH_UNDER_TEST"
  TG_KEYS=$KEYS timeout $(($2 + 30)) wrk -t "$WRK_THREADS" -c "$CONNS" -d "${2}s" --timeout 5s --latency \
    "${WRK_KEY_ARGS[@]}" "$url" >"$3" 2>&1 &
  WRK_PID=$!
  wait "$WRK_PID" || { echo "wrk failed for $1; output:" >&2; cat "$3" >&2; exit 1; }
  WRK_PID=""
}

# CPU ticks (utime+stime, all threads) of a process and its children (nginx master + workers).
cpu_ticks() {
  local pid=$1 total=0 p
  for p in "$pid" $(pgrep -P "$pid" || true); do
    [[ -r /proc/$p/stat ]] || continue
    # fields after the ")" of comm: utime is the 12th, stime the 13th
    total=$((total + $(sed 's/.*) //' "/proc/$p/stat" | awk '{print $12 + $13}')))
  done
  echo "$total"
}
CLK_TCK=$(getconf CLK_TCK)
# The whole machine's CPU ticks, "busy total" (busy: user nice system irq softirq steal; total
# adds idle and iowait), from /proc/stat's first line: every process in the run together (the
# server, its upstream, wrk, redis-server), for what a request costs the machine.
machine_ticks() { awk '/^cpu / { b = $2 + $3 + $4 + $7 + $8 + $9; print b, b + $5 + $6; exit }' /proc/stat; }
# CPU ticks → µs per request (0 when no request completed).
us_per_request() { awk -v t="$1" -v hz="$CLK_TCK" -v q="$2" 'BEGIN { printf "%.1f", (q > 0 ? t / hz * 1e6 / q : 0) }'; }

# Parses wrk --latency output: "rps p50_us p99_us requests errors non2xx".
parse_wrk() {
  awk '
    function us(v) {
      if (v ~ /us$/) { sub(/us$/, "", v); return v + 0 }
      if (v ~ /ms$/) { sub(/ms$/, "", v); return v * 1000 }
      if (v ~ /m$/)  { sub(/m$/, "", v);  return v * 60000000 }
      if (v ~ /s$/)  { sub(/s$/, "", v);  return v * 1000000 }
      return v + 0
    }
    /^Requests\/sec:/                 { rps = $2 }
    $1 == "50%" && !p50               { p50 = us($2) }
    $1 == "99%" && !p99               { p99 = us($2) }
    / requests in /                   { reqs = $1 }
    /Socket errors:/                  { gsub(",", ""); errs = $4 + $6 + $8 + $10 }
    /Non-2xx or 3xx responses:/       { non2xx = $NF }
    END { printf "%s %s %s %s %d %d\n", rps, p50, p99, reqs, errs, non2xx }
  ' "$1"
}

redis_cmdstats() { # "command calls usec" lines (INFO itself excluded)
  redis-cli -p "$RD_PORT" INFO commandstats | tr -d '\r' | awk -F'[:,=]' '
    /^cmdstat_/ { cmd = $1; sub("cmdstat_", "", cmd); if (cmd != "info") print cmd, $3, $5 }'
}
requests_total() { # sum of tollgate_requests_total over all series
  curl -s -m 2 "http://127.0.0.1:$1/metrics" | awk '/^tollgate_requests_total\{/ { s += $NF } END { printf "%d\n", s }'
}

# "run_ns wait_ns switches" of every thread of PIDs and their children (/proc/PID/task/*/schedstat:
# time on a CPU, time runnable but waiting for one, times it was switched in).
sched_of() {
  local p
  for p in "$@" $(for q in "$@"; do pgrep -P "$q" || true; done); do
    # A thread (or a child) that ended meanwhile is skipped.
    cat /proc/"$p"/task/*/schedstat 2>/dev/null || true
  done | awk '{ r += $1; w += $2; s += $3 } END { printf "%.0f %.0f %.0f\n", r, w, s }'
}
now_ns() { date +%s%N; }

median() { # numbers on stdin → median
  sort -g | awk '{ v[NR] = $1 } END { if (NR == 0) { print "nan"; exit } if (NR % 2) print v[(NR + 1) / 2]; else print (v[NR / 2] + v[NR / 2 + 1]) / 2 }'
}

# ---------------------------------------------------------------------------------------------
# Warm-up (connections, upstream keepalive pools, Redis script cache), then interleaved rounds.
if [[ $WARMUP -gt 0 ]]; then
  for n in "${NAMES[@]}"; do
    log "warm-up ${WARMUP}s: ${LABEL[$n]}"
    run_wrk "$n" "$WARMUP" "$TMP/warmup-$n.txt"
  done
fi
[[ -n $TI_PID ]] && : >"$TMP/tollgate-info.log"

declare -A RES CPU MCPU BUSY
declare -A RCMD   # "letter,command" → Redis calls during that letter's runs (d and h)
declare -A RUSEC=([d]=0 [h]=0)  # letter → Redis's usec (INFO commandstats, top-level calls)
declare -A SCH     # "letter,who" → "run_ns wait_ns switches" summed over the rounds (--sched)
declare -A SCH_NS  # letter → wall ns of its rounds (--sched)
declare -A RT_REQS=([d]=0 [h]=0)
for r in $(seq "$ROUNDS"); do
  for n in "${NAMES[@]}"; do
    log "round $r/$ROUNDS: ${LABEL[$n]} (${DURATION}s, $CONNS connections, $WRK_THREADS wrk thread(s), $KEYS key(s))"
    if [[ $n == d || $n == h ]]; then redis_cmdstats >"$TMP/redis-before.txt"; fi
    [[ $n == d ]] && q0=$(requests_total "$TR_ADMIN")
    if [[ $SCHED == 1 ]]; then
      # (a) is the upstream itself: counted once, as the server.
      SCH_WHO=(server); SCH_PIDS=("${PIDOF[$n]}")
      if [[ $n != a ]]; then SCH_WHO+=(upstream); SCH_PIDS+=("$UP_PID"); fi
      if [[ $n == d || $n == h ]]; then SCH_WHO+=(redis); SCH_PIDS+=("$RD_PID"); fi
      SCH0=(); for p in "${SCH_PIDS[@]}"; do SCH0+=("$(sched_of "$p")"); done
      ns0=$(now_ns)
    fi
    t0=$(cpu_ticks "${PIDOF[$n]}")
    read -r mb0 mt0 < <(machine_ticks)
    run_wrk "$n" "$DURATION" "$TMP/wrk-$n-$r.txt"
    read -r mb1 mt1 < <(machine_ticks)
    t1=$(cpu_ticks "${PIDOF[$n]}")
    if [[ $SCHED == 1 ]]; then
      ns1=$(now_ns)
      SCH_NS[$n]=$(( ${SCH_NS[$n]:-0} + ns1 - ns0 ))
      for i in "${!SCH_WHO[@]}"; do
        read -r a0 b0 c0 <<<"${SCH0[$i]}"; read -r a1 b1 c1 < <(sched_of "${SCH_PIDS[$i]}")
        read -r a b c <<<"${SCH[$n,${SCH_WHO[$i]}]:-0 0 0}"
        SCH[$n,${SCH_WHO[$i]}]="$((a + a1 - a0)) $((b + b1 - b0)) $((c + c1 - c0))"
      done
    fi
    RES[$n,$r]=$(parse_wrk "$TMP/wrk-$n-$r.txt")
    read -r rps p50 p99 reqs errs non2xx <<<"${RES[$n,$r]}"
    if [[ $n == d || $n == h ]]; then
      redis_cmdstats >"$TMP/redis-after.txt"
      if [[ $n == d ]]; then
        q1=$(requests_total "$TR_ADMIN")
        RT_REQS[d]=$((RT_REQS[d] + q1 - q0))
      else
        # nginx has no request counter here: wrk's completed requests (those still in flight
        # when wrk stops were charged but are not counted, ≤ CONNS per run)
        RT_REQS[h]=$((RT_REQS[h] + reqs))
      fi
      while read -r cmd delta usec; do
        RCMD[$n,$cmd]=$(( ${RCMD[$n,$cmd]:-0} + delta ))
        # A script's usec includes the commands it runs: count top-level calls only.
        case $cmd in evalsha|eval|evalsha_ro|eval_ro|fcall|script|ping|hello|client|select|auth)
          RUSEC[$n]=$(( RUSEC[$n] + usec )) ;;
        esac
      done < <(awk 'NR == FNR { b[$1] = $2; u[$1] = $3; next } { d = $2 - b[$1]; if (d > 0) print $1, d, $3 - u[$1] }' \
                 "$TMP/redis-before.txt" "$TMP/redis-after.txt")
    fi
    # CPU µs of the server under test per request served
    CPU[$n,$r]=$(us_per_request $((t1 - t0)) "$reqs")
    MCPU[$n,$r]=$(us_per_request $((mb1 - mb0)) "$reqs")
    BUSY[$n,$r]=$(awk -v b=$((mb1 - mb0)) -v t=$((mt1 - mt0)) 'BEGIN { printf "%.0f", (t > 0 ? 100 * b / t : 0) }')
    log "  $rps req/s, p50 ${p50}us, p99 ${p99}us, $reqs requests, errors $errs, non-2xx $non2xx, ${CPU[$n,$r]} CPU us/req, machine ${MCPU[$n,$r]} CPU us/req (${BUSY[$n,$r]} % busy)"
    [[ $n == e ]] && : >"$TMP/tollgate-info.log"
  done
done
if [[ -n $TOLLGATE_YAML ]]; then
  # With a tracing: block, what the exporter could not send (0: every span reached the receiver).
  for a in "$TM_ADMIN" "$TR_ADMIN"; do
    d=$(curl -s --max-time 2 "http://127.0.0.1:$a/metrics" | awk '/^tollgate_trace_spans_dropped_total /{print $2}')
    if [[ -n $d ]]; then log "tollgate (admin :$a): tollgate_trace_spans_dropped_total $d"; fi
  done
fi

# ---------------------------------------------------------------------------------------------
# --syscalls: what each server asks of the kernel and of its allocator per request.
SYSCALL_TABLE=""
if [[ $SYSCALLS == 1 ]]; then
  command -v perf >/dev/null || { echo "--syscalls needs perf (apt-get install linux-perf)" >&2; exit 1; }
  SC_LIST=(read write readv writev recvfrom sendto recvmsg sendmsg epoll_wait epoll_pwait epoll_ctl
           futex accept4 close sched_yield mmap munmap madvise mprotect brk getrandom ioctl
           clock_gettime setsockopt getsockopt)
  SC_EVENTS="raw_syscalls:sys_enter"
  for c in "${SC_LIST[@]}"; do
    [[ -d /sys/kernel/tracing/events/syscalls/sys_enter_$c ]] && SC_EVENTS+=",syscalls:sys_enter_$c"
  done
  # (grep reads all of perf's output: with `grep -q`, pipefail would see perf's SIGPIPE.)
  probe_exists() { perf probe -l 2>/dev/null | grep -F "$1" >/dev/null; }
  # Allocation probes: libc's malloc family for every server, jemalloc's (tollgate, bare Pingora).
  LIBC=$(ldd "$BIN" | awk '/libc\.so/ { print $3 }')
  ALLOC_EVENTS=""
  for f in malloc calloc realloc; do
    perf probe -q -x "$LIBC" --add "libc_$f=$f" 2>/dev/null || true
    probe_exists "probe_libc:libc_$f" && ALLOC_EVENTS+=",probe_libc:libc_$f"
  done
  for b in "$BIN" "$BARE_BIN"; do
    grp=$(basename "$b")
    for f in malloc mallocx calloc rallocx realloc; do
      perf probe -q -x "$b" --add "${grp}_$f=_rjem_$f" 2>/dev/null || true
    done
  done
  sc_pids() { local p=$1; echo -n "$p"; for c in $(pgrep -P "$p" || true); do echo -n ",$c"; done; }
  SYSCALL_TABLE="| configuration | syscalls/req | allocations/req | the largest per request |"$'\n'"|---|---:|---:|---|"
  for n in "${NAMES[@]}"; do
    [[ $n == b || $n == c || $n == d || $n == g || $n == i || $n == h ]] || continue
    ev="$SC_EVENTS$ALLOC_EVENTS"
    case $n in
      c|d) grp=$(basename "$BIN") ;;
      g|i) grp=$(basename "$BARE_BIN") ;;
      *) grp="" ;;
    esac
    if [[ -n $grp ]]; then
      for f in malloc mallocx calloc rallocx realloc; do
        probe_exists "probe_$grp:${grp}_$f " && ev+=",probe_$grp:${grp}_$f"
      done
    fi
    log "syscalls: ${LABEL[$n]} (${DURATION}s under perf stat)"
    perf stat -x, -e "$ev" -p "$(sc_pids "${PIDOF[$n]}")" -o "$TMP/perf-$n.txt" -- sleep $((DURATION + 1)) &
    PERF_PID=$!
    sleep 0.5
    run_wrk "$n" "$DURATION" "$TMP/wrk-sc-$n.txt"
    wait "$PERF_PID" || true
    read -r _ _ _ reqs _ _ <<<"$(parse_wrk "$TMP/wrk-sc-$n.txt")"
    row=$(awk -F, -v q="$reqs" '
      $3 == "raw_syscalls:sys_enter" { total = $1 }
      $3 ~ /^syscalls:sys_enter_/ { n = $3; sub("syscalls:sys_enter_", "", n); per[n] = $1 }
      $3 ~ /^probe_/ { allocs += $1 }
      END {
        out = ""
        for (k = 0; k < 6; k++) {
          best = ""; bv = 0
          for (c in per) if (per[c] > bv) { bv = per[c]; best = c }
          if (best == "" || bv / q < 0.05) break
          out = out sprintf("%s%s %.2f", (out == "" ? "" : ", "), best, bv / q)
          delete per[best]
        }
        printf "%.2f | %.2f | %s", total / q, allocs / q, out
      }' "$TMP/perf-$n.txt")
    SYSCALL_TABLE+=$'\n'"| ${LABEL[$n]} | $row |"
  done
  perf probe -q --del 'probe_libc:*' 2>/dev/null || true
  perf probe -q --del "probe_$(basename "$BIN"):*" 2>/dev/null || true
  perf probe -q --del "probe_$(basename "$BARE_BIN"):*" 2>/dev/null || true
fi

# ---------------------------------------------------------------------------------------------
# Redis memory per budget key. (1) keys written during a short load with the bench budget
# (they live ~1 ms: sampled atomically inside a script); (2) one key written with a realistic
# budget (120 units per hour, so it lives 30 s), after a SIGHUP reload of (d)'s config.
log "sampling Redis MEMORY USAGE of budget keys"
SAMPLE_LUA="local k = redis.call('RANDOMKEY') if k then return {k, redis.call('MEMORY', 'USAGE', k), redis.call('GET', k)} end return {}"
run_wrk d 3 "$TMP/wrk-sample.txt" &
SAMPLER=$!
BENCH_KEY_SAMPLE=""
for _ in $(seq 200); do
  out=$(redis-cli -p "$RD_PORT" EVAL "$SAMPLE_LUA" 0 2>/dev/null | tr '\n' ' ')
  if [[ $out == t\{* ]]; then BENCH_KEY_SAMPLE=$out; break; fi
  sleep 0.01
done
wait "$SAMPLER" || true

tollgate_conf "$TMP/tollgate-redis.yaml" "$TR_PORT" "$TR_ADMIN" "$REDIS_STORE" '{cost: 1, window: 1h, max_cost: 120}'
kill -HUP "$TR_PID"
sleep 1
REAL_KEY_SAMPLE=""
if [[ $(curl -s -o /dev/null -w '%{http_code}' -m 2 -H 'X-API-Key: memory-usage-probe' "http://127.0.0.1:$TR_PORT$PATH_UNDER_TEST") == 200 ]]; then
  k=$(redis-cli -p "$RD_PORT" --scan --pattern 't{*}b' | head -1)
  if [[ -n $k ]]; then
    REAL_KEY_SAMPLE="$k $(redis-cli -p "$RD_PORT" MEMORY USAGE "$k") $(redis-cli -p "$RD_PORT" GET "$k") (PTTL $(redis-cli -p "$RD_PORT" PTTL "$k") ms)"
  fi
fi
TM_RSS=$(awk '/VmRSS/ {print $2, $3}' "/proc/$TM_PID/status")
TR_RSS=$(awk '/VmRSS/ {print $2, $3}' "/proc/$TR_PID/status")

# ---------------------------------------------------------------------------------------------
# Report.
field() { # name index(1-based of parse_wrk, or cpu, mcpu, busy) → values of all rounds, one a line
  local n=$1 i=$2 r
  for r in $(seq "$ROUNDS"); do
    case $i in
      cpu) echo "${CPU[$n,$r]}" ;;
      mcpu) echo "${MCPU[$n,$r]}" ;;
      busy) echo "${BUSY[$n,$r]}" ;;
      *) echo "${RES[$n,$r]}" | awk -v i="$i" '{print $i}' ;;
    esac
  done
}
declare -A MED_RPS MED_P50 MED_P99 MED_CPU MED_MCPU MED_BUSY
for n in "${NAMES[@]}"; do
  MED_RPS[$n]=$(field "$n" 1 | median)
  MED_P50[$n]=$(field "$n" 2 | median)
  MED_P99[$n]=$(field "$n" 3 | median)
  MED_CPU[$n]=$(field "$n" cpu | median)
  MED_MCPU[$n]=$(field "$n" mcpu | median)
  MED_BUSY[$n]=$(field "$n" busy | median)
done
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (b > 0) printf "%.2f", a / b; else print "n/a" }'; }

echo
echo "## tollgate vs its anchors — $(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')"
echo
echo "wrk: $CONNS connections, ${DURATION}s, $WRK_THREADS thread(s), GET $PATH_UNDER_TEST, $([[ $KEYS -gt 1 ]] && echo "$KEYS API keys (bench/keys.lua)" || echo "one API key (-H)"); median of $ROUNDS interleaved runs; access logs off unless stated."
echo
echo "| configuration | req/s | p50 ms | p99 ms | req/s of each run | errors / non-2xx | server CPU µs/req | machine CPU µs/req | machine busy % |"
echo "|---|---:|---:|---:|---|---:|---:|---:|---:|"
for n in "${NAMES[@]}"; do
  runs=$(field "$n" 1 | awk '{printf "%s%.0f", (NR > 1 ? ", " : ""), $1}')
  bad=0
  for r in $(seq "$ROUNDS"); do bad=$((bad + $(echo "${RES[$n,$r]}" | awk '{print $5 + $6}'))); done
  printf "| %s | %.0f | %.3f | %.3f | %s | %d | %s | %s | %s |\n" "${LABEL[$n]}" "${MED_RPS[$n]}" \
    "$(awk -v v="${MED_P50[$n]}" 'BEGIN{print v/1000}')" "$(awk -v v="${MED_P99[$n]}" 'BEGIN{print v/1000}')" \
    "$runs" "$bad" "${MED_CPU[$n]}" "${MED_MCPU[$n]}" "${MED_BUSY[$n]}"
done

# Issue 11's targets: "ratio OP bound" per line; a target needs both of its letters measured.
target_row() { # label a b metric(rps|p99) op bound
  local label=$1 a=$2 b=$3 metric=$4 op=$5 bound=$6 va vb
  if ! has "$a" || ! has "$b"; then
    echo "| $label | not measured (needs $a and $b) | $op $bound | |"
    return
  fi
  if [[ $metric == rps ]]; then va=${MED_RPS[$a]}; vb=${MED_RPS[$b]}; else va=${MED_P99[$a]}; vb=${MED_P99[$b]}; fi
  awk -v a="$va" -v b="$vb" -v op="$op" -v bound="$bound" -v label="$label" 'BEGIN {
    if (b <= 0) { printf "| %s | n/a | %s %s | |\n", label, op, bound; exit }
    r = a / b
    met = (op == "≥") ? (r >= bound) : (r <= bound)
    printf "| %s | %.2f | %s %.2f | %s |\n", label, r, op, bound, (met ? "**met**" : "**not met**")
  }'
}
echo
echo "Targets of issue 11 (median vs median, same run):"
echo
echo "| target | measured | bound | |"
echo "|---|---:|---:|---|"
target_row "tollgate memory (c) / bare Pingora (g), req/s" c g rps "≥" 0.90
target_row "tollgate memory (c) / bare Pingora (g), p99" c g p99 "≤" 1.15
target_row "tollgate redis (d) / nginx + Lua + Redis (h), req/s" d h rps "≥" 1.20
target_row "tollgate redis (d) / nginx + Lua + Redis (h), p99" d h p99 "≤" 1.00
if has c && has e; then
  awk -v c="${MED_RPS[c]}" -v e="${MED_RPS[e]}" 'BEGIN {
    if (c <= 0) { print "| access log cost, 1 − (e)/(c) req/s | n/a | ≤ 5 % | |"; exit }
    cost = (1 - e / c) * 100
    printf "| access log cost, 1 − (e)/(c) req/s | %.1f %% | ≤ 5 %% | %s |\n", cost, (cost <= 5 ? "**met**" : "**not met**")
  }'
else
  echo "| access log cost, 1 − (e)/(c) req/s | not measured (needs c and e) | ≤ 5 % | |"
fi
# What the throughput targets ask of tollgate against the header floor (i), which does
# nothing but the header work tollgate does: above 1.00, more than a proxy that only writes
# tollgate's headers.
if has i && { { has c && has g; } || { has d && has h; }; }; then
  echo
  echo "The same targets against the header floor (i), this run:"
  echo
  echo "| | needs | measured |"
  echo "|---|---:|---:|"
  has c && has g && awk -v c="${MED_RPS[c]}" -v g="${MED_RPS[g]}" -v i="${MED_RPS[i]}" 'BEGIN {
    if (i > 0) printf "| (c)/(i) for (c) ≥ 0.90 × (g) | %.2f | %.2f |\n", 0.90 * g / i, c / i }'
  has d && has h && awk -v d="${MED_RPS[d]}" -v h="${MED_RPS[h]}" -v i="${MED_RPS[i]}" 'BEGIN {
    if (i > 0) printf "| (d)/(i) for (d) ≥ 1.20 × (h) | %.2f | %.2f |\n", 1.20 * h / i, d / i }'
fi
other_ratios() { # rows of the table below, for the letters measured
  has b && has c && echo "| tollgate memory (c) / nginx (b) | $(ratio "${MED_RPS[c]}" "${MED_RPS[b]}") | $(ratio "${MED_P99[c]}" "${MED_P99[b]}") |"
  has b && has d && echo "| tollgate redis (d) / nginx (b) | $(ratio "${MED_RPS[d]}" "${MED_RPS[b]}") | $(ratio "${MED_P99[d]}" "${MED_P99[b]}") |"
  has b && has g && echo "| bare Pingora (g) / nginx (b) | $(ratio "${MED_RPS[g]}" "${MED_RPS[b]}") | $(ratio "${MED_P99[g]}" "${MED_P99[b]}") |"
  has g && has i && echo "| bare Pingora + tollgate's headers (i) / bare Pingora (g) | $(ratio "${MED_RPS[i]}" "${MED_RPS[g]}") | $(ratio "${MED_P99[i]}" "${MED_P99[g]}") |"
  has c && has i && echo "| tollgate memory (c) / bare Pingora + tollgate's headers (i) | $(ratio "${MED_RPS[c]}" "${MED_RPS[i]}") | $(ratio "${MED_P99[c]}" "${MED_P99[i]}") |"
  has g && has h && echo "| bare Pingora (g) / nginx + Lua + Redis (h) | $(ratio "${MED_RPS[g]}" "${MED_RPS[h]}") | $(ratio "${MED_P99[g]}" "${MED_P99[h]}") |"
  has i && has h && echo "| bare Pingora + tollgate's headers (i) / nginx + Lua + Redis (h) | $(ratio "${MED_RPS[i]}" "${MED_RPS[h]}") | $(ratio "${MED_P99[i]}" "${MED_P99[h]}") |"
  has b && has h && echo "| nginx + Lua + Redis (h) / nginx (b) | $(ratio "${MED_RPS[h]}" "${MED_RPS[b]}") | $(ratio "${MED_P99[h]}" "${MED_P99[b]}") |"
  if has c && has e; then
    echo "| tollgate memory + access log (e) / no log (c) | $(ratio "${MED_RPS[e]}" "${MED_RPS[c]}") | $(ratio "${MED_P99[e]}" "${MED_P99[c]}") |"
  fi
  if has f && has c; then
    echo "| tollgate memory + $(basename "$PRELOAD") (f) / jemalloc built in (c) | $(ratio "${MED_RPS[f]}" "${MED_RPS[c]}") | $(ratio "${MED_P99[f]}" "${MED_P99[c]}") |"
  fi
  if has f && has b; then
    echo "| tollgate memory + $(basename "$PRELOAD") (f) / nginx (b) | $(ratio "${MED_RPS[f]}" "${MED_RPS[b]}") | $(ratio "${MED_P99[f]}" "${MED_P99[b]}") |"
  fi
  true
}
OTHER=$(other_ratios)
if [[ -n $OTHER ]]; then
  echo
  echo "Other ratios (median vs median):"
  echo
  echo "| | req/s ratio | p99 ratio |"
  echo "|---|---:|---:|"
  echo "$OTHER"
fi
echo
echo "Server CPU µs/req: CPU time (user+sys, all threads) of the process under test — the upstream for (a), the nginx master+worker for (b) and (h), tollgate for (c)-(f), the bare Pingora for (g) and (i), not redis-server or wrk — divided by the requests wrk completed."
echo "Machine CPU µs/req: the whole machine's busy CPU time (/proc/stat: user, nice, system, irq, softirq, steal) during the run — the server, its upstream, wrk and redis-server together — divided by the requests wrk completed; machine busy %: that time over all of the cores' time. A run near 100 % busy is bound by CPU, and its req/s by the machine CPU per request."
echo
# Commands a client sends; the rest (TIME, GET, SET, ZCOUNT...) run inside the scripts, which
# Redis counts in commandstats too. A round trip is one of the former.
redis_round_trips() { # letter what-counted-the-requests
  local n=$1 rt=0 detail="" inner="" key cmd per
  for key in $(printf '%s\n' "${!RCMD[@]}" | { grep "^$n," || true; } | sort); do
    cmd=${key#*,}
    per=$(awk -v a="${RCMD[$key]}" -v q="${RT_REQS[$n]}" 'BEGIN { printf "%.3f", (q > 0 ? a / q : 0) }')
    case $cmd in
      evalsha|eval|evalsha_ro|eval_ro|fcall|script|ping|hello|client|select|auth)
        rt=$((rt + RCMD[$key])); detail+="${cmd} ${RCMD[$key]} (${per}/req), " ;;
      *) inner+="${cmd} ${per}/req, " ;;
    esac
  done
  echo "Redis round trips during the ($n) runs: ${detail%, } for ${RT_REQS[$n]} requests ($2) →" \
    "**$(awk -v a="$rt" -v q="${RT_REQS[$n]}" 'BEGIN { printf "%.3f", (q > 0 ? a / q : 0) }') round trips per request**." \
    "Commands run inside the scripts: ${inner%, }." \
    "Redis CPU (INFO commandstats usec) per request: **$(awk -v a="${RUSEC[$n]}" -v q="${RT_REQS[$n]}" 'BEGIN { printf "%.1f", (q > 0 ? a / q : 0) }') µs**."
  echo
}
has d && redis_round_trips d "served, tollgate_requests_total"
has h && redis_round_trips h "completed by wrk; those in flight at each run's end are charged but not counted"
echo "Redis MEMORY USAGE of a budget key: during load (bench budget, key value): ${BENCH_KEY_SAMPLE:-not caught};" \
  "realistic budget (120 per 1h): ${REAL_KEY_SAMPLE:-n/a}."
echo
echo "tollgate RSS after the runs: memory store $TM_RSS, redis store $TR_RSS."

if [[ -n $SYSCALL_TABLE ]]; then
  echo
  echo "System calls (perf stat tracepoints) and allocations (uprobes on libc's and jemalloc's malloc, calloc, realloc, mallocx, rallocx) per request, one more ${DURATION}s wrk run each, server processes only (nginx: master and worker):"
  echo
  echo "$SYSCALL_TABLE"
fi

if [[ $SCHED == 1 ]]; then
  echo
  echo "What the scheduler did during the rounds (--sched; /proc/PID/task/*/schedstat, all threads): \"ran\" is the share of one CPU each process ran, \"waited\" the share it was runnable but queued behind another process for a CPU, \"switches/s\" how often it was switched in (after sleeping for work, or after being preempted). A server whose ran + waited is near 100 % never ran out of work: its own CPU per request and what preempts it bound its req/s."
  echo
  echo "| configuration | server ran % | server waited % | server switches/s | upstream nginx ran % | waited % | redis-server ran % | waited % | switches/s |"
  echo "|---|---:|---:|---:|---:|---:|---:|---:|---:|"
  for n in "${NAMES[@]}"; do
    row="| ${LABEL[$n]} |"
    for who in server upstream redis; do
      if [[ -z ${SCH[$n,$who]:-} ]]; then row+=" | |"; [[ $who == redis ]] && row+=" |"; continue; fi
      read -r a b c <<<"${SCH[$n,$who]}"
      row+=$(awk -v a="$a" -v b="$b" -v c="$c" -v t="${SCH_NS[$n]}" -v sw="$([[ $who == upstream ]] && echo 0 || echo 1)" \
        'BEGIN { printf " %.1f | %.1f |", 100 * a / t, 100 * b / t; if (sw) printf " %.0f |", c / (t / 1e9) }')
    done
    echo "$row"
  done
fi
