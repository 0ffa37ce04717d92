#!/usr/bin/env bash
# Starts the demo: Redis on 6379 (or the one already there), two demo upstreams (PDFTalk on
# 9001, Resumint on 9002) and the gateway on 8080 with ./gateway.toml (admin on 9090).
# Everything runs in the background; `scripts/demo.sh stop` stops what it started, by PID.
# `scripts/demo.sh redis` starts the demo's Redis again alone (after a `kill -9` of it, say,
# to watch the gateway come back), recorded with the rest.
set -euo pipefail
cd "$(dirname "$0")/.."
state=.demo
mkdir -p "$state"

# Whether `pid` is still the process the demo started as `what` (its executable's name): a
# PID that ended may have been given to another process since.
ours() { # pid, what
  [[ -r /proc/$1/cmdline ]] && tr '\0' ' ' </proc/"$1"/cmdline | grep -q -- "$2"
}

stop() {
  [[ -f $state/pids ]] || return 0
  # The gateway first, so that the requests it drains still find Redis and the upstreams;
  # then the rest. Each is waited for (up to the gateway's grace period and a little more),
  # so that a demo started right after finds its ports free.
  local pid name exe
  while read -r pid name exe; do
    # A record of an older demo holds no executable's name: its process's name is in its
    # command line too.
    exe=${exe:-$name}
    ours "$pid" "$exe" || continue
    kill "$pid" 2>/dev/null || continue
    for _ in $(seq 1 150); do
      ours "$pid" "$exe" || break
      sleep 0.1
    done
    echo "stopped $name ($pid)"
  done < <(grep ' sentinel-gateway ' "$state/pids" || true; grep -v ' sentinel-gateway ' "$state/pids" || true)
  rm -f "$state/pids"
}

start() { # name, log, command...
  local name=$1 log=$2
  shift 2
  "$@" >>"$state/$log" 2>&1 &
  echo "$! $name $(basename "$1")" >>"$state/pids"
}

wait_port() { # port, what
  for _ in $(seq 1 100); do
    if (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; then return 0; fi
    sleep 0.1
  done
  echo "$2 did not come up on port $1; see $state/" >&2
  exit 1
}

redis() {
  if redis-cli -p 6379 ping >/dev/null 2>&1; then
    echo "using the Redis already on 127.0.0.1:6379"
  else
    start redis-server redis.log redis-server --port 6379 --bind 127.0.0.1 --save "" --appendonly no
    wait_port 6379 redis-server
  fi
}

case ${1:-} in
  stop)
    stop
    exit 0
    ;;
  redis)
    redis
    exit 0
    ;;
esac
stop

scripts/deps.sh
cargo build --release --locked --bins

rm -f "$state"/*.log
redis
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

Logs are in .demo/. Kill the demo's Redis under load (kill -9 <its PID in .demo/pids>) and
start it again with: scripts/demo.sh redis. Stop everything with: scripts/demo.sh stop
MSG
