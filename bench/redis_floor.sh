#!/usr/bin/env bash
# Redis's own CPU per decision for the batch script and for cheaper scripts of the same shape
# (docs/benchmarks.md, "The floor of Redis's share"), without the gateway: redis-benchmark
# sends EVALSHA of batches of BATCH token-bucket decisions, each on a random one of 10 000
# keys, from 4 connections. Per script: Redis's CPU from /proc and its time inside EVALSHA
# from INFO commandstats, per decision. Rounds interleave the scripts; medians at the end.
#
#   bench/redis_floor.sh [CALLS_PER_CELL] [ROUNDS]     (defaults 20000 and 3; BATCH=8)
#
# Scripts: batch (the gateway's lua/batch.lua, as the gateway loads it) and each layout of
# bench/floor/ (its `bucket`, inside bench/floor/loop.lua's batch; the arithmetic skipped:
# what the Redis commands of each bucket layout cost on their own).
set -euo pipefail
cd "$(dirname "$0")/.."
calls=${1:-20000}
rounds=${2:-3}
batch=${BATCH:-8}
command -v redis-benchmark >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server redis-tools >/dev/null; }
. bench/lib.sh
port=$(free_port)
work=$(mktemp -d /tmp/sentinel-floor.XXXXXX)
redis-server --port "$port" --bind 127.0.0.1 --save "" --appendonly no >"$work/redis.log" 2>&1 &
redis_pid=$!
trap 'kill "$redis_pid" 2>/dev/null || true; wait 2>/dev/null || true' EXIT
for _ in $(seq 1 100); do redis-cli -p "$port" ping >/dev/null 2>&1 && break; sleep 0.05; done
cat lua/int.lua lua/limits.lua lua/batch.lua >"$work/batch.lua"
names=(batch)
for f in bench/floor/*.lua; do
  n=$(basename "$f" .lua)
  [[ $n == loop ]] && continue
  cat "$f" bench/floor/loop.lua >"$work/$n.lua"
  names+=("$n")
done
big=1000000000000000 fast=1000000000000
# Keys of the gateway's shape and length (a SHA-256 in hex, redis-benchmark's 12 random
# digits at its end); one limit, named by every decision (lua/batch.lua's arguments), each
# after its deadline: sixteen digits, as the gateway sends them, and far enough ahead that
# every decision is made.
keys=() args=(1 1 "$big" "$fast" 1000000)
for i in $(seq 1 "$batch"); do
  keys+=("sentinel:v1:$(printf '%052d' "$i")__rand_int__:bench.allowed:1")
  args+=(9000000000000000 1)
done
: >"$work/results"
for round in $(seq 1 "$rounds"); do
  for n in "${names[@]}"; do
    sha=$(redis-cli -p "$port" script load "$(cat "$work/$n.lua")")
    [[ $sha =~ ^[0-9a-f]{40}$ ]] || { echo "$n.lua does not load: $sha" >&2; exit 1; }
    redis-cli -p "$port" flushall >/dev/null
    redis-cli -p "$port" config resetstat >/dev/null
    t0=$(ticks "$redis_pid")
    timeout 300 redis-benchmark -p "$port" -n "$calls" -c 4 -r 10000 -q evalsha "$sha" "$batch" "${keys[@]}" "${args[@]}" >/dev/null
    t1=$(ticks "$redis_pid")
    usec=$(redis-cli -p "$port" info commandstats | tr -d '\r' | sed -n 's/^cmdstat_evalsha:.*usec_per_call=\([0-9.]*\).*/\1/p')
    awk -v n="$n" -v t=$((t1 - t0)) -v hz="$hz" -v calls="$calls" -v b="$batch" -v u="${usec:-0}" \
      'BEGIN { printf "%s %.2f %.2f\n", n, t * 1e6 / hz / calls / b, u / b }' >>"$work/results"
  done
done
python3 - "$work/results" "$batch" <<'PY'
import sys, statistics
rows = [l.split() for l in open(sys.argv[1])]
print(f"per decision, batches of {sys.argv[2]}: median (rounds)")
print(f"{'script':12s} {'Redis CPU us':>14s}   {'inside EVALSHA us':>18s}")
for name in dict.fromkeys(r[0] for r in rows):
    cpu = [float(r[1]) for r in rows if r[0] == name]
    inside = [float(r[2]) for r in rows if r[0] == name]
    print(f"{name:12s} {statistics.median(cpu):8.2f} ({' '.join(f'{v:.1f}' for v in cpu)})   "
          f"{statistics.median(inside):8.2f} ({' '.join(f'{v:.1f}' for v in inside)})")
PY
