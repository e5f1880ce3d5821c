#!/usr/bin/env bash
# Packs what tests/gpu/product_visit.sh has produced so far into OUT (at most 8 files, 16 MiB each, come back):
# product-visit.json; product.tgz (every tool's JSON and log, the greedy answers, the run log); logs.tgz (each
# server log's last 2 MB); visit.tgz (the visit and preparation logs); jit-cache.tgz.NN (the kernel caches in 15 MB
# parts, when the files left hold them: carry them as .whl/ next time).
set -uo pipefail
OUT="${1:?usage: pack_product_visit.sh OUT}"
cd /tmp || exit 1
cp product-out/product-visit.json "$OUT/" 2>/dev/null
parts=()
for p in product-out product.log; do [ -e "$p" ] && parts+=("$p"); done
[ ${#parts[@]} -gt 0 ] && tar -czf "$OUT/product.tgz" --exclude='traces-*' --exclude='*.server.log' "${parts[@]}" 2>/dev/null
mkdir -p /tmp/pack-product-logs
for log in product-out/*.server.log; do [ -e "$log" ] && tail -c 2000000 "$log" > "/tmp/pack-product-logs/$(basename "$log")"; done
tar -czf "$OUT/logs.tgz" -C /tmp pack-product-logs 2>/dev/null
parts=()
for p in visit-prepare visit.log visit-prepare.log; do [ -e "$p" ] && parts+=("$p"); done
[ ${#parts[@]} -gt 0 ] && tar -czf "$OUT/visit.tgz" "${parts[@]}" 2>/dev/null
rm -f "$OUT"/jit-cache.tgz.*
if tar -czf /tmp/jit-cache.tgz -C "$HOME" .triton/cache .cache/vllm/torch_compile_cache 2>/dev/null; then
  room=$(( 8 - $(find "$OUT" -maxdepth 1 -type f | wc -l) ))
  if [ "$(stat -c %s /tmp/jit-cache.tgz)" -le $(( room * 15000000 )) ]; then
    split -b 15000000 -d -a 2 /tmp/jit-cache.tgz "$OUT/jit-cache.tgz."
  else echo "kernel caches: $(stat -c %s /tmp/jit-cache.tgz) bytes, more than the $room parts left: not packed"; fi
fi
ls -la "$OUT"
