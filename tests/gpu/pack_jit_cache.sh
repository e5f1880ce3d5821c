#!/usr/bin/env bash
# The kernel caches (Triton's, vLLM's compiled graphs) into OUT for a later visit's boot, xz-compressed in parts of
# 16,000,000 bytes (a file that comes back is at most 16 MiB, and at most 8 of them), when the files already in OUT
# leave room for them. Visit 10's were 126 MB gzipped, more than the files a visit's pack leaves: give them a call
# of their own once the results are here (OUT empty: 8 parts, 128 MB). The pack scripts run this last.
# FlashInfer's JIT builds (~/.cache/flashinfer: its compiled kernels with their objects and ninja logs, which ninja needs
# to leave them be; a visit that served FlashInfer: tests/gpu/install-flashinfer.sh) follow as flashinfer-cache.*,
# in the parts left after the others.
#   Usage: bash tests/gpu/pack_jit_cache.sh OUT
set -uo pipefail
OUT="${1:?usage: pack_jit_cache.sh OUT}"
PART=16000000
rm -f "$OUT"/jit-cache.t?z.*
if command -v xz > /dev/null; then ext=txz; squeeze=(xz -T0 -6); else ext=tgz; squeeze=(gzip -6); fi
if tar -cf - -C "$HOME" .triton/cache .cache/vllm/torch_compile_cache 2>/dev/null | "${squeeze[@]}" > "/tmp/jit-cache.$ext"; then
  room=$(( 8 - $(find "$OUT" -maxdepth 1 -type f | wc -l) ))
  size=$(stat -c %s "/tmp/jit-cache.$ext")
  if [ "$size" -le $(( room * PART )) ]; then
    split -b "$PART" -d -a 2 "/tmp/jit-cache.$ext" "$OUT/jit-cache.$ext."
    echo "kernel caches: $size bytes in $(( (size + PART - 1) / PART )) parts"
  else echo "kernel caches: $size bytes, more than the $room parts left: not packed (a call of their own holds 8)"; fi
fi
rm -f "$OUT"/flashinfer-cache.t?z.*
if [ -d "$HOME/.cache/flashinfer" ] && tar -cf - -C "$HOME" .cache/flashinfer | "${squeeze[@]}" > "/tmp/flashinfer-cache.$ext"; then
  room=$(( 8 - $(find "$OUT" -maxdepth 1 -type f | wc -l) ))
  size=$(stat -c %s "/tmp/flashinfer-cache.$ext")
  if [ "$size" -le $(( room * PART )) ]; then
    split -b "$PART" -d -a 2 "/tmp/flashinfer-cache.$ext" "$OUT/flashinfer-cache.$ext."
    echo "FlashInfer's JIT cache: $size bytes in $(( (size + PART - 1) / PART )) parts"
  else echo "FlashInfer's JIT cache: $size bytes, more than the $room parts left: not packed"; fi
fi
