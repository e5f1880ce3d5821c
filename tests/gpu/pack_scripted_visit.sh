#!/usr/bin/env bash
# Packs what tests/gpu/scripted_visit.sh has produced so far into OUT (at most 8 files, 16 MiB each, come back):
# scripted-h200-mtp.json; scripted.tgz (the run's JSON: greedy answers, chi-square samples, prediction, synth and
# prediction logs, the run log); logs.tgz (each server log's last 2 MB); profiles.tgz (the gzipped traces of the
# profiled C1 windows); tests.tgz (the GPU tests' results and logs, the visit logs);
# jit-cache.tgz.NN (the kernel caches in 15 MB parts, when the files left hold them: carry them as .whl/ next time).
set -uo pipefail
OUT="${1:?usage: pack_scripted_visit.sh OUT}"
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
# the kernel caches (Triton's, vLLM's compiled graphs) for a later visit's boot, in 15 MB parts, as many as the
# 8 files that come back leave room for
rm -f "$OUT"/jit-cache.tgz.*
if tar -czf /tmp/jit-cache.tgz -C "$HOME" .triton/cache .cache/vllm/torch_compile_cache 2>/dev/null; then
  room=$(( 8 - $(find "$OUT" -maxdepth 1 -type f | wc -l) ))
  if [ "$(stat -c %s /tmp/jit-cache.tgz)" -le $(( room * 15000000 )) ]; then
    split -b 15000000 -d -a 2 /tmp/jit-cache.tgz "$OUT/jit-cache.tgz."
  else echo "kernel caches: $(stat -c %s /tmp/jit-cache.tgz) bytes, more than the $room parts left: not packed"; fi
fi
ls -la "$OUT"
