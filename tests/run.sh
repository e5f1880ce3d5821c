#!/usr/bin/env bash
# The one test command (CPU). Creates or reuses a light venv that imports vLLM 0.28.0,
# copies the pristine vllm package, applies patches/series to the copy and runs pytest
# against it on two workers (pytest-xdist). GPU tests (-m gpu) are skipped here; tests/gpu/README.md runs them.
#   bash tests/run.sh [pytest args...]      e.g. bash tests/run.sh -k patchset -x   (-n 0: one process)
#   bash tests/run.sh -n 0 tests/test_synth.py  (arguments naming tests/... run those alone)
# Env: QS_CPU_VENV (default .venv-cpu), QS_PATCHED_ROOT (where the patched copy goes and stays; default a copy of
# this run's own under build/, removed at exit).
# The shell linter (shellcheck, a system package) is installed with apt-get when missing and this runs as root;
# elsewhere tests/test_lint.py fails with the command to install it.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="${QS_CPU_VENV:-$ROOT/.venv-cpu}"
PY="$VENV/bin/python"
step() { printf '== %s\n' "$*"; }
fail() { printf 'tests/run.sh: %s\n' "$*" >&2; exit 1; }

# 1. venv, rebuilt only when the pinned lists or the Python change
stamp="$(cat tests/cpu-requirements.txt tests/dev-requirements.txt; python3 --version)"
stamp="$(printf '%s' "$stamp" | sha256sum | cut -c1-16)"
if [ "$(cat "$VENV/.qs-stamp" 2>/dev/null)" != "$stamp" ]; then
  step "creating CPU venv $VENV (torch 2.13.0 CPU, vllm 0.28.0 --no-deps; ~1 min)"
  rm -rf "$VENV"
  python3 -m venv "$VENV" || fail "python3 -m venv failed (install python3-venv)"
  # uv (from PyPI) downloads and installs in parallel: the lists below in under half of pip's time. torch stays
  # with pip, which honours the machine's pip configuration (a local CPU wheel where one is configured); first,
  # as its PyPI build pulls triton too, which tests/cpu-requirements.txt pins.
  "$PY" -m pip install -q uv==0.13.8 || fail "pip install uv==0.13.8 failed"
  "$PY" -m pip install -q torch==2.13.0 || fail "torch 2.13.0 install failed"
  UV=("$VENV/bin/uv" pip install -q --python "$PY" --compile-bytecode)
  "${UV[@]}" --no-deps vllm==0.28.0 -r tests/cpu-requirements.txt \
    || fail "vllm 0.28.0 or the light deps (tests/cpu-requirements.txt) failed"
  "${UV[@]}" -r tests/dev-requirements.txt || fail "test tools (tests/dev-requirements.txt) failed"
  echo "$stamp" > "$VENV/.qs-stamp"
else
  step "reusing CPU venv $VENV"
fi
SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
PRISTINE="$SITE/vllm"
[ -f "$PRISTINE/_version.py" ] || fail "no vllm package in $SITE (delete $VENV and re-run)"

if ! command -v shellcheck >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  step "installing shellcheck (apt-get)"
  (apt-get update -qq && apt-get install -y -qq shellcheck >/dev/null) || echo "tests/run.sh: could not install shellcheck"
fi

# 2. a patched copy of the pristine package; the venv's own copy is never modified. Without QS_PATCHED_ROOT each run
# has its own copy, removed at exit: two runs in one checkout would otherwise rebuild the same tree under each other
if [ -n "${QS_PATCHED_ROOT:-}" ]; then
  PATCHED_ROOT="$QS_PATCHED_ROOT"
else
  PATCHED_ROOT="$ROOT/build/vllm-patched.$$"
  trap 'rm -rf "$PATCHED_ROOT"' EXIT
fi
step "copying pristine vllm to $PATCHED_ROOT and applying patches/series"
rm -rf "$PATCHED_ROOT"; mkdir -p "$PATCHED_ROOT"
cp -a "$PRISTINE" "$PATCHED_ROOT/vllm"
PYTHONPATH="$ROOT" "$PY" -m qwen_serving.patchset apply --vllm-dir "$PATCHED_ROOT/vllm"

# 3. lint, then pytest against the patched copy
step "ruff"
# tracked files only: a clean clone (CI) has nothing else, and work in progress does not block a run
git ls-files -z -- '*.py' | xargs -0 -r "$VENV/bin/ruff" check
step "pytest (not gpu)"
export QS_PRISTINE_VLLM="$PRISTINE" QS_PATCHED_VLLM="$PATCHED_ROOT/vllm"
export VLLM_TARGET_DEVICE=cpu PYTHONPATH="$PATCHED_ROOT:$ROOT"
rc=0
# the whole suite, unless the arguments name test files or folders themselves
targets=(tests)
for arg in "$@"; do
  case "$arg" in tests/*) [ -e "${arg%%::*}" ] && targets=() ;; esac
done
# --dist loadfile: a module's tests on one worker, so its module fixtures (vLLM children, checkpoints, servers)
# are built once, not once per worker
"$PY" -m pytest -m "not gpu" -p no:cacheprovider -n 2 --dist loadfile "$@" "${targets[@]}" || rc=$?
[ "$rc" -eq 5 ] && fail "pytest collected no tests"
exit "$rc"
