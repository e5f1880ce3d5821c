#!/usr/bin/env bash
# Packs what tests/gpu/product_visit.sh has produced so far into OUT (at most 8 files, 16 MiB each, come back):
# product-visit.json (and product-visit-N.json for share N of QS_PRODUCT_PLANS); product.tgz (every tool's JSON and
# log, the greedy answers, the run log); logs.tgz (each server log's last 2 MB); visit.tgz (the visit, preparation,
# FlashInfer and quant install logs, the GPU tests' results and log); jit-cache.txz.NN and flashinfer-cache.txz.NN
# (the kernel caches in 16 MB parts, when the files left hold them: carry them as .whl/ next time; else
# pack_jit_cache.sh in a call of its own). With --no-cache (each poll while the visit runs: a machine lost
# mid-visit then leaves the last poll's files here) the kernel caches are left out.
set -uo pipefail
OUT="${1:?usage: pack_product_visit.sh OUT [--no-cache]}"
CACHES=1
case "${2:-}" in
  "") ;;
  --no-cache) CACHES=0 ;;
  *) echo "pack_product_visit.sh: unknown option ${2} (only --no-cache)" >&2; exit 2 ;;
esac
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "${QS_PACK_FROM:-/tmp}" || exit 1  # where the visit writes; a test points it elsewhere
cp product-out/product-visit.json "$OUT/" 2>/dev/null
for d in product-out-*; do [ -e "$d/product-visit.json" ] && cp "$d/product-visit.json" "$OUT/product-visit-${d#product-out-}.json"; done
parts=()
for p in product-out product.log product-out-* product-*.log; do [ -e "$p" ] && parts+=("$p"); done
[ ${#parts[@]} -gt 0 ] && tar -czf "$OUT/product.tgz" --exclude='traces-*' --exclude='*.server.log' "${parts[@]}" 2>/dev/null
mkdir -p pack-product-logs
for log in product-out/*.server.log product-out-*/*.server.log; do [ -e "$log" ] && tail -c 2000000 "$log" > "pack-product-logs/$(basename "$log")"; done
tar -czf "$OUT/logs.tgz" pack-product-logs 2>/dev/null
parts=()
for p in visit-prepare visit.log visit-prepare.log visit-flashinfer.log visit-quant.log visit-tests visit-tests.log; do [ -e "$p" ] && parts+=("$p"); done
[ ${#parts[@]} -gt 0 ] && tar -czf "$OUT/visit.tgz" "${parts[@]}" 2>/dev/null
[ "$CACHES" = 1 ] && bash "$HERE/pack_jit_cache.sh" "$OUT"
ls -la "$OUT"
