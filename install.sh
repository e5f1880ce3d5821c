#!/usr/bin/env bash
# Install the serving stack into ./venv: Python 3.12 (3.11 accepted), vllm==0.28.0 (torch 2.13.0),
# this package, the vLLM patch series, then `verify.sh --install`. Safe to run again: a second
# run changes nothing and says so. Env: QS_VENV (default ./venv), PYTHON (interpreter to use).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$ROOT"
VENV="${QS_VENV:-$ROOT/venv}"
PY="$VENV/bin/python"
PIN_VLLM=$(sed -n 's/^VLLM_PIN = "\(.*\)"/\1/p' qwen_serving/__init__.py)
step() { printf '[install] %s\n' "$*"; }
fail() { printf '[install] FAILED at step "%s": %s\n' "$1" "$2" >&2; exit 1; }

installed() {  # venv present, pins satisfied, package importable, series applied
  [ -x "$PY" ] || return 1
  [ "$("$PY" -c 'import importlib.metadata as m; print(m.version("vllm"))' 2>/dev/null)" = "$PIN_VLLM" ] || return 1
  "$PY" -c 'import qwen_serving' 2>/dev/null || return 1
  "$PY" -m qwen_serving.patchset verify >/dev/null 2>&1
}

if installed && bash verify.sh --install --quiet >/dev/null 2>&1; then
  echo "[install] already installed: $VENV has vllm $PIN_VLLM with the patch series applied; nothing changed"
  exit 0
fi

# Why a Python cannot make the venv, or nothing when it can: it runs (a pyenv shim for a version pyenv
# lacks exits 127), it is >= 3.11, and it has venv and ensurepip (Debian ships them as python3.X-venv).
unusable() {
  local out rc=0
  out=$("$1" -c 'import sys
v = sys.version_info
print("%d.%d.%d" % v[:3])
if v < (3, 11): sys.exit(3)
import venv, ensurepip' 2>&1) || rc=$?
  case "$rc" in
    0) return 1 ;;
    3) echo "Python $(head -n 1 <<<"$out"), need >= 3.11" ;;
    *) if [[ "$out" =~ ^3\.[0-9]+\.[0-9]+ ]] && grep -q "No module named" <<<"$out"; then
         local minor; minor=$(head -n 1 <<<"$out" | cut -d. -f1,2)
         echo "Python $(head -n 1 <<<"$out") has no venv module: apt-get install python$minor-venv"
       else
         echo "does not run (exit $rc: $(tail -n 1 <<<"$out"))"
       fi ;;
  esac
}

choose_python() {  # PYTHON if set (no fallback), else the first usable of python3.12, python3.11, python3
  local cand path why
  if [ -n "${PYTHON:-}" ]; then
    why=$(unusable "$PYTHON") && fail "create venv" "PYTHON=$PYTHON: $why; Python >= 3.11 is required (3.12 preferred)"
    echo "$PYTHON"; return
  fi
  for cand in python3.12 python3.11 python3; do
    path=$(command -v "$cand") || continue
    if why=$(unusable "$path"); then
      step "skipping $cand ($path): $why" >&2
    else
      echo "$path"; return
    fi
  done
  fail "create venv" "no usable Python >= 3.11 (tried python3.12, python3.11, python3 on PATH); install Python 3.12 with its venv module (apt-get install python3.12-venv) or set PYTHON=/path/to/python3.12"
}

if [ ! -x "$PY" ]; then
  PYTHON=$(choose_python)
  step "1/4 create $VENV with $PYTHON ($("$PYTHON" -V 2>&1))"
  "$PYTHON" -m venv "$VENV" || fail "create venv" "$PYTHON -m venv failed; install the venv module (apt-get install python3.12-venv)"
else
  step "1/4 reuse $VENV ($("$PY" -V 2>&1))"
fi

step "2/4 pip install vllm==$PIN_VLLM (pins torch 2.13.0) and qwen-serving[serve]; first time downloads ~5 GB"
"$PY" -m pip install -q --upgrade pip || fail "pip install" "could not upgrade pip (network?)"
"$PY" -m pip install --progress-bar on -e "${ROOT}[serve]" \
  || fail "pip install" "pip could not install the pinned stack; check network and disk, then re-run install.sh"

step "3/4 apply the vLLM patch series (patches/series)"
"$PY" -m qwen_serving.patchset apply \
  || fail "patch series" "see the patch named above; a vLLM other than $PIN_VLLM needs: $PY -m pip install vllm==$PIN_VLLM"

step "4/4 verify.sh --install"
bash verify.sh --install || fail "verify" "a check above failed; fix it and re-run install.sh"
step "done: start a server with 'bash single-user/start_qwen.sh' or 'bash batch/start_qwen.sh'"
