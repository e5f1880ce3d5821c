#!/usr/bin/env bash
# The full-shape GPU flow (bench/gpu/README.md): generate the random-weight 27B checkpoint, then for
# each config start a server, run the harness (single + batch), api_smoke and step_profile against
# it, stop it, and merge its figures into OUT/h200-full-<config>.json. Everything lands in one flat
# folder OUT; progress goes to stdout (run it detached, see the README).
#   bash bench/gpu/run_full.sh OUT [CONFIG ...]
# CONFIG: stock | stock-mtp4 | stock-mtp7 | patched | patched-mtp4 | patched-mtp7 (default: all six;
# the patched ones need PATCHED_SITE, a folder holding the patched vllm package).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
OUT="${1:?usage: run_full.sh OUT [CONFIG ...]}"
shift
CONFIGS=("$@")
[ ${#CONFIGS[@]} -gt 0 ] || CONFIGS=(stock stock-mtp4 stock-mtp7 patched patched-mtp4 patched-mtp7)
SITE="${SITE:-/tmp/site}"                 # the staged stock stack (shared/device/README.md)
CKPT="${CKPT:-/tmp/qwen-full}"            # generated here, never carried
PORT="${PORT:-18020}"
PY="${PY:-python3}"
for config in "${CONFIGS[@]}"; do
  case "$config" in
    stock|stock-mtp4|stock-mtp7|patched|patched-mtp4|patched-mtp7) ;;
    *) echo "run_full.sh: unknown config '$config'" >&2; exit 2 ;;
  esac
done
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
log() { printf '[%s] %s\n' "$(date +%H:%M:%S)" "$*"; }
healthy() { "$PY" -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$PORT/health', timeout=5)" 2>/dev/null; }

export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_DISABLED_KERNELS=MacheteLinearKernel VLLM_SERVER_DEV_MODE=1
"$PY" -c 'import pandas' 2>/dev/null || log "WARN: no pandas here: vllm bench serve cannot read the custom prompts file (single mode fails)"
"$PY" -c 'import matplotlib' 2>/dev/null || log "WARN: no matplotlib here: JSON only, no PNGs"

if [ ! -f "$CKPT/config.json" ]; then
  log "generating the full-shape checkpoint in $CKPT"
  PYTHONPATH="$ROOT:$SITE" "$PY" -m qwen_serving.synth --size full --out "$CKPT" --seed 0
fi

NOTE="Random weights: draft acceptance and tokens per step mean nothing here; compare ms_per_step of the mtp configs with the plain config (the cost of a k-draft verify step against a decode step)."
SERVER_PID=""
stop_server() {
  if [ -n "$SERVER_PID" ]; then
    kill -- "-$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" 2>/dev/null || true
    SERVER_PID=""
  fi
}
trap stop_server EXIT

for config in "${CONFIGS[@]}"; do
  pypath="$SITE"
  if [[ "$config" == patched* ]]; then
    if [ -z "${PATCHED_SITE:-}" ]; then
      log "$config: skipped (set PATCHED_SITE to the folder holding the patched vllm package)"
      continue
    fi
    pypath="$PATCHED_SITE:$SITE"
  fi
  spec=()
  case "$config" in
    *-mtp4) spec=(--speculative-config '{"method": "mtp", "num_speculative_tokens": 4}') ;;
    *-mtp7) spec=(--speculative-config '{"method": "mtp", "num_speculative_tokens": 7}') ;;
  esac
  traces="$OUT/traces-$config"
  mkdir -p "$traces"
  serve=("$PY" -m vllm.entrypoints.cli.main serve "$CKPT" --port "$PORT" --served-model-name qwen3.8-27b
    --language-model-only --gdn-prefill-backend triton --max-model-len 40960 --gpu-memory-utilization 0.9
    --profiler-config "{\"profiler\": \"torch\", \"torch_profiler_dir\": \"$traces\", \"torch_profiler_use_gzip\": false, \"torch_profiler_with_stack\": false}"
    "${spec[@]}")
  printf '%q ' "${serve[@]}" > "$OUT/h200-full-$config.serve-cmd.txt"
  log "$config: starting the server (log: $OUT/h200-full-$config.server.log)"
  PYTHONPATH="$pypath" setsid "${serve[@]}" > "$OUT/h200-full-$config.server.log" 2>&1 &
  SERVER_PID=$!
  for _ in $(seq 180); do
    healthy && break
    kill -0 "$SERVER_PID" 2>/dev/null || { log "$config: server died (see its log)"; SERVER_PID=""; break; }
    sleep 5
  done
  if [ -z "$SERVER_PID" ] || ! healthy; then
    log "$config: server not up, next config"; stop_server; continue
  fi
  export PYTHONPATH="$ROOT:$pypath"
  harness=(bash "$ROOT/bench/run_benchmarks.sh")
  common=(--url "http://127.0.0.1:$PORT" --out "$OUT" --ignore-eos --note "$NOTE" --meta "config=$config" --force)
  if [[ "$config" == *-mtp* ]]; then
    log "$config: step cost at C1 (single, C1 only)"
    PYTHON="$PY" "${harness[@]}" single --cohorts 1 --tag "h200-full-$config-single" "${common[@]}" || log "$config: harness reported failures"
  else
    log "$config: harness single --prefill --long"
    PYTHON="$PY" "${harness[@]}" single --prefill --long --tag "h200-full-$config-single" "${common[@]}" || log "$config: harness reported failures"
    log "$config: harness batch"
    PYTHON="$PY" "${harness[@]}" batch --tag "h200-full-$config-batch" "${common[@]}" || log "$config: harness reported failures"
    log "$config: step profile C1, C64"
    "$PY" "$ROOT/bench/step_profile.py" --url "http://127.0.0.1:$PORT" --trace-dir "$traces" --model-dir "$CKPT" \
      --out "$OUT/h200-full-$config-steps.json" || log "$config: step_profile failed"
  fi
  log "$config: api_smoke"
  "$PY" "$ROOT/bench/api_smoke.py" --url "http://127.0.0.1:$PORT" --json "$OUT/h200-full-$config-api.json" \
    || log "$config: api_smoke reported failures"
  stop_server
  "$PY" - "$OUT" "$config" <<'EOF'
import json, sys
from pathlib import Path
from qwen_serving.benchreport import write_json_atomic
out, config = Path(sys.argv[1]), sys.argv[2]
merged = {"config": config, "serve_cmd": (out / f"h200-full-{config}.serve-cmd.txt").read_text()}
for part in ("single", "batch", "steps", "api"):
    path = out / f"h200-full-{config}-{part}.json"
    merged[part] = json.loads(path.read_text()) if path.exists() else None
write_json_atomic(out / f"h200-full-{config}.json", merged)
print(f"wrote {out}/h200-full-{config}.json")
EOF
done
log "done: $OUT"
