#!/usr/bin/env bash
# Installs what a fresh Debian machine with only the Rust toolchain lacks.
#   scripts/deps.sh        cmake and make (C dependencies of the build: jemalloc is built with
#                          make), redis-server and redis-cli, curl
#   scripts/deps.sh test   the same, plus promtool (package prometheus) for the alert rules' tests
set -euo pipefail

missing=()
command -v cmake >/dev/null 2>&1 || missing+=(cmake)
command -v make >/dev/null 2>&1 || missing+=(make)
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
command -v redis-cli >/dev/null 2>&1 || missing+=(redis-tools)
command -v curl >/dev/null 2>&1 || missing+=(curl)
if [[ ${1:-} == test ]]; then
  command -v promtool >/dev/null 2>&1 || missing+=(prometheus)
fi
((${#missing[@]})) || exit 0

if [[ $(id -u) -ne 0 ]]; then
  echo "missing: ${missing[*]}; install them with: apt-get install -y ${missing[*]}" >&2
  exit 1
fi
# Install only: Debian would otherwise start the packages' services (a Prometheus server on
# :9090, a Redis on :6379) on machines that run an init system.
if [[ ! -e /usr/sbin/policy-rc.d ]]; then
  printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
  chmod +x /usr/sbin/policy-rc.d
  trap 'rm -f /usr/sbin/policy-rc.d' EXIT
fi
echo "installing ${missing[*]}"
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
