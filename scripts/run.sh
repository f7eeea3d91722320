#!/usr/bin/env bash
# Builds (release) and runs tollgate with the given arguments, e.g.
#   ./scripts/run.sh demo                      # gateway + built-in sample API, ready to curl
#   ./scripts/run.sh run -c gateway.yaml       # serve your own API
# On a fresh Debian machine it first installs the one build dependency Pingora needs (cmake).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if ! command -v cmake >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq cmake >/dev/null
    else
        echo "tollgate needs cmake to build: sudo apt-get install cmake" >&2
        exit 1
    fi
fi
cargo build --release --quiet
exec target/release/tollgate "$@"
