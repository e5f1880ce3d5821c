#!/usr/bin/env bash
# One visit for the product's other plans on the scripted checkpoint (issues #18 to #23), after the stack and
# .whl/extra are staged (tests/gpu/README.md, "A product-plans visit"). Start detached:
#   setsid nohup bash tests/gpu/product_visit.sh > /tmp/visit.log 2>&1 < /dev/null &
# 1. the patch series on a copy of vllm in $PATCHED_SITE ($SITE stays stock; visit_prepare.sh);
# 1a. FlashInfer beside the stack when its parts are staged (tests/gpu/install-flashinfer.sh, log
#    /tmp/visit-flashinfer.log): bench/gpu/product_visit.py plans mtp-long only where it passed; likewise the GPTQ
#    quant site (tests/gpu/install-quant.sh, log /tmp/visit-quant.log) for issue #19's single-fast and dflash2-w4a16;
# 1b. bench/kernels.py --only $QS_KERNELS (default lookup; none skips it) into /tmp/product-out, GPU still idle;
# 1c. (QS_GPU_TESTS, default none) those GPU tests, also before any server holds the GPU, within what is left of the
#    budget and at most $QS_VISIT_TESTS_LIMIT_S seconds (default 300), results in /tmp/visit-tests, log
#    /tmp/visit-tests.log;
# 2. bench/gpu/product_visit.py (the checkpoint, its prepared copy and the drafter, then the waves; only the configs
#    QS_PRODUCT_PLANS names, comma-separated, when set; shares separated by ';' run one after another, the second
#    into /tmp/product-out-2 with log /tmp/product-2.log, and so on, each with what is left) within
#    $QS_PRODUCT_BUDGET_S seconds (default: what is left of $QS_DEVICE_LEFT_S, 1,380 s = 30 device minutes less ~5
#    for staging and ~2 for packing, when this script started); nothing else uses the GPU meanwhile;
# 3. the line `VISIT DONE`. tests/gpu/pack_product_visit.sh OUT packs whatever is there so far.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT" || exit 1
VISIT_T0=$(date +%s)

# shellcheck source=tests/gpu/visit_prepare.sh
source tests/gpu/visit_prepare.sh  # log(), step 1 and the environment

if compgen -G "${STAGE:-/tmp/stage}/flashinfer.[0-9]*" > /dev/null || compgen -G ".whl/flashinfer/*.whl" > /dev/null; then
  bash tests/gpu/install-flashinfer.sh > /tmp/visit-flashinfer.log 2>&1
  log "1a. FlashInfer install exit $?: $(tail -n 1 /tmp/visit-flashinfer.log)"
fi
if compgen -G "${STAGE:-/tmp/stage}/quant.[0-9]*" > /dev/null || compgen -G ".whl/quant/*.whl" > /dev/null; then
  bash tests/gpu/install-quant.sh > /tmp/visit-quant.log 2>&1
  log "1a. quant site install exit $?: $(tail -n 1 /tmp/visit-quant.log)"
fi
budget_s="${QS_PRODUCT_BUDGET_S:-$(( ${QS_DEVICE_LEFT_S:-1380} - ($(date +%s) - VISIT_T0) ))}"
BUDGET_T0=$(date +%s)
left_s() { echo $(( budget_s - ($(date +%s) - BUDGET_T0) )); }
# 1b. kernels alone while the GPU is idle (QS_KERNELS, default lookup: issue #18's 20 us; none to skip)
KERNELS="${QS_KERNELS:-lookup}"
if [ "$KERNELS" != none ]; then
  mkdir -p /tmp/product-out
  timeout 180 python3 bench/kernels.py --only "$KERNELS" --out /tmp/product-out > /tmp/product-out/kernels.log 2>&1
  log "kernels $KERNELS exit $?: $(tail -n 1 /tmp/product-out/kernels.log)"
fi
TESTS="${QS_GPU_TESTS:-none}"
if [ "$TESTS" != none ]; then
  left=$(left_s) cap="${QS_VISIT_TESTS_LIMIT_S:-300}"
  limit_s=$(( left < cap ? left : cap ))
  if [ "$limit_s" -gt 30 ]; then
    log "1c. GPU tests: $TESTS within $limit_s s (log /tmp/visit-tests.log)"
    QS_GPU_TESTS="$TESTS" QS_GPU_RESULTS=/tmp/visit-tests QS_GPU_WORK=/tmp/visit-tests-work \
      QS_GPU_PYTEST_LIMIT_S="$limit_s" bash tests/gpu/run_on_device.sh > /tmp/visit-tests.log 2>&1
    log "GPU tests exit $?: $(tail -n 1 /tmp/visit-tests.log)"
  else
    log "1c. GPU tests skipped: $left s left"
  fi
fi
# shares of the configs, one after another, each with what the ones before it left (visit 13 ran two by hand)
IFS=';' read -r -a shares <<< "${QS_PRODUCT_PLANS:-}"
[ ${#shares[@]} -eq 0 ] && shares=("")
n=0
for share in "${shares[@]}"; do
  n=$((n + 1))
  out=/tmp/product-out; plog=/tmp/product.log
  [ "$n" -gt 1 ] && out=/tmp/product-out-$n && plog=/tmp/product-$n.log
  left=$(left_s)
  log "2.$n product plans ${share:-(all)} (log $plog), budget $left s"
  mkdir -p "$out"
  plans=()
  [ -n "$share" ] && plans=(--plans "$share")
  python3 bench/gpu/product_visit.py "$out" --site "$SITE" --patched-site "$PATCHED_SITE" \
    --budget-s "$left" "${plans[@]}" > "$plog" 2>&1
  log "product exit $?: $(tail -n 1 "$plog")"
done
echo "VISIT DONE"
