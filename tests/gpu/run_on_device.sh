#!/usr/bin/env bash
# Runs ON THE GPU MACHINE, from the repo root, once the wheel chunks are in /tmp/stage
# (tests/gpu/README.md). Start it detached, then poll its log:
#   setsid nohup bash tests/gpu/run_on_device.sh > /tmp/gpu.log 2>&1 &
# Steps: install the pinned stack into /tmp/site (skipped if done), apply patches/series to it or to a copy
# in $PATCHED_SITE (idempotent), then `pytest -m gpu ${QS_GPU_TESTS:-tests/gpu}` (QS_GPU_TESTS=none: no
# tests). Everything it keeps goes to $QS_GPU_RESULTS (default /tmp/gpu-results): at most 8 flat files. The last line reads `DONE rc=<n> ...`.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT" || exit 1
RESULTS="${QS_GPU_RESULTS:-/tmp/gpu-results}"
WORK="${QS_GPU_WORK:-/tmp/qs-gpu-work}"
SITE="${SITE:-/tmp/site}"
STAGE="${STAGE:-/tmp/stage}"
PAY="${PAY:-/tmp/pay}"
PYTEST_LIMIT_S="${QS_GPU_PYTEST_LIMIT_S:-1500}"
T0=$(date +%s)
rm -rf "$RESULTS"
mkdir -p "$RESULTS" "$WORK"
exec > >(tee "$RESULTS/run.log") 2>&1

PHASES=""
log() { printf '[run_on_device +%ss] %s\n' "$(( $(date +%s) - T0 ))" "$*"; }
record_phase() { PHASES="${PHASES:+$PHASES, }\"$1\": $2"; log "phase $1: $2 s"; }
kill_leftover_servers() {
  # process groups of servers that a killed pytest could not stop (written by tests/gpu/conftest.py)
  [ -f "$WORK/server-pgids" ] || return 0
  local pgid key
  while read -r pgid key; do
    if kill -0 -- "-$pgid" 2>/dev/null; then
      log "killing leftover server $key (process group $pgid)"
      kill -TERM -- "-$pgid" 2>/dev/null; sleep 5; kill -KILL -- "-$pgid" 2>/dev/null
    fi
  done < "$WORK/server-pgids"
  rm -f "$WORK/server-pgids"
}
finish() {
  kill_leftover_servers
  log "results in $RESULTS:"; find "$RESULTS" -maxdepth 1 -type f -printf '  %f %s bytes\n' | sort
  echo "DONE rc=$1 ($2) after $(( $(date +%s) - T0 )) s"
  exit "$1"
}

# 0. the machine
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || finish 10 "no GPU visible"
python3 -c 'import pytest' || finish 10 "python3 has no pytest"

# 1. the pinned stack (install-on-device.sh: reassemble the chunks, pip install --target, link CUDA libs)
install_stack() {
  local n t
  n=$(find "$STAGE" -maxdepth 1 -name 'pay.*' 2>/dev/null | wc -l)
  [ "$n" -gt 0 ] || finish 11 "no chunks in $STAGE (stage them first: tests/gpu/README.md)"
  [ -f .whl/install-on-device.sh ] || finish 11 ".whl/install-on-device.sh missing (carry it with the last chunk)"
  t=$(date +%s)
  bash .whl/install-on-device.sh || finish 11 "install-on-device.sh failed"
  touch "$SITE/.qs-installed"
  record_phase install_s $(( $(date +%s) - t ))
}
if [ -f "$SITE/.qs-installed" ]; then
  log "pinned stack already in $SITE"
  record_phase install_s 0
else
  install_stack
