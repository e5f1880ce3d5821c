#!/usr/bin/env bash
# One visit for the scripted checkpoint (issues #16, #17), after the stack is staged (tests/gpu/README.md). Start
# detached:
#   setsid nohup bash tests/gpu/scripted_visit.sh > /tmp/visit.log 2>&1 < /dev/null &
# 1. the patch series on a copy of vllm in $PATCHED_SITE ($SITE stays stock);
# 2. the GPU tests in $QS_GPU_TESTS (default none: the first wave and the reference fill the GPU) in the
#    background, stopped after $QS_VISIT_TESTS_LIMIT_S seconds (default 900), log /tmp/visit-tests.log;
# 2a. (.whl/vllm-tests staged by tests/gpu/stage-vllm-tests.sh, QS_VLLM_TESTS=1 the default) vLLM's own
#    sampler and rejection-sampler tests on the stock and the patched tree, in the background
#    (tests/gpu/vllm_sampler_tests.sh; OUT/vllm-tests/vllm-sampler-tests.json);
# 2b. (QS_SCRIPTED_LAYERS=1, the default) the scripted full checkpoint, then bench/gpu/scripted_layers.py: vLLM's
#    modules, per-layer residual stream and logits against the reference (~2.5 min), before anything is measured,
#    while the patched servers' prepared copy is made beside it (scripted_mtp.py --only prepare); with
#    QS_SCRIPTED_LAYERS_COMPILED=1 also its compiled answer (~3 min);
# 2c. (QS_GO_WAIT_S > 0) a wait for /tmp/qs-go, sourced: the budget of step 3 or QS_STOP=1;
# 3. bench/gpu/scripted_mtp.py (the first wave and the sweep; with QS_FROM_RUN=REPORT the sweep alone, the first
#    wave's measures and answers taken from an earlier run's REPORT in bench/results; with QS_ABLATE=PATCH[,PATCH]
#    the plan at k=4 without each patch beside its own k=4 server) within $QS_SCRIPTED_BUDGET_S seconds (default: what
#    is left of $QS_DEVICE_LEFT_S, 1,380 s = 30 device minutes less ~5 for staging and ~2 for packing, when this
#    script started);
# 4. the line `VISIT DONE`. tests/gpu/pack_scripted_visit.sh OUT packs whatever is there so far.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT" || exit 1
TESTS="${QS_GPU_TESTS:-none}"
VISIT_T0=$(date +%s)

# shellcheck source=tests/gpu/visit_prepare.sh
source tests/gpu/visit_prepare.sh  # log(), step 1 and the environment

if [ "$TESTS" != none ]; then
  log "2. GPU tests: $TESTS (log /tmp/visit-tests.log)"
  QS_GPU_TESTS="$TESTS" QS_GPU_RESULTS=/tmp/visit-tests QS_GPU_WORK=/tmp/visit-tests-work \
    QS_GPU_PYTEST_LIMIT_S="${QS_VISIT_TESTS_LIMIT_S:-900}" \
    bash tests/gpu/run_on_device.sh > /tmp/visit-tests.log 2>&1 &
fi

if [ -d .whl/vllm-tests ] && [ "${QS_VLLM_TESTS:-1}" = 1 ]; then
  log "2a. vLLM's own sampler tests, stock and patched, in the background (log /tmp/vllm-tests.log)"
  SITE="$SITE" PATCHED_SITE="$PATCHED_SITE" bash tests/gpu/vllm_sampler_tests.sh /tmp/scripted-out/vllm-tests \
    > /tmp/vllm-tests.log 2>&1 &
fi

CKPT=/tmp/qwen-scripted-full
if [ "${QS_SCRIPTED_LAYERS:-1}" = 1 ]; then
  log "2b. the scripted checkpoint, then vLLM's GPU forward against the reference (log /tmp/scripted-layers.log)"
  mkdir -p /tmp/scripted-out
  python3 bench/gpu/scripted_mtp.py /tmp/scripted-out --site "$SITE" --ckpt "$CKPT" --only checkpoint \
    > /tmp/scripted-checkpoint.log 2>&1
  # the patched servers' prepared copy (CPU work) while the layers check holds the GPU
  python3 bench/gpu/scripted_mtp.py /tmp/scripted-out --site "$SITE" --ckpt "$CKPT" --only prepare \
    > /tmp/scripted-prepare.log 2>&1 &
  prepare_pid=$!
  timeout 300 python3 bench/gpu/scripted_layers.py "$CKPT" --out /tmp/scripted-out/scripted-layers.json \
    --budget-s 240 > /tmp/scripted-layers.log 2>&1
  log "scripted_layers exit $?: $(tail -n 3 /tmp/scripted-layers.log | tr '\n' ' ')"
  if [ "${QS_SCRIPTED_LAYERS_COMPILED:-0}" = 1 ]; then  # the answer under torch.compile and CUDA graphs (~3 min)
    timeout 240 python3 bench/gpu/scripted_layers.py "$CKPT" --compiled \
      --out /tmp/scripted-out/scripted-layers-compiled.json --budget-s 200 > /tmp/scripted-layers-compiled.log 2>&1
    log "scripted_layers --compiled exit $?: $(tail -n 1 /tmp/scripted-layers-compiled.log)"
  fi
fi

# 2c. Time to read the layers report before anything is measured: wait up to QS_GO_WAIT_S (default 0) for
# /tmp/qs-go, a shell file sourced here (QS_SCRIPTED_BUDGET_S=..., QS_STOP=1 to end the visit).
waited=0
while [ ! -f /tmp/qs-go ] && [ "$waited" -lt "${QS_GO_WAIT_S:-0}" ]; do sleep 2; waited=$((waited + 2)); done
# shellcheck disable=SC1091
[ -f /tmp/qs-go ] && source /tmp/qs-go && log "go file: $(tr '\n' ' ' < /tmp/qs-go)"
if [ "${QS_STOP:-0}" = 1 ]; then echo "VISIT DONE"; exit 0; fi

[ -n "${prepare_pid:-}" ] && { wait "$prepare_pid"; log "prepared copy: $(tail -n 1 /tmp/scripted-prepare.log)"; }
log "3. scripted run (log /tmp/scripted.log)"
budget_s="${QS_SCRIPTED_BUDGET_S:-$(( ${QS_DEVICE_LEFT_S:-1380} - ($(date +%s) - VISIT_T0) ))}"
run_args=(--budget-s "$budget_s")
[ -n "${QS_FROM_RUN:-}" ] && run_args+=(--from-run "$QS_FROM_RUN")
[ -n "${QS_FROM_RUN_SERVERS:-}" ] && run_args+=(--from-run-servers "$QS_FROM_RUN_SERVERS")
[ -n "${QS_ABLATE:-}" ] && run_args+=(--ablate "$QS_ABLATE")
log "scripted run budget: $budget_s s"
python3 bench/gpu/scripted_mtp.py /tmp/scripted-out --site "$SITE" --patched-site "$PATCHED_SITE" "${run_args[@]}" \
  > /tmp/scripted.log 2>&1
log "scripted exit $?"
wait
[ "$TESTS" != none ] && log "tests: $(tail -n 1 /tmp/visit-tests.log)"
echo "VISIT DONE"
