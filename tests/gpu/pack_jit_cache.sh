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
if command -v xz > /dev/null; then ext=txz; squeeze=(xz -T0 -6); else ext=tgz; squeeze=(gzip -6); fi
# pack NAME LABEL DIR...: the DIRs under $HOME as OUT/NAME.EXT.NN, when the files already in OUT leave room for them
pack() {
  local name="$1" label="$2" room size
  shift 2
  rm -f "$OUT/$name".t?z.*
  tar -cf - -C "$HOME" "$@" 2>/dev/null | "${squeeze[@]}" > "/tmp/$name.$ext" || return 0
  room=$(( 8 - $(find "$OUT" -maxdepth 1 -type f | wc -l) ))
  size=$(stat -c %s "/tmp/$name.$ext")
  if [ "$size" -le $(( room * PART )) ]; then
    split -b "$PART" -d -a 2 "/tmp/$name.$ext" "$OUT/$name.$ext."
    echo "$label: $size bytes in $(( (size + PART - 1) / PART )) parts"
  else echo "$label: $size bytes, more than the $room parts left: not packed (a call of their own holds 8)"; fi
}
pack jit-cache "kernel caches" .triton/cache .cache/vllm/torch_compile_cache
if [ -d "$HOME/.cache/flashinfer" ]; then pack flashinfer-cache "FlashInfer's JIT cache" .cache/flashinfer; fi
