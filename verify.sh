#!/usr/bin/env bash
# Check an install: one PASS/WARN/FAIL line per check; exit 1 if any check FAILs.
#   bash verify.sh [--install] [--require-gpu] [--no-server] [--quiet]
#   --install      checks the software only (used by install.sh and the Docker build: no GPU, no model yet)
#   --require-gpu  a missing CUDA GPU is a FAIL instead of a WARN
#   --no-server    do not probe a running server (the server probe is not written yet)
#   --quiet        print FAIL lines only
# Env: QS_VENV (default ./venv; falls back to python3 on PATH), MODEL (model dir to check).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$ROOT" || exit 1
INSTALL_ONLY=0; REQUIRE_GPU=0; QUIET=0
for arg in "$@"; do
  case "$arg" in
    --install) INSTALL_ONLY=1 ;;
    --require-gpu) REQUIRE_GPU=1 ;;
    --no-server) ;;
    --quiet) QUIET=1 ;;
    -h|--help) sed -n '2,9p' "$0"; exit 0 ;;
    *) echo "verify.sh: unknown option $arg (see --help)" >&2; exit 2 ;;
  esac
done
VENV="${QS_VENV:-$ROOT/venv}"
PY="$VENV/bin/python"; [ -x "$PY" ] || PY="$(command -v python3)"
PIN_VLLM=$(sed -n 's/^VLLM_PIN = "\(.*\)"/\1/p' qwen_serving/__init__.py)
MODEL="${MODEL:-$ROOT/models/Qwen3.8-27B-W4A16-AutoRound}"
failures=0
line() {  # level, message
  [ "$1" = FAIL ] && failures=$((failures + 1))
  [ "$QUIET" = 1 ] && [ "$1" != FAIL ] && return
  printf '%-4s %s\n' "$1" "$2"
}

if "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
  line PASS "python: $PY ($("$PY" -V 2>&1))"
else
  line FAIL "python: $PY is missing or older than 3.11; run: bash install.sh"
fi

found=$("$PY" -c 'import importlib.metadata as m; print(m.version("vllm"))' 2>/dev/null || echo "not installed")
if [ "$found" = "$PIN_VLLM" ]; then
  line PASS "vllm: $found (the pin)"
else
  line FAIL "vllm: $found, need $PIN_VLLM; run: bash install.sh"
fi

if out=$(PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m qwen_serving.patchset verify 2>&1); then
  line PASS "patches: $(tail -n 1 <<<"$out")"
else
  line FAIL "patches: $(tail -n 1 <<<"$out"); run: $PY -m qwen_serving.patchset apply"
fi

if [ "$INSTALL_ONLY" = 0 ]; then
  gpu=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -n 1)
  if [ -n "$gpu" ]; then
    line PASS "gpu: $gpu"
  elif [ "$REQUIRE_GPU" = 1 ]; then
    line FAIL "gpu: no CUDA GPU visible (nvidia-smi found none)"
  else
    line WARN "gpu: no GPU (nvidia-smi found none); serving needs a 24 GB CUDA GPU"
  fi
  if [ -f "$MODEL/config.json" ]; then
    # each prepare step done / missing, shards complete, tokenizer present (qwen_serving/checkpoint/prepare_status.py)
    while IFS= read -r status; do
      line "${status%% *}" "${status#* }"
    done < <(PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m qwen_serving.checkpoint.prepare_status "$MODEL" 2>&1 \
             | sed -E 's/^(PASS|WARN|FAIL) +/\1 /; t; s/^/FAIL /')
  else
    line WARN "model: $MODEL not present; the launchers fetch it on first start (or set MODEL=DIR)"
  fi
fi

[ "$failures" -eq 0 ]
