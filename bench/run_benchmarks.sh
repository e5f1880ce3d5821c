#!/usr/bin/env bash
# Benchmark a running vLLM server: bash bench/run_benchmarks.sh batch|single [--prefill] [--long] [--tag T] [--url URL]
# All logic is in bench/harness.py (+ bench/report.py); --help lists every option.
# Python: $PYTHON, else the repo's venv/, else python3 (it must import vllm for `vllm bench serve`).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ -n "${PYTHON:-}" ]; then
  PY="$PYTHON"
elif [ -x "$ROOT/venv/bin/python" ]; then
  PY="$ROOT/venv/bin/python"
else
  PY="python3"
fi
exec "$PY" "$ROOT/bench/harness.py" "$@"
