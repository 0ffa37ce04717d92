#!/usr/bin/env bash
# The breaker at 256 connections (target T5): the limited route of bench/speed.sh's cell 3,
# started on an empty Redis each cell (FLUSHALL: every first decision of an identity creates
# its key), with one `[redis]` field set to each of several values, interleaved in rounds.
#
#   bench/burst.sh [SECONDS_PER_CELL] [ROUNDS]                 (defaults 8 and 5)
#   FIELD=batch_max VALUES="256 64 16" bench/burst.sh          (the default)
#   BIN=target/release/sentinel-gateway bench/burst.sh         (default: the production build;
#                                                               nothing is built here)
#
# Per cell: requests/s, answers other than 2xx, breaker transitions and when the breaker first
# opened (seconds after the load began), decisions, those slower
# than 5, 10.24, 15 and 20 ms (sentinel_decision_duration_seconds), the gateway's and Redis's CPU
# per request, and the share of the machine's time the hypervisor took (steal, /proc/stat).
# Upstream nginx `return 200` (one worker), the gateway with 2 workers, wrk 2 threads with
# bench/keys.lua (10 000 API keys). Every process is stopped by its PID.
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-8}
rounds=${2:-5}
field=${FIELD:-batch_max}
values=${VALUES:-256 64 16}
bin=${BIN:-target/production/sentinel-gateway}
[[ -x $bin ]] || { echo "no gateway at $bin: cargo build --profile production" >&2; exit 2; }
work=$(mktemp -d /tmp/sentinel-burst.XXXXXX)
pids=()
cleanup() {
  for f in "$work"/*.pid "$work"/*/*.pid; do [[ -f $f ]] && kill "$(cat "$f" 2>/dev/null)" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap cleanup EXIT
. bench/lib.sh
steal() { awk '/^cpu / {print $9, $2 + $3 + $4 + $5 + $6 + $7 + $8 + $9}' /proc/stat; }

redis_port=$(free_port)
redis-server --port "$redis_port" --bind 127.0.0.1 --save "" --appendonly no >"$work/redis.log" 2>&1 &
echo $! >"$work/redis.pid"
wait_port "$redis_port"
redis_pid=$(cat "$work/redis.pid")
upstream_200 "$work/upstream"
big=1000000000000000 fast=1000000000000

echo "round $field req/s non2xx transitions opened_at_s decisions >5ms >10.24ms >15ms >20ms gw_us redis_us steal%"
for round in $(seq 1 "$rounds"); do
  for v in $values; do
    redis-cli -p "$redis_port" flushall >/dev/null
    port=$(free_port) admin=$(free_port)
    cat >"$work/gw.toml" <<TOML
[server]
listen = "127.0.0.1:$port"
admin_listen = "127.0.0.1:$admin"
threads = 2
[redis]
url = "redis://127.0.0.1:$redis_port/0"
require_noeviction = false
$field = $v
[upstreams.app]
addrs = ["127.0.0.1:$up_port"]
[[routes]]
endpoint_id = "bench.allowed"
path = "/allowed"
upstream = "app"
identity = { header = "X-API-Key" }
algorithm = "token_bucket"
capacity_micro = $big
refill_rate_micro_per_sec = $fast
TOML
    RUST_LOG=warn "$bin" --config "$work/gw.toml" >"$work/gw.$round.$v.log" 2>&1 &
    echo $! >"$work/gw.pid"
    gw=$!
    wait_port "$port"
    curl -s -o /dev/null -H 'X-API-Key: warm' "http://127.0.0.1:$port/allowed"
    bp=$(ticks "$gw") br=$(ticks "$redis_pid")
    read -r s0 t0 < <(steal)
    started=$(date +%s.%N)
    out=$(wrk -t2 -c256 -d"${secs}s" -s bench/keys.lua "http://127.0.0.1:$port/allowed" 2>&1)
    read -r s1 t1 < <(steal)
    ap=$(ticks "$gw") ar=$(ticks "$redis_pid")
    metrics=$(curl -s "http://127.0.0.1:$admin/metrics")
    kill "$gw"
    wait "$gw" 2>/dev/null || true
    rm -f "$work/gw.pid"
    # When the breaker first opened, in seconds from the start of the load; - when it did not.
    opened=$(grep -m1 '"to":"open"' "$work/gw.$round.$v.log" | sed 's/.*"timestamp":"\([^"]*\)".*/\1/' || true)
    trip=-
    [[ -n $opened ]] && trip=$(awk -v a="$(date -d "$opened" +%s.%N)" -v b="$started" 'BEGIN { printf "%.2f", a - b }')
    total=$(awk '/requests in/ {print $1}' <<<"$out")
    [[ -n $total && $total != 0 ]] || { echo "wrk reported no requests:" >&2; echo "$out" >&2; exit 1; }
    rps=$(awk '/Requests\/sec/ {printf "%d", $2}' <<<"$out")
    bad=$(awk '/Non-2xx/ {print $5}' <<<"$out")
    awk -v r="$round" -v v="$v" -v rps="$rps" -v bad="${bad:-0}" -v total="$total" -v pt=$((ap - bp)) \
      -v rt=$((ar - br)) -v hz="$hz" -v steal=$(((s1 - s0) * 1000 / (t1 - t0 + 1))) -v trip="$trip" '
      /^sentinel_breaker_transitions_total/ { tr += $2 }
      /^sentinel_decision_duration_seconds_bucket/ {
        match($0, /le="[^"]*"/); le = substr($0, RSTART + 4, RLENGTH - 5)
        if (le == "0.005") b5 += $2; if (le == "0.01024") b10 += $2
        if (le == "0.015") b15 += $2; if (le == "0.02") b20 += $2; if (le == "+Inf") all += $2
      }
      END { us = 1e6 / hz / total
        printf "%s %s %s %s %d %s %d %d %d %d %d %.1f %.1f %.1f\n", r, v, rps, bad, tr, trip, all,
          all - b5, all - b10, all - b15, all - b20, pt * us, rt * us, steal / 10 }' <<<"$metrics"
  done
done
echo "gateway logs: $work"
