#!/usr/bin/env bash
# Usage: bash bench/acceptance_19.sh (with the venv active); prints PASS or FAIL per combination.
# Issue 19's combinations: each trains lenet for a few steps at batch 8 and must exit 0.
set -u
CONVOY=${CONVOY:-convoy}
D=$(mktemp -d)
run() {

  local t0=$(date +%s)
  rm -rf "$D/ck"
  if timeout 300 $CONVOY train --model lenet --batch-size 8 --steps 6 --out "$D/run" --no-progress "$@" > "$D/log" 2>&1; then
    echo "PASS $(( $(date +%s) - t0 ))s: $*"
  else
    echo "FAIL (exit $?) $(( $(date +%s) - t0 ))s: $*"; tail -3 "$D/log" | sed 's/^/    /'
  fi
}
run --nproc 3 --sync ps --servers 1 --compress blocktopk --block-fraction 0.1
run --nproc 3 --sync ps --servers 1 --compress powersgd
run --nproc 4 --sync hierarchical --clusters 2 --checkpoint-dir "$D/ck"
run --nproc 3 --sync ps --servers 1 --checkpoint-dir "$D/ck"
run --nproc 5 --parallel hybrid --conv-workers 4 --fc-workers 1 --sync hierarchical --clusters 2
run --nproc 4 --parallel hybrid --conv-workers 2 --fc-workers 1 --sync ps --servers 1
run --nproc 4 --parallel hybrid --conv-workers 3 --fc-workers 1 --compress powersgd --checkpoint-dir "$D/ck"
run --nproc 4 --sync hierarchical --clusters 2 --compress powersgd
run --nproc 4 --sync hierarchical --clusters 2 --compress blocktopk --block-fraction 0.1 --checkpoint-dir "$D/ck"
rm -rf "$D"
