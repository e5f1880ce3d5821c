#!/usr/bin/env bash
# Runs ON THE GPU MACHINE, from the repo root, after the pinned stack is in $SITE (run_on_device.sh or
# .whl/install-on-device.sh): install tests/gpu/stage-flashinfer.sh's wheels into $FLASHINFER_SITE (default
# /tmp/flashinfer-site), beside the stack and not into it, so that only the servers that ask for FlashInfer see it
# (bench/gpu/product_visit.py's mtp-long puts it last on that server's PYTHONPATH, and $FLASHINFER_SITE/bin, for
# ninja, first on its PATH); with it in $SITE, vLLM's has_flashinfer() would turn true for every server of the visit
# (FlashInfer top-k, its autotune warm-up). The wheels come from .whl/flashinfer/ when carried whole, else from the
# parts $STAGE/flashinfer.NN and their list $STAGE/flashinfer.sha256 (copied there like the quant parts). Then it
# checks what FlashInfer's JIT and vLLM need on PATH (nvcc, as vLLM's has_flashinfer() and FlashInfer's build find it;
# ninja; cuRAND's headers, linked from the image's nvidia-curand where the toolkit lacks them; nvcc building a sm_90a
# shared object that includes them with the image's host compiler, linked against libcuda and libcudart as FlashInfer
# links) and that vLLM 0.28.0's FLASHINFER
# backend imports, and writes the marker $FLASHINFER_SITE/.qs-flashinfer. Run again, it keeps a site whose marker
# names the staged version (nothing reinstalled) and checks again.
# The installed files get a fixed old mtime (also the stack's tvm_ffi headers, which FlashInfer's kernels include):
# FlashInfer leaves freshness to ninja, and a JIT cache carried from an earlier visit (pack_jit_cache.sh,
# flashinfer-cache.*) would otherwise be older than sources pip has just written, and be rebuilt.
# Exit: 0 ok; 11 no wheels, a sha256 mismatch or the install failed; 12 nvcc, ninja or the host compiler missing
# or failing; 13 flashinfer or vLLM's FLASHINFER backend does not import.
set -uo pipefail
SITE="${SITE:-/tmp/site}"; FLASHINFER_SITE="${FLASHINFER_SITE:-/tmp/flashinfer-site}"; STAGE="${STAGE:-/tmp/stage}"
VERSION=0.6.16.post3
MARKER="$FLASHINFER_SITE/.qs-flashinfer"
OLD_MTIME='2000-01-01 00:00:00 UTC'
say() { printf '[install-flashinfer] %s\n' "$*"; }
fail() { rm -f "$MARKER"; say "FAILED: $2"; exit "$1"; }
# the PATH the FlashInfer servers get (bench/gpu/product_visit.py, flashinfer_path): the staged ninja, the CUDA bin
export PATH="$FLASHINFER_SITE/bin:${CUDA_HOME:-/usr/local/cuda}/bin:$PATH"

[ -d "$SITE/vllm" ] || fail 11 "no vllm in $SITE: install the stack first (tests/gpu/README.md)"
if [ -f "$MARKER" ] && grep -qx "flashinfer $VERSION" "$MARKER"; then
  say "flashinfer $VERSION already in $FLASHINFER_SITE ($MARKER); checking again"
else
  if compgen -G ".whl/flashinfer/*.whl" >/dev/null; then
    WHEELS=.whl/flashinfer
  elif compgen -G "$STAGE/flashinfer.[0-9]*" >/dev/null; then
    [ -f "$STAGE/flashinfer.sha256" ] || fail 11 "no $STAGE/flashinfer.sha256 (carry it with the parts)"
    (cd "$STAGE" && sha256sum -c --quiet flashinfer.sha256) || fail 11 "the parts in $STAGE do not match flashinfer.sha256"
    rm -rf /tmp/flashinfer-pay
    mkdir -p /tmp/flashinfer-pay || fail 11 "cannot create /tmp/flashinfer-pay"
    cat "$STAGE"/flashinfer.[0-9]* | tar -xf - -C /tmp/flashinfer-pay || fail 11 "the parts $STAGE/flashinfer.* do not unpack"
    WHEELS=/tmp/flashinfer-pay/flashinfer
  else
    fail 11 "no .whl/flashinfer/*.whl and no $STAGE/flashinfer.NN parts (run tests/gpu/stage-flashinfer.sh here and carry them)"
  fi
  (cd "$WHEELS" && sha256sum -c --quiet SHA256SUMS) || fail 11 "the wheels in $WHEELS do not match their SHA256SUMS"
  say "$(find "$WHEELS" -name '*.whl' | wc -l) wheels from $WHEELS into $FLASHINFER_SITE"
  rm -rf "$FLASHINFER_SITE.new"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$FLASHINFER_SITE.new" \
    "$WHEELS"/*.whl || fail 11 "pip install --target $FLASHINFER_SITE.new failed"
  find "$FLASHINFER_SITE.new" -exec touch -h -d "$OLD_MTIME" {} + || fail 11 "cannot set the mtimes in $FLASHINFER_SITE.new"
  rm -rf "$FLASHINFER_SITE"
  mv "$FLASHINFER_SITE.new" "$FLASHINFER_SITE" || fail 11 "cannot move $FLASHINFER_SITE.new to $FLASHINFER_SITE"
