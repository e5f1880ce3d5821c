#!/usr/bin/env bash
# The kernel caches (Triton's, vLLM's compiled graphs) into OUT for a later visit's boot, in 15 MB parts, when the
# 8 files that come back leave room for them (visit 10's were 126 MB: too many); run by the pack scripts
# last, after their own files.  Usage: bash tests/gpu/pack_jit_cache.sh OUT
set -uo pipefail
OUT="${1:?usage: pack_jit_cache.sh OUT}"
rm -f "$OUT"/jit-cache.tgz.*
if tar -czf /tmp/jit-cache.tgz -C "$HOME" .triton/cache .cache/vllm/torch_compile_cache 2>/dev/null; then
  room=$(( 8 - $(find "$OUT" -maxdepth 1 -type f | wc -l) ))
  if [ "$(stat -c %s /tmp/jit-cache.tgz)" -le $(( room * 15000000 )) ]; then
    split -b 15000000 -d -a 2 /tmp/jit-cache.tgz "$OUT/jit-cache.tgz."
  else echo "kernel caches: $(stat -c %s /tmp/jit-cache.tgz) bytes, more than the $room parts left: not packed"; fi
fi
