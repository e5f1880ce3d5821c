#!/usr/bin/env bash
# N repeats of the single-stream C1 row against a running server, with mean and spread of the decode rate and
# tokens per step: bash bench/real_rep.sh TAG N [TEMPERATURE] [--url URL] [--harness-arg=--ignore-eos]
# TEMPERATURE 0 = greedy (default: the model's own sampling). Writes bench/results/TAG-real-rep.json.
# All logic is in bench/repeats.py (measurements by bench/harness.py); --help lists every option.
# Python: $PYTHON, else the repo's venv/, else python3 (it must import vllm for `vllm bench serve`).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
if [ -z "${PYTHON:-}" ] && [ -x "$ROOT/venv/bin/python" ]; then PY="$ROOT/venv/bin/python"; fi
exec "$PY" "$ROOT/bench/repeats.py" real-rep "$@"
