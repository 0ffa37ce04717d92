#!/usr/bin/env bash
# A profile-guided build of the gateway and of the bare Pingora proxy (docs/benchmarks.md,
# "A profile-guided build"): the production profile, instrumented, run under a training load
# on loopback, then built again with what the run counted.
#
#   scripts/pgo.sh                 binaries in target/pgo/x86_64-unknown-linux-gnu/production/
#   TRAIN_SECONDS=10 scripts/pgo.sh   (seconds of load per training cell; default 8)
#
# Needs llvm-profdata from rustup's llvm-tools component, what scripts/deps.sh installs, wrk
# and nginx (each installed when missing). Two builds of the production profile from cold, in
# target directories of their own: about 25 minutes on two cores.
#
# The training load is what a gateway in front of an API spends its time on: the plain proxy
# path and limited routes (token bucket and sliding window, 10 000 identities, bench/keys.lua)
# at 64 and 256 connections, a route that denies, HTTP/1.1 keep-alive in the clear and over
# TLS, HTTP/2 over TLS and h2c (h2load); the admin's /metrics scraped meanwhile. Code the load
# does not reach (JWTs, Sentinel, a cluster, the failure paths) is laid out as rarely run:
# correct, but not made faster, possibly a little slower than without a profile.
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${TRAIN_SECONDS:-8}
work=$(mktemp -d /tmp/sentinel-pgo.XXXXXX)
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap cleanup EXIT

