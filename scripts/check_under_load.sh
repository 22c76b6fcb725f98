#!/usr/bin/env bash
# `make check` several times in a row while two busy processes keep every core of a 2-core
# machine loaded: the suite's waits must hold on a busy CI machine, not only on a quiet one.
# Usage: scripts/check_under_load.sh [RUNS] (default 3). Stops at the first failing run.
set -euo pipefail
cd "$(dirname "$0")/.."
runs="${1:-3}"
busy=()
for _ in 1 2; do
  python3 -c 'while True: pass' &
  busy+=("$!")
done
trap 'kill "${busy[@]}" 2>/dev/null || true' EXIT
for i in $(seq "$runs"); do
  echo "== make check, run $i of $runs, load average $(cut -d' ' -f1-3 /proc/loadavg)"
  start=$(date +%s)
  make check
  echo "== run $i passed in $(($(date +%s) - start)) s"
done
