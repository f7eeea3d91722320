#!/usr/bin/env bash
# bench/script_cpu.sh — Redis CPU per admission: `usec_per_call` (INFO commandstats, server
# side) of tollgate's `admit` script (one budget, no caps, no slice: the exact path's hot call)
# beside the plain GCRA script of bench/nginx_gcra.lua (issue 27: admit ≤ 1.5× GCRA).
#
# Starts its own redis-server on a free loopback port (stopped at exit), then ROUNDS
# interleaved rounds of redis-benchmark (N calls, 20 clients, 100,000 random keys) per script,
# as docs/operations.md ("Sizing") measures; prints each round and the medians.
#
# It also measures group commit: one `admit_batch` call carrying BATCH `admit_one` calls (each
# its own random key), reported per admission (usec_per_call / BATCH).
#
# usage: bench/script_cpu.sh [ROUNDS (5)] [N (100000)] [BATCH (8)]
#
# With INSTRUCTIONS=1 it counts instead of timing: redis-server runs under valgrind's
# callgrind, and each figure is the instructions Redis executed inside EVALSHA (the command
# itself, inclusive: what usec_per_call times) per call. A count does not move with what else
# the machine runs, where usec_per_call on a shared VM does by ±30 % from one run to the
# next. Use a small N (5000): valgrind runs Redis ~50× slower. The calls of a batch share one
# plan's limits and cost; DISTINCT=1 gives each call limits and a cost of its own (a batch of
# keys on different plans: each argument string is new). KEEP_CG=1 keeps the dumps
# (in ${TMPDIR:-/tmp}/script_cpu.*, one per script) for callgrind_annotate.
set -euo pipefail
ROUNDS=${1:-5}
N=${2:-100000}
BATCH=${3:-8}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
L=$ROOT/src/store/lua/store
PORT=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
CG=$(mktemp -d "${TMPDIR:-/tmp}/script_cpu.XXXXXX")
if [[ -n ${INSTRUCTIONS:-} ]]; then
  valgrind --tool=callgrind --callgrind-out-file="$CG/cg.out" \
    redis-server --port "$PORT" --bind 127.0.0.1 --save '' --appendonly no --daemonize no \
    >"$CG/valgrind.log" 2>&1 &
else
  redis-server --port "$PORT" --bind 127.0.0.1 --save '' --appendonly no --daemonize no \
    >/dev/null 2>&1 &
fi
RD=$!
trap 'kill "$RD" 2>/dev/null || true; sleep 1; [[ -n ${KEEP_CG:-} ]] || rm -rf "$CG"' EXIT
cli() { redis-cli -p "$PORT" "$@"; }
until cli PING >/dev/null 2>&1; do sleep 0.1; done
U=µs; [[ -n ${INSTRUCTIONS:-} ]] && U=instructions

GCRA=$(awk '/^local SCRIPT = \[\[/ { f = 1; next } /^\]\]/ { f = 0 } f' "$ROOT/bench/nginx_gcra.lua")
# The scripts as script.rs builds them (the admitting ones answer packed: pack.lua).
ADMIT=$(cli SCRIPT LOAD "$(cat "$L/common.lua" "$L/extra.lua" "$L/pack.lua" "$L/admit.lua")")
ONE=$(cli SCRIPT LOAD "$(cat "$L/common.lua" "$L/pack.lua" "$L/admit_one.lua")")
PLAIN=$(cli SCRIPT LOAD "$GCRA")
# admit_batch: admit_one and admit as functions of their KEYS and ARGV.
BATCHED=$(cli SCRIPT LOAD "$(cat "$L/common.lua" "$L/extra.lua" "$L/pack.lua"
  printf 'local function admit_one(KEYS, ARGV)\n'
  cat "$L/admit_one.lua"; printf 'end\nlocal function admit(KEYS, ARGV)\n'; cat "$L/admit.lua"
  printf 'end\n'; cat "$L/admit_batch.lua")")
# One admission's KEYS and ARGV (admit_one's, below), BATCH times, as admit_batch takes them.
ONE_ARGV=(500000 1 60000000 0 1 120000)
batch_keys=() batch_argv=("$BATCH")
for i in $(seq "$BATCH"); do
  batch_keys+=('t{__rand_int__}b' 't{__rand_int__}h' 't{__rand_int__}ax:__rand_int__')
  if [[ -n ${DISTINCT:-} ]]; then
    # each call of the batch under limits of its own: no argument string repeats but the counts
    batch_argv+=(1 3 6 $((500000 + i)) $((1 + i)) $((60000000 + i)) 0 $((1 + i)) $((120000 + i)))
  else
    batch_argv+=(1 3 "${#ONE_ARGV[@]}" "${ONE_ARGV[@]}")
  fi
