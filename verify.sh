#!/usr/bin/env bash
# Check an install and a running server: one PASS/WARN/FAIL line per check; exit 1 if any check FAILs.
#   bash verify.sh [--install] [--require-gpu] [--no-server] [--mode MODE] [--log FILE] [--quiet]
#   --install      checks the software only (used by install.sh and the Docker build: no GPU, no model yet)
#   --require-gpu  a missing CUDA GPU is a FAIL instead of a WARN
#   --no-server    do not probe a running server (a server that is down is a FAIL otherwise)
#   --mode MODE    batch or single (default): whose knobs give the server's HOST and PORT
#   --log FILE     the server's output: attention backend, KV pool, spec decode as vLLM logged them
#   --quiet        print FAIL lines only
# Env: QS_VENV (default ./venv; falls back to python3 on PATH), MODEL (model dir to check), the launchers'
# knobs and .env (HOST, PORT, VLLM_API_KEY or api_key.txt) for the server probe.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$ROOT" || exit 1
INSTALL_ONLY=0; REQUIRE_GPU=0; QUIET=0; SERVER=1; probe_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --install) INSTALL_ONLY=1 ;;
    --require-gpu) REQUIRE_GPU=1 ;;
    --no-server) SERVER=0 ;;
    --mode | --log)
      [ $# -ge 2 ] || { echo "verify.sh: $1 needs a value (see --help)" >&2; exit 2; }
      probe_args+=("$1" "$2"); shift ;;
    --quiet) QUIET=1 ;;
    -h|--help) sed -n '2,11p' "$0"; exit 0 ;;
    *) echo "verify.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
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

if [ "$INSTALL_ONLY" = 0 ] && [ "$SERVER" = 1 ]; then
  # /health, one chat request, KV pool, attention backend, spec decode (bench/server_check.py)
  while IFS= read -r status; do
    line "${status%% *}" "${status#* }"
  done < <(PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m bench.server_check "${probe_args[@]}" 2>&1 \
           | sed -E 's/^(PASS|WARN|FAIL) +/\1 /; t; s/^/FAIL /')
fi

[ "$failures" -eq 0 ]
