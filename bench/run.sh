#!/usr/bin/env bash
# Load-test sentinel-gateway with oha, side by side with nginx, on loopback only.
#
#   bench/run.sh [SECONDS_PER_CELL] [ROUNDS]      (defaults 5 and 3)
#   CELLS="2 2l 2t" CONNS=64 bench/run.sh 5 3      (only these cells, at these connection counts)
#
# Installs what it lacks (oha through cargo, nginx and redis-server through apt), builds in
# release, starts every process on 127.0.0.1, runs each cell for a fixed time at 64 and 256
# connections, stops everything by PID, and prints one table. Every gateway cell gets a
# gateway of its own, started for it and stopped after it, so a breaker one cell opens cannot
# leak into the next. The whole sequence runs ROUNDS times: the table shows each cell's median
# round, and its throughput ratio to cell 2 (the gateway without a limiter) of the same round
# and connection count as the median and the range over the rounds.
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-5}
rounds=${2:-3}
cells_wanted=${CELLS:-}
conns_wanted=${CONNS:-64 256}
work=$(mktemp -d /tmp/sentinel-bench.XXXXXX)
pids=()
cleanup() {
  for f in "$work"/*.pid; do [[ -f $f ]] && kill "$(cat "$f")" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap cleanup EXIT

command -v oha >/dev/null || cargo install --locked oha
need=()
command -v nginx >/dev/null || need+=(nginx)
command -v redis-server >/dev/null || need+=(redis-server redis-tools)
if ((${#need[@]})); then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null; fi
cargo build --release --locked --bins

. bench/lib.sh
bg() { "$@" >"$work/$(basename "$1").$RANDOM.log" 2>&1 & pids+=($!); }

redis_port=$(free_port); up_port=$(free_port); hole_port=$(free_port); dead_port=$(free_port)
bg redis-server --port "$redis_port" --bind 127.0.0.1 --save "" --appendonly no
# A second Redis, black-holed during cell 6 with CLIENT PAUSE: connected, answering nothing.
bg redis-server --port "$hole_port" --bind 127.0.0.1 --save "" --appendonly no
bg target/release/demo-upstream "127.0.0.1:$up_port" bench
wait_port "$redis_port"; wait_port "$up_port"; wait_port "$hole_port"

limited() { # endpoint_id path capacity_micro refill_micro [extra line] -> a token-bucket route
  printf '[[routes]]\nendpoint_id = "%s"\npath = "%s"\nupstream = "app"\nidentity = { header = "X-API-Key" }\nalgorithm = "token_bucket"\ncapacity_micro = %s\nrefill_rate_micro_per_sec = %s\n%b\n' "$@"
}
gateway() { # name redis_port failure_threshold [dedicated_io_thread] [extra toml] -> prints the proxy port
  local name=$1 rport=$2 threshold=$3 dedicated=${4:-true} extra=${5:-} port admin big=1_000_000_000_000_000 fast=1_000_000_000_000
  port=$(free_port); admin=$(free_port)
  {
    cat <<TOML
[server]
listen = "127.0.0.1:$port"
admin_listen = "127.0.0.1:$admin"
threads = 2
[redis]
url = "redis://127.0.0.1:$rport/0"
require_noeviction = false
dedicated_io_thread = $dedicated
[breaker]
failure_threshold = $threshold
open_seconds = 3600
[upstreams.app]
addrs = ["127.0.0.1:$up_port"]
[[routes]]
endpoint_id = "bench.none"
path = "/none"
upstream = "app"
algorithm = "none"
TOML
    limited bench.allowed /allowed "$big" "$fast" ""
    limited bench.hot /hot 1_000_000 1_000_000 ""
    limited bench.open /fail-open "$big" "$fast" 'fail_mode = "fail_open"\nfallback_rate_per_process_micro = 1_000_000_000_000'
    limited bench.closed /fail-closed "$big" "$fast" 'fail_mode = "fail_closed"'
    printf '%b\n' "$extra"
  } >"$work/$name.toml"
  RUST_LOG=error target/release/sentinel-gateway --config "$work/$name.toml" >"$work/$name.log" 2>&1 &
  echo $! >"$work/$name.pid"
  wait_port "$port"
  echo "$port"
}
stop_gateway() { kill "$(cat "$work/$1.pid")" 2>/dev/null || true; wait "$(cat "$work/$1.pid")" 2>/dev/null || true; }

nginx_port=$(free_port)
mkdir -p "$work/nginx"
cat >"$work/nginx/nginx.conf" <<NGINX
worker_processes 2;
pid $work/nginx/nginx.pid;
error_log $work/nginx/error.log crit;
events { worker_connections 4096; }
http {
  access_log off;
  limit_req_zone \$http_x_api_key zone=keys:10m rate=1000000r/s;
  limit_req_status 429;
  upstream app { server 127.0.0.1:$up_port; keepalive 64; }
  server {
    listen 127.0.0.1:$nginx_port;
    location / {
      limit_req zone=keys burst=1000000 nodelay;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_pass http://app;
    }
  }
}
NGINX
bg nginx -c "$work/nginx/nginx.conf" -g 'daemon off;'
wait_port "$nginx_port"

evalsha() { redis-cli -p "$redis_port" info commandstats | sed -n 's/^cmdstat_evalsha:calls=\([0-9]*\),.*/\1/p' | tr -d '\r' | grep . || echo 0; }

run() { # round cell label target path conns [oha args]; target: a port, or healthy/workers/dead/hole/logged/tls for a fresh gateway
  local round=$1 cell=$2 label=$3 target=$4 path=$5 conns=$6 port before after
  shift 6
  if [[ -n $cells_wanted && " $cells_wanted " != *" $cell "* ]]; then return 0; fi
  local scheme=http
  case $target in
    healthy) port=$(gateway healthy "$redis_port" 5) ;;
    logged)
      # The access log on: one JSON line per request to a file.
      port=$(gateway logged "$redis_port" 5 false "[access_log]\npath = \"$work/access.log\"") ;;
    tls)
      # A TLS listener (the demo certificate for 127.0.0.1); oha does not verify it.
      local tls_port
      tls_port=$(free_port)
      gateway tls "$redis_port" 5 false "[[server.tls]]\nlisten = \"127.0.0.1:$tls_port\"\ncert_path = \"$PWD/examples/tls/default.pem\"\nkey_path = \"$PWD/examples/tls/default.key\"" >/dev/null
      wait_port "$tls_port"
      port=$tls_port scheme=https ;;
    workers) port=$(gateway workers "$redis_port" 5 false) ;;
    dead)
      port=$(gateway dead "$dead_port" 5)
      # Open its breaker: its Redis is dead, five failures.
      for _ in 1 2 3 4 5 6; do curl -s -o /dev/null -H 'X-API-Key: bench' "http://127.0.0.1:$port/fail-closed"; done ;;
    hole)
      port=$(gateway hole "$hole_port" 1000000)
      # Let the gateway connect, then black-hole its Redis for the whole cell.
      curl -s -o /dev/null -H 'X-API-Key: warm' "http://127.0.0.1:$port$path"
      sleep 0.2
      redis-cli -p "$hole_port" client pause $(((secs + 3) * 1000)) all >/dev/null ;;
    *) port=$target ;;
  esac
  [[ $target == healthy || $target == workers || $target == logged ]] && curl -s -o /dev/null -H 'X-API-Key: warm' "http://127.0.0.1:$port$path" && sleep 0.2
  before=$(evalsha)
  oha -z "${secs}s" -c "$conns" "$@" --insecure --no-tui --output-format json -H 'X-API-Key: bench' "$scheme://127.0.0.1:$port$path" >"$work/cell-$round-$cell-$conns.json"
  after=$(evalsha)
  case $target in healthy | workers | dead | hole | logged | tls) stop_gateway "$target" ;; esac
  if [[ $target == hole ]]; then redis-cli -p "$hole_port" client unpause >/dev/null; fi
  echo "$round|$cell|$label|$conns|$((after - before))" >>"$work/cells"
}
for round in $(seq 1 "$rounds"); do
  for conns in $conns_wanted; do
    run "$round" 1 "demo upstream directly" "$up_port" /none "$conns"
    run "$round" 2 "gateway, algorithm none" healthy /none "$conns"
    run "$round" 2l "gateway, none, access log on" logged /none "$conns"
    run "$round" 2t "gateway, none, over TLS (HTTP/1.1)" tls /none "$conns"
    run "$round" 3 "gateway, token bucket, all allowed" healthy /allowed "$conns"
    run "$round" 3w "gateway, token bucket, io on the workers" workers /allowed "$conns"
    run "$round" 4 "gateway, hot identity over limit" healthy /hot "$conns"
    run "$round" 5a "gateway, breaker open, fail_open" dead /fail-open "$conns"
    run "$round" 5b "gateway, breaker open, fail_closed" dead /fail-closed "$conns"
    run "$round" 6 "gateway, Redis black-holed (budget)" hole /fail-open "$conns"
    # The same outage with requests arriving at a steady pace (half cell 6's rate, so that the
    # connections are not all held at once; latency counted from each request's scheduled
    # start). In cell 6 every connection's request is released on the same millisecond tick,
    # and its tail is the time it takes to forward that whole wave.
    rate=1
    [[ -z $cells_wanted || " $cells_wanted " == *" 6q "* ]] &&
    rate=$(python3 -c 'import json,sys; print(max(1, int(json.load(open(sys.argv[1]))["summary"]["requestsPerSec"]) // 2))' "$work/cell-$round-6-$conns.json")
    run "$round" 6q "gateway, black-holed, steady arrivals" hole /fail-open "$conns" -q "$rate" --latency-correction
    run "$round" 7 "nginx proxy_pass + limit_req" "$nginx_port" /none "$conns"
  done
