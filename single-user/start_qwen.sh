#!/usr/bin/env bash
# Single-user mode: one or a few users, MTP or DFlash2 speculative decoding.
# Every knob is an environment variable: single-user/README.md, or python3 -m qwen_serving.knobs --markdown --mode single
#   bash single-user/start_qwen.sh             first start installs and prepares what is missing, then serves
#   bash single-user/start_qwen.sh --dry-run   the exported variables and the exact vllm command
#   bash single-user/start_qwen.sh explain     every derived value and its rule; pool, seats, longest context
set -euo pipefail
MODE="single"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=venv/bin/python
[ -x "$PY" ] || PY=python3  # the plan is standard library only: it runs before install.sh
case "${1:-}" in
  --dry-run | explain | --missing) exec "$PY" -m qwen_serving.plan "$MODE" "$@" ;;
  "") ;;
  *) echo "usage: $0 [--dry-run | explain | --missing]" >&2; exit 2 ;;
esac
steps="$("$PY" -m qwen_serving.plan "$MODE" --missing)"  # a refused configuration stops here
total=$(grep -c . <<<"$steps" || true)
n=0
while IFS= read -r step; do
  [ -n "$step" ] || continue
  n=$((n + 1))
  echo "== first start, step $n/$total: $step"
  bash -c "$step"  # every step resumes where it stopped and is a no-op once done
done <<<"$steps"
exec venv/bin/python -m qwen_serving.plan "$MODE" run
