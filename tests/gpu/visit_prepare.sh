# Sourced by the visit scripts (device_visit.sh, scripted_visit.sh) from the repo root: log(), then step 1,
# the patch series on a copy of vllm in $PATCHED_SITE ($SITE stays stock), then the environment every later
# step runs in. A failed preparation ends the visit with `VISIT DONE (failed)`.
# shellcheck shell=bash
export SITE="${SITE:-/tmp/site}" PATCHED_SITE="${PATCHED_SITE:-/tmp/patched}"
log() { printf '[visit %s] %s\n' "$(date +%H:%M:%S)" "$*"; }

log "1. patched copy of vllm in $PATCHED_SITE"
QS_GPU_TESTS=none QS_GPU_RESULTS=/tmp/visit-prepare bash tests/gpu/run_on_device.sh > /tmp/visit-prepare.log 2>&1
grep -q '^DONE rc=0 ' /tmp/visit-prepare.log || { log "preparing failed:"; tail -n 30 /tmp/visit-prepare.log; echo "VISIT DONE (failed)"; exit 1; }
export PYTHONPATH="$SITE:$PWD" VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
  VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 PYTHONUNBUFFERED=1
# Triton keeps each autotune result in its disk cache, so servers booted after the first wave skip the GDN
# kernels' autotuning (visit 9: a 94 s warm-up per server, four booting together)
export TRITON_CACHE_AUTOTUNING=1
