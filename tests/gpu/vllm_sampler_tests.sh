#!/usr/bin/env bash
# Runs ON THE GPU MACHINE from the repo root, after the stack is staged and patched (tests/gpu/visit_prepare.sh):
# vLLM 0.28.0's own sampler, top-k/top-p and rejection-sampler tests (staged here by tests/gpu/stage-vllm-tests.sh
# into .whl/vllm-tests), once against the stock tree and once against the patched one, where every sampler hook
# is live (the small-k kernel and the rejection sampler's paths decide from shapes alone); then
# tests/gpu/upstream_compare.py: a test the patched tree fails and stock passes fails the run.
#   bash tests/gpu/vllm_sampler_tests.sh OUT_DIR        (SITE, PATCHED_SITE as in visit_prepare.sh)
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
OUT="${1:?usage: vllm_sampler_tests.sh OUT_DIR}"
SITE="${SITE:-/tmp/site}"
PATCHED_SITE="${PATCHED_SITE:-/tmp/patched}"
TESTS="$ROOT/.whl/vllm-tests"
LIMIT_S="${QS_VLLM_TESTS_LIMIT_S:-420}"
[ -f "$TESTS/tests/v1/sample/test_sampler.py" ] || { echo "no $TESTS: run tests/gpu/stage-vllm-tests.sh here, carry .whl/vllm-tests"; exit 2; }
[ -f "$PATCHED_SITE/vllm/__init__.py" ] || { echo "no patched vllm in $PATCHED_SITE"; exit 2; }
mkdir -p "$OUT"
cd "$TESTS" || exit 2
for tree in stock patched; do
  path="$SITE"
  [ "$tree" = patched ] && path="$PATCHED_SITE:$SITE"
  start=$(date +%s)
  PYTHONPATH="$path:$ROOT:$TESTS" timeout "$LIMIT_S" python3 -m pytest -q --noconftest -p no:cacheprovider \
    --junitxml="$OUT/vllm-sampler-$tree.xml" tests/v1/sample/test_sampler.py tests/v1/sample/test_topk_topp_sampler.py \
    tests/v1/sample/test_rejection_sampler.py > "$OUT/vllm-sampler-$tree.log" 2>&1
  echo "$tree: exit $? after $(( $(date +%s) - start )) s: $(tail -n 1 "$OUT/vllm-sampler-$tree.log")"
done
cd "$ROOT" || exit 2
python3 tests/gpu/upstream_compare.py "$OUT/vllm-sampler-stock.xml" "$OUT/vllm-sampler-patched.xml" \
  --out "$OUT/vllm-sampler-tests.json"
