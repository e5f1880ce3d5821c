#!/usr/bin/env bash
# Packs what a device visit (tests/gpu/device_visit.sh) has produced so far into OUT (at most 8 files come
# back from the device): visit.tgz (bench reports, PNGs, logs, test results; no traces) and, per config, its
# profiler traces as traces-<config>.tgz when that stays under 15 MiB.
set -uo pipefail
OUT="${1:?usage: pack_visit.sh OUT}"
BENCH_OUT="${BENCH_OUT:-/tmp/bench-out}"
cd /tmp || exit 1
parts=()
for p in "${BENCH_OUT#/tmp/}" visit-tests visit-prepare visit.log visit-tests.log visit-prepare.log; do
  [ -e "$p" ] && parts+=("$p")
done
tar -czf "$OUT/visit.tgz" --exclude='traces-*' "${parts[@]}" 2>/dev/null
for dir in "$BENCH_OUT"/traces-*; do
  [ -d "$dir" ] || continue
  name="$(basename "$dir")"
  files=$(find "$dir" -name '*.json' -size +0 -not -path '*capture_traces*')
  [ -n "$files" ] || continue
  # shellcheck disable=SC2086
  tar -czf "$OUT/$name.tgz" $files 2>/dev/null
  [ "$(stat -c %s "$OUT/$name.tgz")" -le $((15 * 1024 * 1024)) ] || { echo "$name.tgz over 15 MiB: left out"; rm -f "$OUT/$name.tgz"; }
done
ls -la "$OUT"
