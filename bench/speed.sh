#!/usr/bin/env bash
# The gateway's speed beside its peers, on loopback only (docs/benchmarks.md, "Speed").
#
#   bench/speed.sh [SECONDS_PER_CELL] [ROUNDS]        (defaults 8 and 3)
#   CELLS="n o 2 3" CONNS="64" bench/speed.sh 8 5      (only these cells, these connection counts)
#   REDIS_NICE=-10 bench/speed.sh                       (Redis at a higher priority than the rest)
#   PROFILE=release bench/speed.sh                      (the release build: quicker to make, ~7 % slower)
#   GW_LOG=info bench/speed.sh                          (the gateways' RUST_LOG; default warn)
#   BIN_DIR=target/pgo/x86_64-unknown-linux-gnu/production bench/speed.sh
#                                                       (the gateway and the bare proxy built
#                                                        elsewhere, by scripts/pgo.sh say; no build)
#
# Each gateway's log and each cell's Redis SLOWLOG are kept in the work directory it prints
# at the end (gw<cell>.<round>.<conns>.log, slowlog.<cell>.<round>.<conns>).
#
# Every proxy gets 2 workers; the upstream is nginx `return 200` with one worker; the load is
# wrk (2 threads) with bench/keys.lua, which cycles 10 000 API keys. Cells, in each round in
# this order (interleaved: every round runs every cell once):
#
#   n   nginx proxy_pass
#   o   nginx + Lua + Redis: the gateway's own token-bucket script through EVALSHA, keyed by
#       the same header (lua-nginx-redis, OpenResty style)
#   b   a bare Pingora proxy (bench/bare_proxy.rs: upstream_peer only, default settings)
#   2   the gateway, algorithm = "none"
#   2l  the same with the access log on ([access_log] path, a file)
#   3   the gateway, Redis token bucket, every request allowed, the default config
#   3w  the same with [redis] dedicated_io_thread = false
#   2a, 3a  cells 2 and 3 with another build of the gateway, ALT_BIN=path/to/sentinel-gateway
#       (an interleaved A/B of two builds: CELLS="2 2a 3 3a" ALT_BIN=/tmp/old bench/speed.sh)
#   2r  cell 2 while Redis does cell 3's work of the same round for another client
#       (bench/redis_load.py: the batch script at cell 3's rate and batch size), so that
#       3 - 2r is what the limiter costs the gateway apart from Redis running beside it
#
# For each cell: requests/s, wrk's p50/p99, answers other than 2xx, and CPU per request read
# from /proc over the cell: of the proxy, of Redis (and Redis's own time in EVALSHA from INFO
# commandstats), of wrk. Then, per round, the ratios the targets are stated in, and their
# medians. Installs what it lacks (apt: wrk, nginx-extras, lua-nginx-redis, redis-server),
# builds with the production profile, stops everything by PID.
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-8}
rounds=${2:-3}
cells_wanted=${CELLS:-n o b 2 2l 3 3w}
conns_wanted=${CONNS:-64 256}
work=$(mktemp -d /tmp/sentinel-speed.XXXXXX)
pids=()
cleanup() {
  for f in "$work"/*.pid "$work"/*/*.pid; do [[ -f $f ]] && kill "$(cat "$f" 2>/dev/null)" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap cleanup EXIT

need=()
command -v wrk >/dev/null || need+=(wrk)
[[ -f /usr/share/nginx/modules/ngx_http_lua_module.so ]] || need+=(nginx-extras)
[[ -f /usr/share/lua/5.1/nginx/redis.lua ]] || need+=(lua-nginx-redis)
command -v redis-server >/dev/null || need+=(redis-server redis-tools)
if ((${#need[@]})); then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null; fi
# The profile operators deploy (Cargo.toml, [profile.production]), for the bare proxy too.
profile=${PROFILE:-production}
if [[ -n ${BIN_DIR:-} ]]; then
  bin=$BIN_DIR
else
  cargo build --profile "$profile" --locked --bins
  bin=target/$profile
fi

. bench/lib.sh
# CPU ticks (utime + stime) of a process and its children's threads, by PID.

redis_port=$(free_port)
redis-server --port "$redis_port" --bind 127.0.0.1 --save "" --appendonly no >"$work/redis.log" 2>&1 &
echo $! >"$work/redis.pid"
wait_port "$redis_port"
redis_pid=$(cat "$work/redis.pid")
# REDIS_NICE=-10: Redis runs at that priority, as if it had a machine of its own (on two shared
# cores, 256 connections can starve it for 20 ms at a time; both cells o and 3 share it).
[[ -n ${REDIS_NICE:-} ]] && renice -n "$REDIS_NICE" -p "$redis_pid" >/dev/null
# Anything that holds Redis for 5 ms or more is recorded, and printed at the end.
redis-cli -p "$redis_port" config set latency-monitor-threshold 5 >/dev/null
# SLOWLOG counts the commands that took Redis 2 ms or more of wall time in each cell: on a
# shared machine, mostly a Redis taken off the CPU in the middle of one (column slow2ms).
redis-cli -p "$redis_port" config set slowlog-log-slower-than 2000 >/dev/null
redis-cli -p "$redis_port" config set slowlog-max-len 100000 >/dev/null

nginx_conf() { # dir workers body -> starts nginx with that http body
  local dir=$1 workers=$2 body=$3
  mkdir -p "$dir"
  cat >"$dir/nginx.conf" <<NGINX
load_module /usr/share/nginx/modules/ndk_http_module.so;
load_module /usr/share/nginx/modules/ngx_http_lua_module.so;
worker_processes $workers;
pid $dir/nginx.pid;
error_log $dir/error.log error;
events { worker_connections 8192; }
http {
  access_log off;
  keepalive_requests 1000000;
$body
}
NGINX
  nginx -c "$dir/nginx.conf" -g 'daemon off;' >"$dir/stdout.log" 2>&1 &
  pids+=($!)
  echo $! >"$dir/master.pid"
}
# The PIDs of an nginx's master and workers.
nginx_pids() { local master; master=$(cat "$1/master.pid"); echo "$master $(pgrep -P "$master" | tr '\n' ' ')"; }

upstream_200 "$work/upstream"

# The gateway's own token-bucket script, for the OpenResty cell: the same work in Redis.
cat lua/int.lua lua/limits.lua lua/token_bucket.lua >"$work/token_bucket.lua"
cat lua/int.lua lua/limits.lua lua/batch.lua >"$work/batch.lua"
big=1000000000000000 fast=1000000000000
n_port=$(free_port)
nginx_conf "$work/nginx" 2 "  upstream app { server 127.0.0.1:$up_port; keepalive 64; keepalive_requests 1000000; }
  server { listen 127.0.0.1:$n_port;
    location / { proxy_http_version 1.1; proxy_set_header Connection \"\"; proxy_pass http://app; } }"
o_port=$(free_port)
nginx_conf "$work/openresty" 2 "  lua_package_path '/usr/share/lua/5.1/?.lua;;';
  init_by_lua_block { local f = io.open('$work/token_bucket.lua'); BODY = f:read('*a'); f:close() }
  upstream app { server 127.0.0.1:$up_port; keepalive 64; keepalive_requests 1000000; }
  server { listen 127.0.0.1:$o_port;
    location / {
      access_by_lua_block {
        local red = require('nginx.redis'):new()
        red:set_timeout(20)
        local ok = red:connect('127.0.0.1', $redis_port)
        if not ok then return ngx.exit(503) end
        local key = 'or:v1:' .. (ngx.var.http_x_api_key or '') .. ':bench.or:1'
        local res, err = red:evalsha(SHA or '-', 1, key, $big, $fast, 1000000)
        if not res and err and err:find('NOSCRIPT', 1, true) then
          SHA = red:script('load', BODY)
          res, err = red:evalsha(SHA, 1, key, $big, $fast, 1000000)
        end
        red:set_keepalive(60000, 256)
        if not res then return ngx.exit(503) end
        if res:sub(1, 1) ~= '1' then return ngx.exit(429) end
      }
      proxy_http_version 1.1; proxy_set_header Connection \"\"; proxy_pass http://app; } }"
wait_port "$n_port"; wait_port "$o_port"
curl -sf -o /dev/null -H 'X-API-Key: warm' "http://127.0.0.1:$o_port/" || { echo "the OpenResty cell does not answer:" >&2; cat "$work/openresty/error.log" >&2; exit 1; }

b_port=$(free_port)
"$bin/bare-proxy" "127.0.0.1:$b_port" "127.0.0.1:$up_port" 2 >"$work/bare.log" 2>&1 &
echo $! >"$work/bare.pid"
wait_port "$b_port"

gateway() { # name dedicated_io_thread [access log path] [binary] -> starts a fresh gateway, prints its port and admin port
  local name=$1 dedicated=$2 log=${3:-} exe=${4:-$bin/sentinel-gateway} port admin
  port=$(free_port); admin=$(free_port)
  cat >"$work/$name.toml" <<TOML
[server]
listen = "127.0.0.1:$port"
admin_listen = "127.0.0.1:$admin"
threads = 2
[redis]
url = "redis://127.0.0.1:$redis_port/0"
require_noeviction = false
dedicated_io_thread = $dedicated
[upstreams.app]
addrs = ["127.0.0.1:$up_port"]
[[routes]]
endpoint_id = "bench.none"
path = "/none"
upstream = "app"
algorithm = "none"
[[routes]]
endpoint_id = "bench.allowed"
path = "/allowed"
upstream = "app"
identity = { header = "X-API-Key" }
algorithm = "token_bucket"
capacity_micro = $big
refill_rate_micro_per_sec = $fast
TOML
  [[ -n $log ]] && printf '[access_log]\npath = "%s"\n' "$log" >>"$work/$name.toml"
  RUST_LOG=${GW_LOG:-warn} "$exe" --config "$work/$name.toml" >"$work/$name.${tag:-0}.log" 2>&1 &
  echo $! >"$work/$name.pid"
  wait_port "$port"
  curl -s -o /dev/null -H 'X-API-Key: warm' "http://127.0.0.1:$port/allowed"
  echo "$port $admin"
}
stop_gateway() { kill "$(cat "$work/$1.pid")" 2>/dev/null || true; wait "$(cat "$work/$1.pid")" 2>/dev/null || true; }

evalsha_stats() { # calls usec
  redis-cli -p "$redis_port" info commandstats | tr -d '\r' |
    sed -n 's/^cmdstat_evalsha:calls=\([0-9]*\),usec=\([0-9]*\),.*/\1 \2/p' | grep . || echo "0 0"
}
ms() { # wrk's latency (12.3us, 1.2ms, 1.0s) in ms
  awk -v v="$1" 'BEGIN { n = v + 0; if (v ~ /us$/) n /= 1000; else if (v ~ /ms$/) n += 0; else if (v ~ /s$/) n *= 1000; printf "%.2f", n }'
}

results="$work/results"
: >"$results"
cell() { # round conns cell
  local round=$1 conns=$2 cell=$3 port path=/ procs admin="" gw=""
  [[ " $cells_wanted " == *" $cell "* ]] || return 0
  case $cell in
    n) port=$n_port; procs=$(nginx_pids "$work/nginx") ;;
    o) port=$o_port; procs=$(nginx_pids "$work/openresty") ;;
    b) port=$b_port; procs=$(cat "$work/bare.pid") ;;
    2 | 2l | 2r | 3 | 3w | 2a | 3a)
      gw=gw$cell tag=$round.$conns
      read -r port admin < <(gateway "$gw" "$([[ $cell == 3w ]] && echo false || echo true)" "$([[ $cell == 2l ]] && echo "$work/access.log")" \
        "$([[ $cell == ?a ]] && echo "${ALT_BIN:?cells 2a and 3a need ALT_BIN}")")
      procs=$(cat "$work/$gw.pid")
      path=$([[ $cell == 2* ]] && echo /none || echo /allowed) ;;
    *) echo "unknown cell $cell" >&2; exit 2 ;;
  esac
  local before_p before_r calls0 usec0 calls1 usec1 out
  redis-cli -p "$redis_port" slowlog reset >/dev/null
  before_p=$(ticks_all $procs); before_r=$(ticks "$redis_pid"); read -r calls0 usec0 < <(evalsha_stats)
  local load=""
  if [[ $cell == 2r ]]; then
    # Cell 3's rate and batch size in this round (or, when cell 3 did not run or answered
    # anything but 2xx, 16 000 decisions a second in batches of 13).
    local rate batch
    read -r rate batch < <(awk -v r="$round" -v c="$conns" '$1 == r && $2 == c && $3 == "3" && $11 > 0 && $7 == 0 {
      printf "%d %d\n", $4, 1 / $11 + 0.5; found = 1 } END { if (!found) print "16000 13" }' "$results")
    python3 bench/redis_load.py "$redis_port" "$work/batch.lua" "$rate" "$batch" "$secs" >"$work/load.log" 2>&1 &
    load=$!
  fi
  out=$(/usr/bin/time -f 'WRKCPU %U %S' wrk -t2 -c"$conns" -d"${secs}s" --latency -s bench/keys.lua "http://127.0.0.1:$port$path" 2>&1)
  local load_cpu=0
  if [[ -n $load ]]; then
    wait "$load" || { echo "bench/redis_load.py failed:" >&2; cat "$work/load.log" >&2; exit 1; }
    load_cpu=$(awk '/cpu_seconds/ {print $NF}' "$work/load.log")
  fi
  local after_p after_r
  after_p=$(ticks_all $procs); after_r=$(ticks "$redis_pid"); read -r calls1 usec1 < <(evalsha_stats)
  local slow
  slow=$(redis-cli -p "$redis_port" slowlog len)
  # The slowest commands of the cell, for a look at a round that went wrong.
  redis-cli -p "$redis_port" slowlog get 100000 >"$work/slowlog.$cell.$round.$conns"
  local total rps p50 p99 non2xx wrk_cpu transitions=-
  total=$(awk '/requests in/ {print $1}' <<<"$out")
  rps=$(awk '/Requests\/sec/ {printf "%d", $2}' <<<"$out")
  p50=$(ms "$(awk '$1 == "50%" {print $2}' <<<"$out")")
  p99=$(ms "$(awk '$1 == "99%" {print $2}' <<<"$out")")
  non2xx=$(awk '/Non-2xx/ {print $5}' <<<"$out"); non2xx=${non2xx:-0}
  wrk_cpu=$(awk '/^WRKCPU/ {print $2 + $3}' <<<"$out")
  if [[ -n $gw ]]; then
    transitions=$(curl -s "http://127.0.0.1:$admin/metrics" | awk '/^sentinel_breaker_transitions_total/ {s += $2} END {print s + 0}')
    stop_gateway "$gw"
  fi
  awk -v r="$round" -v c="$conns" -v cell="$cell" -v total="$total" -v rps="$rps" -v p50="$p50" -v p99="$p99" \
    -v bad="$non2xx" -v pt=$((after_p - before_p)) -v rt=$((after_r - before_r)) -v hz="$hz" -v wrk="$wrk_cpu" \
    -v calls=$((calls1 - calls0)) -v usec=$((usec1 - usec0)) -v tr="$transitions" -v slow="$slow" -v load="$load_cpu" 'BEGIN {
      us = 1e6 / hz / total
      printf "%s %s %s %s %.2f %.2f %s %.1f %.1f %.2f %.3f %.1f %s %s %.1f\n", r, c, cell, rps, p50, p99, bad,
        pt * us, rt * us, (calls ? usec / total : 0), calls / total, wrk * 1e6 / total, tr, slow, load * 1e6 / total }' >>"$results"
}

for round in $(seq 1 "$rounds"); do
  for conns in $conns_wanted; do
    for c in n o b 2 2a 2l 3 3a 3w 2r; do cell "$round" "$conns" "$c"; done
  done
done

printf '%-5s %-5s %-4s %8s %7s %7s %7s %9s %9s %10s %9s %8s %6s %7s %7s\n' round conns cell req/s p50ms p99ms non2xx proxy_us redis_us evalsha_us calls/req wrk_us breaker slow2ms load_us
while read -r r c cell rps p50 p99 bad pus rus eus cpr wus tr slow lus; do
  printf '%-5s %-5s %-4s %8s %7s %7s %7s %9s %9s %10s %9s %8s %6s %7s %7s\n' "$r" "$c" "$cell" "$rps" "$p50" "$p99" "$bad" "$pus" "$rus" "$eus" "$cpr" "$wus" "$tr" "$slow" "$lus"
done <"$results"
echo
# Per round and connection count: the ratios of the targets, then their medians.
python3 - "$results" <<'PY'
import sys, statistics
rows = [l.split() for l in open(sys.argv[1])]
by = {}
for r in rows:
    by.setdefault((r[0], r[1]), {})[r[2]] = r
def ratio(cells, a, b):
    return float(cells[a][3]) / float(cells[b][3]) if a in cells and b in cells else None
measures = [
    ("   3/o (gateway+Redis / OpenResty+Redis)", lambda c: ratio(c, "3", "o")),
    ("   2/n (gateway none / nginx proxy_pass)", lambda c: ratio(c, "2", "n")),
    ("   2/b (gateway none / bare Pingora)", lambda c: ratio(c, "2", "b")),
    ("   3/2 (limited / unlimited)", lambda c: ratio(c, "3", "2")),
    ("   2l/2 (access log on / off), throughput", lambda c: ratio(c, "2l", "2")),
    ("   2l - 2, gateway CPU us per request", lambda c: float(c["2l"][7]) - float(c["2"][7]) if "2l" in c and "2" in c else None),
    ("   2l / 2, gateway CPU per request", lambda c: float(c["2l"][7]) / float(c["2"][7]) if "2l" in c and "2" in c else None),
    ("   3w/3 (workers / dedicated thread)", lambda c: ratio(c, "3w", "3")),
    ("   2/2a (this build / ALT_BIN, unlimited)", lambda c: ratio(c, "2", "2a")),
    ("   3/3a (this build / ALT_BIN, limited)", lambda c: ratio(c, "3", "3a")),
    ("   3 - 3a, gateway CPU us per limited request", lambda c: float(c["3"][7]) - float(c["3a"][7]) if "3" in c and "3a" in c else None),
    ("   Redis CPU us per limited request (cell 3)", lambda c: float(c["3"][8]) if "3" in c else None),
    ("   Redis CPU us per limited request (cell o)", lambda c: float(c["o"][8]) if "o" in c else None),
    ("   gateway CPU us, limited - unlimited (3 - 2)", lambda c: float(c["3"][7]) - float(c["2"][7]) if "3" in c and "2" in c else None),
    ("   gateway CPU us, Redis busy beside it (2r - 2)", lambda c: float(c["2r"][7]) - float(c["2"][7]) if "2r" in c and "2" in c else None),
    ("   gateway CPU us, the limiter's own (3 - 2r)", lambda c: float(c["3"][7]) - float(c["2r"][7]) if "3" in c and "2r" in c else None),
    ("   the load driver's own CPU us per request (cell 2r)", lambda c: float(c["2r"][14]) if "2r" in c else None),
    ("   Redis CPU us per decision of cell 2r's load", lambda c: float(c["2r"][8]) * float(c["2r"][3]) / float(c["3"][3]) if "2r" in c and "3" in c else None),
    ("   non-2xx answers of cell 3", lambda c: float(c["3"][6]) if "3" in c else None),
    ("   breaker transitions of cell 3", lambda c: float(c["3"][12]) if "3" in c else None),
    ("   Redis commands of 2 ms or more (cell 3)", lambda c: float(c["3"][13]) if "3" in c else None),
    ("   Redis commands of 2 ms or more (cell o)", lambda c: float(c["o"][13]) if "o" in c else None),
]
for conns in sorted({k[1] for k in by}, key=int):
    print(f"{conns} connections")
    for name, f in measures:
        vals = [f(by[k]) for k in sorted(by) if k[1] == conns]
        vals = [v for v in vals if v is not None]
        if vals:
            print(f"  {name:50s} median {statistics.median(vals):8.2f}   rounds {' '.join(f'{v:.2f}' for v in vals)}")
PY
echo
echo "Logs and slow logs of each cell: $work"
echo "Redis events of 5 ms or more (LATENCY LATEST: event, last time, last ms, max ms):"
redis-cli -p "$redis_port" latency latest | paste - - - - | sed 's/^/  /'
