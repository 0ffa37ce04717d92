#!/usr/bin/env bash
# Starts the demo: Redis on 6379 (or the one already there), two demo upstreams (PDFTalk on
# 9001, Resumint on 9002) and the gateway on 8080 with ./gateway.toml (admin on 9090).
# Everything runs in the background; `scripts/demo.sh stop` stops what it started, by PID.
set -euo pipefail
cd "$(dirname "$0")/.."
state=.demo
mkdir -p "$state"

stop() {
  if [[ -f $state/pids ]]; then
    while read -r pid name; do
      if kill -0 "$pid" 2>/dev/null; then
        kill "$pid" && echo "stopped $name ($pid)"
      fi
    done <"$state/pids"
    rm -f "$state/pids"
  fi
}

if [[ ${1:-} == stop ]]; then
  stop
  exit 0
fi
stop

scripts/deps.sh
cargo build --release --locked --bins

start() { # name, log, command...
  local name=$1 log=$2
  shift 2
  "$@" >"$state/$log" 2>&1 &
  echo "$! $name" >>"$state/pids"
}

wait_port() { # port, what
  for _ in $(seq 1 100); do
    if (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; then return 0; fi
    sleep 0.1
  done
  echo "$2 did not come up on port $1; see $state/" >&2
  exit 1
}

if redis-cli -p 6379 ping >/dev/null 2>&1; then
  echo "using the Redis already on 127.0.0.1:6379"
else
  start redis-server redis.log redis-server --port 6379 --bind 127.0.0.1 --save "" --appendonly no
  wait_port 6379 redis-server
fi
start pdftalk upstream-pdftalk.log target/release/demo-upstream 127.0.0.1:9001 pdftalk
start resumint upstream-resumint.log target/release/demo-upstream 127.0.0.1:9002 resumint
wait_port 9001 "the PDFTalk demo upstream"
wait_port 9002 "the Resumint demo upstream"
start sentinel-gateway gateway.log target/release/sentinel-gateway --config gateway.toml
wait_port 8080 sentinel-gateway
wait_port 9090 "the admin listener"

cat <<'MSG'

sentinel-gateway is up on 127.0.0.1:8080 (admin 127.0.0.1:9090). Try:

  curl -i -X POST -H 'X-API-Key: demo' localhost:8080/pdftalk/ingest/doc   # 5 admitted, then 429
  curl -i -H 'X-API-Key: demo' localhost:8080/resumint/tailor               # 20 burst, 2/s
  curl -i localhost:8080/healthz                                            # never limited
  curl -s localhost:9090/readyz
  curl -s localhost:9090/metrics | grep ^sentinel_
  curl -i --http2-prior-knowledge -H 'X-API-Key: demo' localhost:8080/resumint/tailor   # HTTP/2 (h2c)
  curl -s 'localhost:9090/limits/pdftalk.ingest?identity=header%3Ax-api-key%3Ademo'    # the key's bucket

Load, with oha (cargo install oha) or wrk (apt-get install wrk):

  oha -z 10s -c 64 -H 'X-API-Key: load' http://127.0.0.1:8080/resumint/tailor
  wrk -d 10s -c 64 -t 2 -H 'X-API-Key: load' http://127.0.0.1:8080/resumint/tailor

Logs are in .demo/. Stop everything with: scripts/demo.sh stop
MSG
