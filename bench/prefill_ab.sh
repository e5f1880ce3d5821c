#!/usr/bin/env bash
# Prefill A/B between two servers or two server configs, arms interleaved (A B, B A, ...), each prompt length
# measured again until both arms reproduce within the tolerance (default 0.5%):
#   bash bench/prefill_ab.sh TAG --a-url URL [--a-cmd CMD] --b-url URL [--b-cmd CMD] [--lens 1024,4096,16384]
# With --X-cmd the arm's server is started from CMD (it must listen at --X-url) and stopped once per round, so
# two configs can share one GPU. Writes bench/results/TAG-prefill-ab.json; exit 1 when a length never reproduced.
# All logic is in bench/repeats.py (measurements by bench/harness.py); --help lists every option.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
if [ -z "${PYTHON:-}" ] && [ -x "$ROOT/venv/bin/python" ]; then PY="$ROOT/venv/bin/python"; fi
exec "$PY" "$ROOT/bench/repeats.py" prefill-ab "$@"
