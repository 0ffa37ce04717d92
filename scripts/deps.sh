#!/usr/bin/env bash
# Installs what a fresh Debian machine with only the Rust toolchain lacks: cmake (for C
# dependencies of the build), redis-server (for the demo and the tests) and promtool (the
# alert rules' tests).
set -euo pipefail

missing=()
command -v cmake >/dev/null 2>&1 || missing+=(cmake)
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
command -v redis-cli >/dev/null 2>&1 || missing+=(redis-tools)
command -v curl >/dev/null 2>&1 || missing+=(curl)
command -v promtool >/dev/null 2>&1 || missing+=(prometheus)
if ((${#missing[@]})); then
  if [[ $(id -u) -ne 0 ]]; then
    echo "missing: ${missing[*]}; install them with: apt-get install -y ${missing[*]}" >&2
    exit 1
  fi
  echo "installing ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi
