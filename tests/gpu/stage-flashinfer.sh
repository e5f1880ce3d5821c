#!/usr/bin/env bash
# Runs HERE (PyPI reachable): the wheels FlashInfer needs on the offline H200 beyond the staged stack, for issue #20
# item 1 (CTX=long: fp8 KV on FlashInfer; bench/gpu/product_visit.py's mtp-long), into .whl/flashinfer/ (git-ignored),
# sha256 pinned, then one tar stream of them in parts of at most PART_MB MiB under .whl/flashinfer-parts/ with
# their sha256 list. On the device: tests/gpu/install-flashinfer.sh (tests/gpu/README.md, "Staging FlashInfer").
#
# What vLLM 0.28.0 needs of FlashInfer there, read from its code and the wheel's:
# - flashinfer-python 0.6.16.post3, the version vLLM 0.28.0 pins: pure Python plus the CUDA/C++ sources and headers
#   (CUTLASS, CCCL, spdlog vendored) that its JIT compiles with nvcc at first use. No flashinfer-cubin or
#   flashinfer-jit-cache: vLLM's FLASHINFER backend on sm90 uses the prebuilt (downloaded) TRT-LLM/XQA kernels only
#   when NVIDIA's artifactory answers, which it cannot offline; the native prefill and decode it falls back to are
#   JIT-built. vLLM's has_flashinfer() wants nvcc on PATH when no cubin package is there.
# - ninja 1.13.2: FlashInfer's JIT runs `ninja` from PATH (vLLM also lists ninja, and the staged stack lacks it).
# Its other requirements are not needed on this path, or are there already: `import flashinfer` and the modules
# vLLM's FLASHINFER backend imports load with torch, numpy, packaging, requests, filelock, jinja2 and tqdm (the image's),
# pynvml (the image's nvidia-ml-py 13.610.43: bench/results/h200-full-stock-batch-run2.json, system_env) and
# apache-tvm-ffi 0.1.11 (staged: ../shared/device/stage-wheels.sh). nvidia-cutlass-dsl, cuda-python, cuda-tile,
# nccl4py, nvidia-cudnn-frontend, einops, tabulate and click serve CuTe-DSL kernels, cuDNN, multi-GPU
# communication, GEMM/MoE paths and the CLI, none of which a GDN model with GDN_PREFILL=triton on one GPU reaches.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
W=.whl/flashinfer
PARTS=.whl/flashinfer-parts
PART_MB=44   # a part plus the tracked tree (~16.7 MB) stays under the 64 MiB a device call carries
PINNED=(
  "flashinfer-python==0.6.16.post3 --hash=sha256:caf686b9b079abe1c9d65ab505698bd325e8072de40afd822f2c74f2ac3bc601"
  "ninja==1.13.2 --hash=sha256:65a24341b5ac09fcadcc37082660be40a94174e51a937fabf6e2cae26225fa2c"
)
PLAT=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp)
PLAT+=(--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any)
die() { echo "stage-flashinfer: $*" >&2; exit 1; }

mkdir -p .whl
work=$(mktemp -d .whl/flashinfer.new.XXXXXX)
trap 'rm -rf "$work"' EXIT
printf '%s\n' "${PINNED[@]}" > "$work/requirements.txt"
mkdir -p "$work/flashinfer"
python3 -m pip download -q "${PLAT[@]}" --require-hashes -r "$work/requirements.txt" -d "$work/flashinfer" \
  || die "pip download failed (network, or a wheel whose sha256 is not the pinned one)"
n=$(find "$work/flashinfer" -name '*.whl' | wc -l)
[ "$n" -eq "${#PINNED[@]}" ] || die "$n wheels for ${#PINNED[@]} pins"
(cd "$work/flashinfer" && sha256sum -- *.whl > SHA256SUMS)
bytes=$(du -cb "$work/flashinfer"/*.whl | tail -1 | cut -f1)
mkdir -p "$work/parts"
tar -cf - -C "$work" flashinfer | split -b "${PART_MB}m" -d -a 2 - "$work/parts/flashinfer."
(cd "$work/parts" && sha256sum -- flashinfer.[0-9]* > flashinfer.sha256)
# only now replace what an earlier run left
rm -rf "$W" "$PARTS"
mv "$work/flashinfer" "$W"
mv "$work/parts" "$PARTS"
echo "stage-flashinfer: $n wheels in $W, $(( bytes / 1000000 )) MB ($bytes bytes):"
find "$W" -name '*.whl' -printf '  %f %s bytes\n' | sort
echo "stage-flashinfer: $(find "$PARTS" -name 'flashinfer.[0-9]*' | wc -l) part(s) of at most $PART_MB MiB in $PARTS," \
  "sha256 in $PARTS/flashinfer.sha256"
