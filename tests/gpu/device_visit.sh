#!/usr/bin/env bash
# One visit to the GPU machine, after the stack is installed in $SITE (tests/gpu/README.md). Start it detached:
#   setsid nohup bash tests/gpu/device_visit.sh > /tmp/visit.log 2>&1 < /dev/null &
# 1. the patch series on a copy of vllm in $PATCHED_SITE ($SITE stays stock);
# 2. the full-shape checkpoint in $CKPT (run_full.py would make it too, but before the tests share the GPU);
# 3. the GPU tests in $QS_GPU_TESTS (tests/gpu/run_on_device.sh, log /tmp/visit-tests.log), while
# 4. the servers of bench wave 1 boot (bench/gpu/run_full.py); they are measured once the tests are done;
# 5. bench wave 2 (servers that did not fit beside wave 1), then the line `VISIT DONE`.
# tests/gpu/pack_visit.sh OUT packs whatever is there so far.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT" || exit 1
CKPT="${CKPT:-/tmp/qwen-full}"
BENCH_OUT="${BENCH_OUT:-/tmp/bench-out}"
TESTS="${QS_GPU_TESTS:-tests/gpu/test_engine_hooks_gpu.py}"
read -ra WAVE1 <<< "${WAVE1:-stock stock-mtp4 patched-batch}"
read -ra WAVE2 <<< "${WAVE2-stock-mtp7 patched-mtp4}"  # WAVE2= (empty): no wave 2

# shellcheck source=tests/gpu/visit_prepare.sh
source tests/gpu/visit_prepare.sh  # log(), step 1 and the environment

if [ ! -f "$CKPT/config.json" ]; then
  log "2. full-shape checkpoint in $CKPT"
  python3 -m qwen_serving.checkpoint.synth --size full --out "$CKPT" --seed 0 || log "checkpoint generation failed"
fi

log "3. GPU tests: $TESTS (log /tmp/visit-tests.log)"
QS_GPU_TESTS="$TESTS" QS_GPU_RESULTS=/tmp/visit-tests QS_GPU_WORK=/tmp/visit-tests-work QS_GPU_PYTEST_LIMIT_S=900 \
  bash tests/gpu/run_on_device.sh > /tmp/visit-tests.log 2>&1 &

log "4. bench wave 1: ${WAVE1[*]}"
python3 bench/gpu/run_full.py "$BENCH_OUT" "${WAVE1[@]}" --site "$SITE" --patched-site "$PATCHED_SITE" --ckpt "$CKPT" \
  --before-measure "timeout 1200 bash -c 'until grep -q ^DONE /tmp/visit-tests.log; do sleep 5; done'; tail -n 3 /tmp/visit-tests.log"
log "wave 1 exit $?"
wait
if [ ${#WAVE2[@]} -gt 0 ]; then
  log "5. bench wave 2: ${WAVE2[*]}"
  python3 bench/gpu/run_full.py "$BENCH_OUT" "${WAVE2[@]}" --site "$SITE" --patched-site "$PATCHED_SITE" --ckpt "$CKPT" \
    --base-port 18040
  log "wave 2 exit $?"
fi
echo "VISIT DONE"