done

usec_per_call() { # sha numkeys keys-and-args... → one round's usec_per_call (or instructions)
  cli FLUSHALL >/dev/null
  cli CONFIG RESETSTAT >/dev/null
  if [[ -n ${INSTRUCTIONS:-} ]]; then
    callgrind_control -z "$RD" >/dev/null 2>&1
    redis-benchmark -p "$PORT" -n "$N" -c 20 -r 100000 -q EVALSHA "$@" >/dev/null
    local dumps; dumps=$(ls "$CG" | wc -l)
    callgrind_control -d "$RD" >/dev/null 2>&1
    until [[ $(ls "$CG" | wc -l) -gt $dumps ]]; do sleep 0.2; done
    sleep 1 # written by then
    local dump; dump=$(ls -t "$CG"/cg.out.* | head -1)
    callgrind_annotate --inclusive=yes "$dump" 2>/dev/null \
      | awk -v n="$N" '/:evalShaCommand / && !done { gsub(",", "", $1); printf "%.0f", $1 / n; done = 1 }'
    return
  fi
  redis-benchmark -p "$PORT" -n "$N" -c 20 -r 100000 -q EVALSHA "$@" >/dev/null
  cli INFO commandstats | tr -d '\r' | sed -n 's/^cmdstat_evalsha:.*usec_per_call=\([0-9.]*\).*/\1/p'
}
median() { sort -g | awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }

: >"/tmp/script_cpu.$$"
for r in $(seq "$ROUNDS"); do
  # admit: KEYS budget, key leases, route leases (the budget again: none), holds, record;
  # ARGV per_unit rate capacity max_delay floor cost key_cap route_cap lease_id lease_ttl_us
  # slice unspent settle_id grant_id hold_ttl_us, settled units, grant time, record_ms.
  a=$(usec_per_call "$ADMIT" 5 't{__rand_int__}b' 't{__rand_int__}b' 't{__rand_int__}b' \
    't{__rand_int__}h' 't{__rand_int__}ax:__rand_int__' \
    500000 1 60000000 0 0 1 0 0 x 0 0 0 '' '' 0 0 0 120000)
  # admit_one: KEYS budget, holds, record; ARGV per_unit rate capacity max_delay cost record_ms.
  o=$(usec_per_call "$ONE" 3 't{__rand_int__}b' 't{__rand_int__}h' 't{__rand_int__}ax:__rand_int__' \
    "${ONE_ARGV[@]}")
  g=$(usec_per_call "$PLAIN" 1 'ng{__rand_int__}b' 500000 1 60000000 1)
  bc=$(usec_per_call "$BATCHED" "${#batch_keys[@]}" "${batch_keys[@]}" "${batch_argv[@]}")
  b=$(awk -v c="$bc" -v n="$BATCH" 'BEGIN { printf "%.2f", c / n }')
  echo "round $r: admit $a $U, admit_one $o $U, admit_batch of $BATCH $bc $U ($b per admission), gcra $g $U"
  echo "$a $g $o $b" >>"/tmp/script_cpu.$$"
done
a=$(awk '{ print $1 }' "/tmp/script_cpu.$$" | median)
g=$(awk '{ print $2 }' "/tmp/script_cpu.$$" | median)
o=$(awk '{ print $3 }' "/tmp/script_cpu.$$" | median)
b=$(awk '{ print $4 }' "/tmp/script_cpu.$$" | median)
rm -f "/tmp/script_cpu.$$"
awk -v a="$a" -v g="$g" -v o="$o" -v u="$U" 'BEGIN { printf "median: admit %.2f %s, admit_one %.2f %s, gcra %.2f %s per call: %.2f× and %.2f×\n", a, u, o, u, g, u, a / g, o / g }'
awk -v b="$b" -v g="$g" -v n="$BATCH" -v u="$U" 'BEGIN { printf "median: admit_batch of %d, %.2f %s per admission: %.2f× gcra\n", n, b, u, b / g }'