fi
# runtime deps the staged wheel list lacks (tests/gpu/stage-extra.sh), carried as .whl/extra
if compgen -G ".whl/extra/*.whl" >/dev/null && [ ! -f "$SITE/.qs-extra" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" .whl/extra/*.whl \
    || finish 11 "installing .whl/extra failed"
  touch "$SITE/.qs-extra"
fi
export PYTHONPATH="$SITE:$ROOT" VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
  VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 PYTHONUNBUFFERED=1

# 2. the patch series (needs GNU patch; a copy can travel in the stage as .whl/tools/patch), applied to
# $SITE/vllm, or with PATCHED_SITE set to a copy of it there, so $SITE stays stock (bench/gpu/run_full.py
# serves both). A patched copy that verifies is used as it is.
if ! command -v patch >/dev/null && [ -x "$PAY/tools/patch" ]; then
  export PATH="$PAY/tools:$PATH"
fi
command -v patch >/dev/null || finish 12 "GNU patch not found (tests/gpu/README.md: stage .whl/tools/patch)"
t=$(date +%s)
if [ -n "${PATCHED_SITE:-}" ]; then
  export PYTHONPATH="$PATCHED_SITE:$PYTHONPATH"
  if ! python3 -m qwen_serving.patchset verify --vllm-dir "$PATCHED_SITE/vllm" >/dev/null 2>&1; then
    rm -rf "$PATCHED_SITE/vllm"
    mkdir -p "$PATCHED_SITE" || finish 12 "cannot create $PATCHED_SITE"
    cp -a "$SITE/vllm" "$PATCHED_SITE/vllm" || finish 12 "copying $SITE/vllm to $PATCHED_SITE failed"
    python3 -m qwen_serving.patchset apply --vllm-dir "$PATCHED_SITE/vllm" || finish 12 "patch series does not apply"
  fi
  VLLM_TREE="$PATCHED_SITE/vllm"
else
  if ! python3 -m qwen_serving.patchset apply --vllm-dir "$SITE/vllm"; then
    # a series from an earlier run conflicts: reinstall for a pristine tree, then apply once more
    log "apply refused; reinstalling the pinned stack for a pristine vllm"
    install_stack
    python3 -m qwen_serving.patchset apply --vllm-dir "$SITE/vllm" || finish 12 "patch series does not apply"
  fi
  VLLM_TREE="$SITE/vllm"
fi
python3 -m qwen_serving.patchset verify --vllm-dir "$VLLM_TREE" || finish 12 "patch series not fully applied"
record_phase apply_s $(( $(date +%s) - t ))
# The kernel caches brought back from an earlier visit (README: jit-cache; Triton's and vLLM's compiled graphs, in
# parts of at most 16 MB, xz or gzip; flashinfer-cache: FlashInfer's JIT builds) skip most of a server's kernel JIT
# and torch.compile.
for CACHE_PARTS in "$STAGE"/{jit-cache,flashinfer-cache}.{txz,tgz}; do
  if compgen -G "$CACHE_PARTS.*" > /dev/null; then
    log "restoring the kernel caches from $CACHE_PARTS.*"
    unsqueeze=(xz -d); [ "${CACHE_PARTS##*.}" = tgz ] && unsqueeze=(gzip -d)
    cat "$CACHE_PARTS".* | "${unsqueeze[@]}" | tar -xf - -C "$HOME" \
      || log "the kernel caches did not unpack (the servers compile afresh)"
  fi
done
[ "${QS_GPU_TESTS:-}" = none ] && finish 0 "stack ready, no tests asked for (QS_GPU_TESTS=none)"

# 3. the GPU tests (tests/gpu/conftest.py writes gpu-smoke-h200.json and the server logs into $RESULTS)
read -ra TARGETS <<< "${QS_GPU_TESTS:-tests/gpu}"
log "pytest -m gpu ${TARGETS[*]}"
export QS_GPU_RESULTS="$RESULTS" QS_GPU_WORK="$WORK" QS_GPU_RUNNER_T0="$T0" QS_GPU_RUNNER_PHASES="{$PHASES}"
rm -f "$WORK/server-pgids"
timeout --signal=TERM --kill-after=60 "$PYTEST_LIMIT_S" \
  python3 -m pytest -m gpu "${TARGETS[@]}" -p no:cacheprovider -rA -v \
  --junitxml="$RESULTS/junit.xml" -o junit_family=xunit2
rc=$?
[ "$rc" -eq 124 ] && finish "$rc" "pytest passed its ${PYTEST_LIMIT_S} s limit"
finish "$rc" "pytest exit status"