sysroot=$(rustc --print sysroot)
host=$(rustc -vV | sed -n 's/^host: //p')
profdata=$sysroot/lib/rustlib/$host/bin/llvm-profdata
[[ -x $profdata ]] || rustup component add llvm-tools
scripts/deps.sh
need=()
command -v wrk >/dev/null || need+=(wrk)
command -v nginx >/dev/null || need+=(nginx-light)
command -v h2load >/dev/null || need+=(nghttp2-client)
command -v openssl >/dev/null || need+=(openssl)
command -v redis-server >/dev/null || need+=(redis-server redis-tools)
if ((${#need[@]})); then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null; fi

# `--target`: the flags apply to the binaries only, not to build scripts and proc macros.
# The profiles' path is part of the flags: kept the same from run to run, so that a second
# run does not build the instrumented binaries again. The merged profile is named by its
# content, so that a new profile rebuilds everything it guides (cargo sees only the flags).
profiles=$PWD/target/pgo-gen/profiles
rm -rf "$profiles"
echo "building the instrumented binaries (target/pgo-gen)"
RUSTFLAGS="-Cprofile-generate=$profiles" \
  cargo build --profile production --locked --bins --target "$host" --target-dir target/pgo-gen
gen=target/pgo-gen/$host/production

. bench/lib.sh
redis_port=$(free_port)
redis-server --port "$redis_port" --bind 127.0.0.1 --save "" --appendonly no >"$work/redis.log" 2>&1 &
pids+=($!)
wait_port "$redis_port"
upstream_200 "$work/upstream"

port=$(free_port) admin=$(free_port) b_port=$(free_port) tls_port=$(free_port)
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 2 -subj /CN=localhost \
  -keyout "$work/tls.key" -out "$work/tls.pem" 2>/dev/null
cat >"$work/gateway.toml" <<TOML
[server]
listen = "127.0.0.1:$port"
admin_listen = "127.0.0.1:$admin"
threads = 2
h2c = true
[[server.tls]]
listen = "127.0.0.1:$tls_port"
cert_path = "$work/tls.pem"
key_path = "$work/tls.key"
[redis]
url = "redis://127.0.0.1:$redis_port/0"
require_noeviction = false
# The default budget and breaker: the instrumented binary is slower, and at 256 connections its
# breaker may open, so part of the limited routes' counts can be the open breaker's answers.
# A training that kept it closed (timeout_ms = 200, open_seconds = 1) made the guided build
# spend more than 23 minutes in LLVM's SLP vectorizer on the gateway's crate, unfinished; this
# one builds in about 6 (docs/benchmarks.md).
[upstreams.app]
addrs = ["127.0.0.1:$up_port"]
[[routes]]
endpoint_id = "train.none"
path = "/none"
upstream = "app"
algorithm = "none"
[[routes]]
endpoint_id = "train.bucket"
path = "/bucket"
upstream = "app"
identity = { header = "X-API-Key" }
algorithm = "token_bucket"
capacity_micro = 1000000000000000
refill_rate_micro_per_sec = 1000000000000
[[routes]]
endpoint_id = "train.window"
path = "/window"
upstream = "app"
identity = { header = "X-API-Key" }
algorithm = "sliding_window"
limit = 10_000_000
window_size_micro = 60_000_000
[[routes]]
endpoint_id = "train.denied"
path = "/denied"
upstream = "app"
identity = { header = "X-API-Key" }
algorithm = "token_bucket"
capacity_micro = 1000000
refill_rate_micro_per_sec = 1
TOML
RUST_LOG=warn "$gen/sentinel-gateway" --config "$work/gateway.toml" >"$work/gateway.log" 2>&1 &
gw=$!
pids+=($gw)
"$gen/bare-proxy" "127.0.0.1:$b_port" "127.0.0.1:$up_port" 2 >"$work/bare.log" 2>&1 &
bare=$!
pids+=($bare)
wait_port "$port"
wait_port "$tls_port"
wait_port "$b_port"

load() { # conns url
  wrk -t2 -c"$1" -d"${secs}s" -s bench/keys.lua "$2" | sed -n -e 's/^Requests\/sec: */    req\/s /p' -e 's/^ *Non-2xx.*: */    non-2xx /p'
}
scrape() { while kill -0 "$gw" 2>/dev/null; do curl -s -o /dev/null "http://127.0.0.1:$admin/metrics"; sleep 1; done; }
scrape &
pids+=($!)
for conns in 64 256; do
  for path in none bucket window denied; do
    echo "training: /$path, $conns connections"
    load "$conns" "http://127.0.0.1:$port/$path"
  done
  echo "training: the bare proxy, $conns connections"
  load "$conns" "http://127.0.0.1:$b_port/"
done
for path in none bucket; do
  echo "training: /$path over TLS, HTTP/1.1, 64 connections"
  load 64 "https://127.0.0.1:$tls_port/$path"
  echo "training: /$path, HTTP/2 over TLS and h2c"
  for url in "https://127.0.0.1:$tls_port/$path" "http://127.0.0.1:$port/$path"; do
    h2load -D "$secs" -c 16 -m 16 -t 2 -H 'X-API-Key: key-1' "$url" | sed -n 's/^finished in .*, \([0-9.]* req\/s\).*/    \1/p'
  done
done
# The profile is written when the processes exit of their own accord.
kill -TERM "$gw" "$bare"
wait "$gw" "$bare" 2>/dev/null || true
ls "$profiles"/*.profraw >/dev/null || { echo "the instrumented run left no profile" >&2; exit 1; }
mkdir -p target/pgo
# A many-threaded instrumented binary can write a counter out of range (seen here: one of
# 400 000, 2^63, in the config's validation); llvm-profdata then refuses the whole file.
# `warn` keeps every other count; the function with the bad one is only laid out worse.
"$profdata" merge --failure-mode=warn -o "$work/merged.profdata" "$profiles"/*.profraw
merged=$PWD/target/pgo/$(sha256sum "$work/merged.profdata" | cut -c1-16).profdata
mv "$work/merged.profdata" "$merged"

echo "building with the profile (target/pgo)"
RUSTFLAGS="-Cprofile-use=$merged" \
  cargo build --profile production --locked --bins --target "$host" --target-dir target/pgo
echo "profile-guided binaries in target/pgo/$host/production/: sentinel-gateway, bare-proxy"
