#!/usr/bin/env bash
# Packs what tests/gpu/product_visit.sh has produced so far into OUT (at most 8 files, 16 MiB each, come back):
# product-visit.json (and product-visit-N.json for share N of QS_PRODUCT_PLANS); product.tgz (every tool's JSON and
# log, the greedy answers, the run log); logs.tgz (each server log's last 2 MB); visit.tgz (the visit, preparation
# and FlashInfer install logs, the GPU tests' results and log); jit-cache.txz.NN and flashinfer-cache.txz.NN (the
# kernel caches in 16 MB parts, when the files left hold them: carry them as .whl/ next time; else pack_jit_cache.sh
# in a call of its own).
set -uo pipefail
OUT="${1:?usage: pack_product_visit.sh OUT}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd /tmp || exit 1
cp product-out/product-visit.json "$OUT/" 2>/dev/null
for d in product-out-*; do [ -e "$d/product-visit.json" ] && cp "$d/product-visit.json" "$OUT/product-visit-${d#product-out-}.json"; done
parts=()
for p in product-out product.log product-out-* product-*.log; do [ -e "$p" ] && parts+=("$p"); done
[ ${#parts[@]} -gt 0 ] && tar -czf "$OUT/product.tgz" --exclude='traces-*' --exclude='*.server.log' "${parts[@]}" 2>/dev/null
mkdir -p /tmp/pack-product-logs
for log in product-out/*.server.log product-out-*/*.server.log; do [ -e "$log" ] && tail -c 2000000 "$log" > "/tmp/pack-product-logs/$(basename "$log")"; done
tar -czf "$OUT/logs.tgz" -C /tmp pack-product-logs 2>/dev/null
parts=()
for p in visit-prepare visit.log visit-prepare.log visit-flashinfer.log visit-tests visit-tests.log; do [ -e "$p" ] && parts+=("$p"); done
[ ${#parts[@]} -gt 0 ] && tar -czf "$OUT/visit.tgz" "${parts[@]}" 2>/dev/null
bash "$HERE/pack_jit_cache.sh" "$OUT"
ls -la "$OUT"
