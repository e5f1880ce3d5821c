#!/usr/bin/env bash
# One visit for the scripted checkpoint (issues #16, #17), after the stack is staged (tests/gpu/README.md). Start
# detached:
#   setsid nohup bash tests/gpu/scripted_visit.sh > /tmp/visit.log 2>&1 < /dev/null &
# 1. the patch series on a copy of vllm in $PATCHED_SITE ($SITE stays stock);
# 2. the GPU tests in $QS_GPU_TESTS (default none: the first wave and the reference fill the GPU) in the
#    background, log /tmp/visit-tests.log;
# 3. bench/gpu/scripted_mtp.py (the scripted full checkpoint, the first wave and the sweep) within
#    $QS_SCRIPTED_BUDGET_S seconds (default: the script's);
# 4. the line `VISIT DONE`. tests/gpu/pack_scripted_visit.sh OUT packs whatever is there so far.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT" || exit 1
TESTS="${QS_GPU_TESTS:-none}"

# shellcheck source=tests/gpu/visit_prepare.sh
source tests/gpu/visit_prepare.sh  # log(), step 1 and the environment

if [ "$TESTS" != none ]; then
  log "2. GPU tests: $TESTS (log /tmp/visit-tests.log)"
  QS_GPU_TESTS="$TESTS" QS_GPU_RESULTS=/tmp/visit-tests QS_GPU_WORK=/tmp/visit-tests-work QS_GPU_PYTEST_LIMIT_S=900 \
    bash tests/gpu/run_on_device.sh > /tmp/visit-tests.log 2>&1 &
fi

log "3. scripted run (log /tmp/scripted.log)"
budget=()
[ -n "${QS_SCRIPTED_BUDGET_S:-}" ] && budget=(--budget-s "$QS_SCRIPTED_BUDGET_S")
python3 bench/gpu/scripted_mtp.py /tmp/scripted-out --site "$SITE" --patched-site "$PATCHED_SITE" "${budget[@]}" \
  > /tmp/scripted.log 2>&1
log "scripted exit $?"
wait
[ "$TESTS" != none ] && log "tests: $(tail -n 1 /tmp/visit-tests.log)"
echo "VISIT DONE"