done

python3 - "$work" <<'PY'
import json, sys, os, statistics
work = sys.argv[1]
rows = [l.strip().split("|") for l in open(os.path.join(work, "cells"))]
data = {}  # (cell, conns) -> {round: (...)}
labels = {}
for rnd, cell, label, conns, calls in rows:
    d = json.load(open(os.path.join(work, f"cell-{rnd}-{cell}-{conns}.json")))
    codes = d.get("statusCodeDistribution", {})
    n = sum(codes.values())
    labels[(cell, conns)] = label
    data.setdefault((cell, conns), {})[rnd] = (d["summary"]["requestsPerSec"], d["latencyPercentiles"], codes, int(calls), n)
print(f"{'cell':<5}{'conns':>6}  {'what':<38}{'req/s':>10}{'ratio':>7}{'range':>12}{'p50 ms':>9}{'p99 ms':>9}{'p99.9 ms':>10}  {'statuses':<28}{'redis/req':>9}")
for (cell, conns), by_round in data.items():
    ratios = sorted(
        r[0] / data[("2", conns)][rnd][0]
        for rnd, r in by_round.items()
        if ("2", conns) in data and rnd in data[("2", conns)]
    )
    # The median round by throughput (the lower middle one for an even count).
    ordered = sorted(by_round.values(), key=lambda r: r[0])
    rps, p, codes, calls, n = ordered[(len(ordered) - 1) // 2]
    ms = lambda k: (p.get(k) or 0) * 1000
    st = " ".join(f"{k}:{v}" for k, v in sorted(codes.items()))
    per = f"{calls / n:.3f}" if n else "-"
    ratio = f"{statistics.median(ratios):.2f}" if ratios else "-"
    spread = f"{ratios[0]:.2f}-{ratios[-1]:.2f}" if ratios else "-"
    print(f"{cell:<5}{conns:>6}  {labels[(cell, conns)]:<38}{rps:>10.0f}{ratio:>7}{spread:>12}{ms('p50'):>9.2f}{ms('p99'):>9.2f}{ms('p99.9'):>10.2f}  {st:<28}{per:>9}")
PY
