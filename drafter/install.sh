#!/usr/bin/env bash
# The GPTQ ("quant") environment for drafter/quantize.py: its own venv, never the serving venv.
#
# Why separate: vLLM 0.28.0 pins compressed-tensors==0.17.0, and no llmcompressor release pins that
# version (checked with pip against PyPI's metadata: llmcompressor 0.11.0 pins compressed-tensors
# 0.16.0, 0.12.0.2 pins 0.17.1, 0.13.0 pins 0.18.0, 0.14.0.1 pins 0.19.0; 0.14.0.1 also caps
# transformers at <= 5.17.0 while the serving venv has 5.24). Installing either into the other's
# venv changes the compressed-tensors (and transformers) that the other was released against.
# Nothing here is imported by the server: quantize.py writes plain safetensors files.
#
# Pinned: llmcompressor==0.14.0.1 (compressed-tensors 0.19.0) over torch==2.13.0, the CPU build
# (the PyTorch CPU index: ~200 MB instead of the CUDA wheel's ~2.5 GB plus its nvidia-* wheels);
# checked to install and run GPTQ on Python 3.11 (drafter/README.md).
#   bash drafter/install.sh
# Env: QS_QUANT_VENV (default drafter/.venv-quant), PYTHON (default python3.11, else python3),
# QS_TORCH_INDEX (default https://download.pytorch.org/whl/cpu; set it empty to take torch from
# pip's own configured indexes). Safe to re-run: an installed venv is checked and left alone.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${QS_QUANT_VENV:-$ROOT/drafter/.venv-quant}"
PY="$VENV/bin/python"
PIN_LLMCOMPRESSOR=0.14.0.1
PIN_TORCH=2.13.0
TORCH_INDEX="${QS_TORCH_INDEX-https://download.pytorch.org/whl/cpu}"
step() { printf '[drafter/install] %s\n' "$*"; }
fail() { printf '[drafter/install] FAILED: %s\n' "$*" >&2; exit 1; }

installed() {
  [ -x "$PY" ] && "$PY" - "$PIN_LLMCOMPRESSOR" <<'PYEOF' >/dev/null 2>&1
import sys, importlib.metadata as m
assert m.version("llmcompressor") == sys.argv[1]
from llmcompressor.modifiers.gptq.gptq_quantize import quantize_weight  # noqa: F401  the routine quantize.py calls
PYEOF
}

if installed; then
  step "already installed: $VENV has llmcompressor $PIN_LLMCOMPRESSOR; nothing changed"
  exit 0
fi
if [ ! -x "$PY" ]; then
  PYTHON="${PYTHON:-$(command -v python3.11 || command -v python3)}" || fail "no python3.11 or python3 on PATH"
  "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' || fail "$PYTHON is older than 3.10"
  step "1/3 create $VENV with $PYTHON ($("$PYTHON" -V 2>&1))"
  "$PYTHON" -m venv "$VENV" || fail "$PYTHON -m venv failed (apt-get install python3-venv)"
fi
"$PY" -m pip install -q --upgrade pip || fail "could not upgrade pip (network?)"
step "2/3 torch==$PIN_TORCH, CPU build${TORCH_INDEX:+ from $TORCH_INDEX}"
if [ -n "$TORCH_INDEX" ]; then
  "$PY" -m pip install -q "torch==$PIN_TORCH" --index-url "$TORCH_INDEX" || fail "torch $PIN_TORCH install failed"
else
  "$PY" -m pip install -q "torch==$PIN_TORCH" || fail "torch $PIN_TORCH install failed"
fi
step "3/3 llmcompressor==$PIN_LLMCOMPRESSOR (pins compressed-tensors 0.19.0), numpy, safetensors, tqdm"
"$PY" -m pip install -q "torch==$PIN_TORCH" "llmcompressor==$PIN_LLMCOMPRESSOR" numpy safetensors tqdm \
  || fail "llmcompressor $PIN_LLMCOMPRESSOR install failed"
installed || fail "$VENV: llmcompressor $PIN_LLMCOMPRESSOR installed but its GPTQ routine does not import"
step "done: $VENV ($(du -sh "$VENV" | cut -f1)); next: drafter/quantize.py (drafter/README.md)"
