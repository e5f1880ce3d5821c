#!/usr/bin/env bash
# Packs what tests/gpu/scripted_visit.sh has produced so far into OUT (at most 8 files, 16 MiB each, come back):
# scripted-h200-mtp.json; scripted.tgz (the run's JSON: greedy answers, chi-square samples, prediction, synth and
# prediction logs, the run log); logs.tgz (each server log's last 2 MB); profiles.tgz (the gzipped traces of the
# profiled C1 windows); tests.tgz (the GPU tests' results and logs, the visit logs);
# jit-cache.txz.NN (the kernel caches in 16 MB parts, when the files left hold them: carry them as .whl/ next time).
set -uo pipefail
OUT="${1:?usage: pack_scripted_visit.sh OUT}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd /tmp || exit 1
cp scripted-out/scripted-h200-mtp.json "$OUT/" 2>/dev/null
parts=()
for p in scripted-out scripted.log scripted-layers.log scripted-layers-compiled.log scripted-checkpoint.log scripted-prepare.log vllm-tests.log; do [ -e "$p" ] && parts+=("$p"); done
[ ${#parts[@]} -gt 0 ] && tar -czf "$OUT/scripted.tgz" --exclude='traces-*' --exclude='profiles' \
  --exclude='*.server.log' "${parts[@]}" 2>/dev/null
mkdir -p /tmp/pack-logs
for log in scripted-out/*.server.log; do [ -e "$log" ] && tail -c 2000000 "$log" > "/tmp/pack-logs/$(basename "$log")"; done
tar -czf "$OUT/logs.tgz" -C /tmp pack-logs 2>/dev/null
[ -d scripted-out/profiles ] && tar -cf "$OUT/profiles.tgz" -C scripted-out profiles 2>/dev/null
parts=()
for p in visit-tests visit-prepare visit.log visit-tests.log visit-prepare.log; do [ -e "$p" ] && parts+=("$p"); done
[ ${#parts[@]} -gt 0 ] && tar -czf "$OUT/tests.tgz" "${parts[@]}" 2>/dev/null
bash "$HERE/pack_jit_cache.sh" "$OUT"
ls -la "$OUT"
