#!/usr/bin/env bash
# The whole test suite: formatting, lints, unit + integration tests (real gateway processes,
# real redis-server, real HTTP, the status page in a real headless Chromium), and the deploy/
# artefacts checked with promtool (each alert against a real gateway's recorded scenario).
#
# On a fresh Debian machine with a Rust toolchain it installs what is missing (as root, with
# apt-get); otherwise it says exactly what to install.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

need=()
command -v cmake >/dev/null || need+=(cmake)
command -v redis-server >/dev/null || need+=(redis-server)
command -v redis-cli >/dev/null || need+=(redis-tools)
command -v promtool >/dev/null || need+=(prometheus)
python3 -c 'import yaml' 2>/dev/null || need+=(python3-yaml)
# Headless, for the status page's browser test (tests/status_page.rs).
command -v chromium >/dev/null || need+=(chromium)
if [ ${#need[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        echo "==> installing: ${need[*]}"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
    else
        echo "missing: ${need[*]} — install them with: sudo apt-get install ${need[*]}" >&2
        exit 1
    fi
fi
# The Prometheus package starts a server on :9090 on install; the tests don't need it.
if command -v systemctl >/dev/null && systemctl is-active --quiet prometheus 2>/dev/null; then
    systemctl stop prometheus || true
fi

echo "==> cargo fmt --check"
cargo fmt --all -- --check
echo "==> cargo clippy"
cargo clippy --all-targets --quiet -- -D warnings
echo "==> cargo test"
# Two test threads: integration tests start gateway processes; the machine may have 2 cores.
# Every target runs even after one fails (--no-fail-fast); the failures are listed at the end.
log=$(mktemp)
trap 'rm -f "$log"' EXIT
tests_rc=0
cargo test --all-targets --no-fail-fast -- --test-threads="${TEST_THREADS:-2}" 2>&1 | tee "$log" || tests_rc=$?
echo "==> deploy/ artefacts"
deploy_rc=0
cargo build --quiet
TOLLGATE_BIN="${CARGO_TARGET_DIR:-target}/debug/tollgate" bash deploy/check.sh || deploy_rc=$?
if [ "$tests_rc" != 0 ] || [ "$deploy_rc" != 0 ]; then
    echo "==> FAILED"
    # Each failed test, then cargo's list of the targets that failed.
    awk '/^test .* \.\.\. FAILED$/ { print; next }
         /^error: .*targets? failed/ { t = 1 }
         t && (/^error/ || /^    /) { print; next }
         { t = 0 }' "$log"
    [ "$deploy_rc" = 0 ] || echo "deploy/check.sh failed (exit $deploy_rc)"
    exit 1
fi
