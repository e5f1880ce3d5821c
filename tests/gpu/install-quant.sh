#!/usr/bin/env bash
# Runs ON THE GPU MACHINE, from the repo root, after the pinned stack is in /tmp/site (run_on_device.sh or
# .whl/install-on-device.sh): install tests/gpu/stage-quant.sh's wheels into $QUANT_SITE (default /tmp/quant-site),
# then check that GPTQ imports with the quant site first on the path and that the serving stack without it is
# unchanged. The wheels come from .whl/quant/ when carried whole, else from the parts $STAGE/quant.NN (copied
# there like the stack's chunks; tests/gpu/README.md). Afterwards drafter/quantize.py runs as
#   PYTHONPATH=/tmp/quant-site:/tmp/site python3 drafter/quantize.py ...
# Exit: 0 ok ($QUANT_SITE/.qs-quant written); 11 no wheels or the install failed; 12 GPTQ or compressed-tensors
# 0.19.0 does not import with the quant site; 13 the serving stack alone no longer imports vllm with
# compressed-tensors 0.17.0.
set -uo pipefail
SITE="${SITE:-/tmp/site}"; QUANT_SITE="${QUANT_SITE:-/tmp/quant-site}"; STAGE="${STAGE:-/tmp/stage}"
say() { printf '[install-quant] %s\n' "$*"; }
fail() { say "FAILED: $2"; exit "$1"; }

[ -d "$SITE/vllm" ] || fail 11 "no vllm in $SITE: install the stack first (tests/gpu/README.md)"
if compgen -G ".whl/quant/*.whl" >/dev/null; then
  WHEELS=.whl/quant
elif compgen -G "$STAGE/quant.*" >/dev/null; then
  rm -rf /tmp/quant-pay
  mkdir -p /tmp/quant-pay || fail 11 "cannot create /tmp/quant-pay"
  cat "$STAGE"/quant.* | tar -xf - -C /tmp/quant-pay || fail 11 "the parts $STAGE/quant.* do not unpack (one missing?)"
  WHEELS=/tmp/quant-pay/quant
else
  fail 11 "no .whl/quant/*.whl and no $STAGE/quant.* parts (run tests/gpu/stage-quant.sh here and carry them)"
fi
say "$(find "$WHEELS" -name '*.whl' | wc -l) wheels from $WHEELS into $QUANT_SITE"
rm -rf "$QUANT_SITE"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$QUANT_SITE" "$WHEELS"/*.whl \
  || fail 11 "pip install --target $QUANT_SITE failed"

got=$(PYTHONPATH="$QUANT_SITE:$SITE" python3 -c '
from llmcompressor.modifiers.gptq.gptq_quantize import quantize_weight  # noqa: F401  what quantize.py calls
import compressed_tensors
print(compressed_tensors.__version__)' 2>&1 | tail -n 1)
[ "$got" = 0.19.0 ] || fail 12 "with $QUANT_SITE first, GPTQ import / compressed-tensors 0.19.0: got '$got'"
say "GPTQ imports with $QUANT_SITE:$SITE, compressed-tensors $got"

got=$(PYTHONPATH="$SITE" python3 -c '
import vllm, compressed_tensors
print(vllm.__version__, compressed_tensors.__version__)' 2>&1 | tail -n 1)
[ "$got" = "0.28.0 0.17.0" ] || fail 13 "$SITE alone, vllm and compressed-tensors: got '$got', want '0.28.0 0.17.0'"
say "serving stack unchanged: vllm 0.28.0 with compressed-tensors 0.17.0 from $SITE"
touch "$QUANT_SITE/.qs-quant"  # bench/gpu/product_visit.py builds issue #19's drafters only where this is
