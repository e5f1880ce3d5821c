#!/usr/bin/env bash
# One visit for the scripted checkpoint (issue #16), after the stack is staged (tests/gpu/README.md). Start detached:
#   setsid nohup bash tests/gpu/scripted_visit.sh > /tmp/visit.log 2>&1 < /dev/null &
# 1. the patch series on a copy of vllm in $PATCHED_SITE ($SITE stays stock);
# 2. the GPU tests in $QS_GPU_TESTS (default: the smoke suite) in the background, log /tmp/visit-tests.log;
#    they are small engines on fixed pools and finish while the scripted servers boot;
# 3. bench/gpu/scripted_mtp.py (the scripted full checkpoint, three servers, acceptance, exactness, C1);
# 4. the line `VISIT DONE`. tests/gpu/pack_scripted_visit.sh OUT packs whatever is there so far.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT" || exit 1
TESTS="${QS_GPU_TESTS:-tests/gpu/test_smoke.py}"

# shellcheck source=tests/gpu/visit_prepare.sh
source tests/gpu/visit_prepare.sh  # log(), step 1 and the environment

log "2. GPU tests: $TESTS (log /tmp/visit-tests.log)"
QS_GPU_TESTS="$TESTS" QS_GPU_RESULTS=/tmp/visit-tests QS_GPU_WORK=/tmp/visit-tests-work QS_GPU_PYTEST_LIMIT_S=900 \
  bash tests/gpu/run_on_device.sh > /tmp/visit-tests.log 2>&1 &

log "3. scripted MTP run (log /tmp/scripted.log)"
python3 bench/gpu/scripted_mtp.py /tmp/scripted-out --site "$SITE" --patched-site "$PATCHED_SITE" > /tmp/scripted.log 2>&1
log "scripted exit $?"
wait
log "tests: $(tail -n 1 /tmp/visit-tests.log)"
echo "VISIT DONE"
