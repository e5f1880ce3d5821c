#!/usr/bin/env bash
# Build the MTP draft head from the running single-user server's own outputs (prepare/calibrate.py):
# counts a bundled prompt set (resumable), builds the head, then asks for a restart.
#   bash single-user/calibrate.sh [--tokens N] [--proxy PORT]    (--help for every option)
# Same knobs as start_qwen.sh: run it with the environment the server was started with.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=venv/bin/python
[ -x "$PY" ] || PY=python3
exec "$PY" prepare/calibrate.py "$@"
