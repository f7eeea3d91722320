# bench/fleet_lib.sh — sourced by bench/queue.sh and bench/jobs.sh: one redis-server, the
# sample API (through `tollgate demo`, whose own gateway is not used) and one tollgate
# (release build, threads 1, RUST_LOG=warn) on Redis, on free loopback ports in a temp dir,
# all stopped at exit.
#
# The caller sets NAME (its log prefix), USAGE (its usage line), TOOLS (the commands it
# needs) and TARGET (the tollgate binary), sources this, calls `fleet_prepare "$@"` (its
# options: --no-build, -h), then `start_fleet ENDPOINT_YAML`; it then has REDIS_PORT,
# UP_PORT, GW_PORT, ADMIN_PORT, TMP, and `log`, `free_port`, `wait_up`.

fleet_prepare() {
  local build=1 a tool
  for a in "$@"; do
    case $a in
      --no-build) build=0 ;;
      -h|--help) echo "$USAGE"; exit 0 ;;
      *) echo "$USAGE" >&2; exit 2 ;;
    esac
  done
  for tool in "${TOOLS[@]}"; do
    command -v "$tool" >/dev/null || { echo "bench/$NAME.sh needs $tool" >&2; exit 1; }
  done
  if [[ $build == 1 ]]; then cargo build --release --bin tollgate; fi
  ulimit -n 65536 2>/dev/null || ulimit -n "$(ulimit -Hn)"
}

log() { echo "[$NAME-bench] $*" >&2; }
TMP=$(mktemp -d "${TMPDIR:-/tmp}/tollgate-$NAME-bench.XXXXXX")
PIDS=()
cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  local pid
  for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
  done
  rm -rf "$TMP"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}
wait_up() {  # url
  for _ in $(seq 100); do
    curl -s -o /dev/null "$1" && return 0
    sleep 0.1
  done
  echo "$1 never answered" >&2
  return 1
}

# Starts Redis, the sample API and the gateway, whose `rate_limits.endpoints` are $1 (YAML,
# indented by four spaces), and waits until they answer.
start_fleet() {
  REDIS_PORT=$(free_port)
  redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save '' --appendonly no \
    --dir "$TMP" >"$TMP/redis.log" 2>&1 &
  PIDS+=($!)
  UP_PORT=$(free_port)
  local demo_port demo_admin
  demo_port=$(free_port)
  demo_admin=$(free_port)
  "$TARGET" demo --listen "127.0.0.1:$demo_port" --admin-listen "127.0.0.1:$demo_admin" \
    --upstream-listen "127.0.0.1:$UP_PORT" >"$TMP/demo.log" 2>&1 &
  PIDS+=($!)
  GW_PORT=$(free_port)
  ADMIN_PORT=$(free_port)
  cat >"$TMP/gateway.yaml" <<YAML
server:
  listen: "127.0.0.1:$GW_PORT"
  admin_listen: "127.0.0.1:$ADMIN_PORT"
  threads: 1
upstream:
  url: "http://127.0.0.1:$UP_PORT"
store:
  backend: redis
  url: "redis://127.0.0.1:$REDIS_PORT/0"
  on_error: deny
rate_limits:
  default: {cost: 1, window: 60s, max_cost: 100000000}
  endpoints:
$1
YAML
  RUST_LOG=warn "$TARGET" run -c "$TMP/gateway.yaml" >"$TMP/gateway.log" 2>&1 &
  PIDS+=($!)
  wait_up "http://127.0.0.1:$UP_PORT/items/1"
  wait_up "http://127.0.0.1:$ADMIN_PORT/readyz"
}
