#!/usr/bin/env bash
# Runs the whole test suite: unit tests, and integration tests against real redis-server
# processes, the demo upstream and the gateway binary, all on loopback.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh test
cargo test --all-targets --locked "$@"