fi
if [ -d "$SITE/tvm_ffi" ]; then
  find "$SITE/tvm_ffi" -exec touch -h -d "$OLD_MTIME" {} + || fail 11 "cannot set the mtimes in $SITE/tvm_ffi"
fi

nvcc_path=$(command -v nvcc) || fail 12 "no nvcc on PATH nor in \${CUDA_HOME:-/usr/local/cuda}/bin (vLLM's has_flashinfer() needs it, FlashInfer's JIT runs it)"
nvcc_release=$(nvcc --version | sed -n 's/.*release \([0-9.]*\),.*/\1/p')
[ -n "$nvcc_release" ] || fail 12 "$nvcc_path --version gives no release"
ninja_version=$(ninja --version 2>&1) || fail 12 "ninja does not run from $(command -v ninja || echo PATH): $ninja_version"
# FlashInfer's sm90 fp8 prefill includes CUTLASS's tensor_fill.h, which includes curand_kernel.h: a CUDA 13.0 toolkit
# without cuRAND's headers failed that JIT build here (2026-12-04). Where $cuda_home/include (the toolkit FlashInfer's
# JIT takes: CUDA_HOME, else nvcc's) lacks them, the nvidia-curand wheel's copy (the image has nvidia-curand 10.4.0.35)
# is linked into FlashInfer's own include folder, which its JIT puts on every include path.
cuda_home="${CUDA_HOME:-${CUDA_PATH:-$(dirname "$(dirname "$nvcc_path")")}}"
fi_include="$FLASHINFER_SITE/flashinfer/data/include"
if [ ! -f "$cuda_home/include/curand_kernel.h" ] && [ ! -e "$fi_include/curand_kernel.h" ]; then
  purelib=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  curand=$(find "$SITE"/nvidia/*/include/ "$purelib"/nvidia/*/include/ -maxdepth 1 -name curand_kernel.h 2>/dev/null | head -n 1)
  [ -n "$curand" ] || fail 12 "no curand_kernel.h in $cuda_home/include, $SITE/nvidia/*/include or $purelib/nvidia/*/include (FlashInfer's sm90 fp8 prefill includes it)"
  for h in "$(dirname "$curand")"/curand*.h; do ln -sf "$h" "$fi_include/" || fail 12 "cannot link $h into $fi_include"; done
  say "cuRAND's headers from $(dirname "$curand") linked into $fi_include ($cuda_home/include has none)"
fi
probe=$(mktemp -d /tmp/flashinfer-probe.XXXXXX)
printf '#include <curand_kernel.h>\n__global__ void qs_probe(float *x) { x[threadIdx.x] *= 2.0f; }\n' > "$probe/probe.cu"
# linked as FlashInfer links its modules (-lcuda: the driver's library or the toolkit's stub; this machine, which
# has neither, failed there)
if ! out=$(nvcc -shared -Xcompiler -fPIC -isystem "$fi_include" -gencode=arch=compute_90a,code=sm_90a \
    "$probe/probe.cu" -o "$probe/probe.so" -L"$cuda_home/lib64" -L"$cuda_home/lib64/stubs" -lcuda -lcudart 2>&1); then
  rm -rf "$probe"
  fail 12 "nvcc cannot build and link (-lcuda -lcudart) a sm_90a shared object including curand_kernel.h: $(tail -n 3 <<< "$out")"
fi
rm -rf "$probe"
say "nvcc $nvcc_release ($nvcc_path) builds sm_90a; ninja $ninja_version ($(command -v ninja))"

got=$(PYTHONPATH="$SITE:$FLASHINFER_SITE" python3 -c '
import flashinfer
import vllm.v1.attention.backends.flashinfer  # noqa: F401  what the FLASHINFER backend imports
from vllm.utils.flashinfer import has_flashinfer
print(flashinfer.__version__, has_flashinfer())' 2>&1 | tail -n 1)
[ "$got" = "$VERSION True" ] || fail 13 "with $FLASHINFER_SITE after $SITE, flashinfer / vLLM's backend / has_flashinfer(): got '$got'"
say "flashinfer $VERSION and vLLM's FLASHINFER backend import; has_flashinfer() is True"
printf 'flashinfer %s\nnvcc %s %s\nninja %s\n' "$VERSION" "$nvcc_release" "$nvcc_path" "$ninja_version" > "$MARKER"
say "marker $MARKER written"
