#!/usr/bin/env bash
# Packs what tests/gpu/scripted_visit.sh has produced so far into OUT (at most 8 files come back):
# scripted-h200-mtp.json, scripted.tgz (the run's output less profiler traces, its log), tests.tgz (the GPU
# tests' results and logs, the visit logs).
set -uo pipefail
OUT="${1:?usage: pack_scripted_visit.sh OUT}"
cd /tmp || exit 1
cp scripted-out/scripted-h200-mtp.json "$OUT/" 2>/dev/null
parts=()
for p in scripted-out scripted.log; do [ -e "$p" ] && parts+=("$p"); done
[ ${#parts[@]} -gt 0 ] && tar -czf "$OUT/scripted.tgz" --exclude='traces-*' "${parts[@]}" 2>/dev/null
parts=()
for p in visit-tests visit-prepare visit.log visit-tests.log visit-prepare.log; do [ -e "$p" ] && parts+=("$p"); done
[ ${#parts[@]} -gt 0 ] && tar -czf "$OUT/tests.tgz" "${parts[@]}" 2>/dev/null
ls -la "$OUT"
