#!/usr/bin/env bash
# The body of batch/start_qwen.sh and single-user/start_qwen.sh: bash qwen_serving/start_server.sh MODE [ARG]
# First start runs what is missing (install.sh, download, prepare steps; each resumes where it stopped and
# is a no-op once done), then execs the command the serve plan builds. Everything else is the plan's.
# --prepare runs the missing steps and stops (docker-compose.yml's prepare services: no GPU needed, no preflight).
set -euo pipefail
MODE="$1"; shift
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=venv/bin/python
[ -x "$PY" ] || PY=python3  # the plan is standard library only: it runs before install.sh
# .env (Compose's syntax) for the plan and every first-start step; a variable already set wins
dotenv_exports="$("$PY" -m qwen_serving.dotenv .env)"
eval "$dotenv_exports"
refused() {  # in the image (its Dockerfile sets QS_CONTAINER) the knobs live in the host's .env
  if [ -n "${QS_CONTAINER:-}" ]; then
    echo "qwen-serving: in Docker, knobs go in .env beside docker-compose.yml (a key: VLLM_API_KEY=...);" \
         "then run again: docker compose --profile $MODE up -d" >&2
  fi
  exit 2
}
case "${1:-}" in
  --dry-run | explain | --missing) "$PY" -m qwen_serving.plan "$MODE" "$@" || refused; exit 0 ;;
  "" | --prepare) ;;
  *) echo "usage: start_qwen.sh [--dry-run | explain | --missing | --prepare]" >&2; exit 2 ;;
esac
steps="$("$PY" -m qwen_serving.plan "$MODE" --missing)" || refused  # a refused configuration stops here
need_disk=(); grep -q "prepare/download.py" <<<"$steps" && need_disk=(--need-disk)
# serving: GPU, driver, VRAM, Python (and disk for a download) checked before anything heavy
[ "${1:-}" = --prepare ] || "$PY" -m qwen_serving.preflight "${need_disk[@]}" || exit 2
total=$(grep -c . <<<"$steps" || true)
n=0
while IFS= read -r step; do
  [ -n "$step" ] || continue
  n=$((n + 1))
  echo "== first start, step $n/$total: $step"
  bash -c "$step"
done <<<"$steps"
[ "${1:-}" != --prepare ] || exit 0
exec venv/bin/python -m qwen_serving.plan "$MODE" run
