#!/usr/bin/env bash
# What the access log costs, measured on one gateway that turns it on and off by reload, so no
# cell pays for a process of its own starting (on two shared cores, the order in which fresh
# processes ran moved results more than the access log does).
#
#   bench/access_log.sh [SECONDS_PER_CELL] [ROUNDS]      (defaults 6 and 8)
#   LOG_PATH=/dev/null bench/access_log.sh                (the lines without the disk's work)
#
# Upstream nginx `return 200` (one worker), the gateway with 2 workers and `algorithm = "none"`,
# wrk with 64 connections. Each round runs the two cells in ABBA order (off on on off, then on
# off off on in the next round...), and reports per cell requests/s and the gateway's CPU per
# request (from /proc, every thread, the access log's writer included); then the medians over
# rounds of on/off throughput and CPU per request. Installs wrk and nginx if missing.
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-6}
rounds=${2:-8}
work=$(mktemp -d /tmp/sentinel-access.XXXXXX)
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

need=()
command -v wrk >/dev/null || need+=(wrk)
command -v nginx >/dev/null || need+=(nginx)
if ((${#need[@]})); then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null; fi
cargo build --release --locked --bin sentinel-gateway

. bench/lib.sh

upstream_200 "$work/upstream"

port=$(free_port)
admin=$(free_port)
config() { # with_log
  cat >"$work/gateway.toml" <<TOML
[server]
listen = "127.0.0.1:$port"
admin_listen = "127.0.0.1:$admin"
threads = 2
[redis]
url = "redis://127.0.0.1:1/0"
require_noeviction = false
[upstreams.app]
addrs = ["127.0.0.1:$up_port"]
[[routes]]
endpoint_id = "bench.none"
path_prefix = "/"
upstream = "app"
algorithm = "none"
TOML
  if [[ $1 == on ]]; then printf '[access_log]\npath = "%s"\n' "${LOG_PATH:-$work/access.log}" >>"$work/gateway.toml"; fi
}
config off
RUST_LOG=error target/release/sentinel-gateway --config "$work/gateway.toml" >"$work/gateway.log" 2>&1 &
gw=$!
pids+=($gw)
wait_port "$port"

cell() { # round mode
  config "$2"
  curl -s -o /dev/null -X POST "http://127.0.0.1:$admin/reload"
  wrk -t2 -c64 -d1s "http://127.0.0.1:$port/x" >/dev/null 2>&1 # settle after the reload
  local t0 t1 out reqs
  t0=$(ticks "$gw")
  out=$(wrk -t2 -c64 -d"${secs}s" "http://127.0.0.1:$port/x" 2>&1)
  t1=$(ticks "$gw")
  reqs=$(awk '/requests in/{print $1}' <<<"$out")
  rm -f "$work/access.log"
  python3 -c "print($1, '$2', round($reqs / $secs), round(($t1 - $t0) * 1e6 / $hz / $reqs, 2))"
}

{
  echo "round log req/s cpu_us_per_req"
  for round in $(seq 1 "$rounds"); do
    if ((round % 2)); then order="off on on off"; else order="on off off on"; fi
    for mode in $order; do cell "$round" "$mode"; done
  done
} | tee "$work/cells.txt"
python3 - "$work/cells.txt" <<'PY'
import statistics, sys
rows = [l.split() for l in open(sys.argv[1]).read().splitlines()[1:]]
by = {}
for r, mode, rps, cpu in rows:
    by.setdefault(r, {}).setdefault(mode, []).append((float(rps), float(cpu)))
thr, cpu = [], []
for r, m in sorted(by.items(), key=lambda kv: int(kv[0])):
    on = [x for x in m["on"]]; off = [x for x in m["off"]]
    thr.append(sum(a for a, _ in on) / sum(a for a, _ in off))
    cpu.append((sum(b for _, b in on) / len(on)) / (sum(b for _, b in off) / len(off)))
print(f"on/off throughput   median {statistics.median(thr):.3f}   rounds " + " ".join(f"{x:.3f}" for x in thr))
print(f"on/off CPU/request  median {statistics.median(cpu):.3f}   rounds " + " ".join(f"{x:.3f}" for x in cpu))
PY
