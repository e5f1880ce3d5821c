#!/usr/bin/env bash
# Runs HERE (PyPI reachable): download the wheels that drafter/quantize.py's GPTQ (llmcompressor 0.14.0.1,
# drafter/install.sh) needs on the offline H200 beside the staged stack, into .whl/quant/ (git-ignored), for
# CPython 3.12 manylinux x86_64, --no-deps from the pinned list below. On the device, after the stack is in
# /tmp/site: `bash tests/gpu/install-quant.sh` puts them in /tmp/quant-site, which goes first on PYTHONPATH
# for quantize.py only (the server keeps compressed-tensors 0.17.0). tests/gpu/README.md, issue #19.
#
# The list is llmcompressor 0.14.0.1's dependency closure, resolved on 2026-12-03 with
#   pip install --dry-run --report --ignore-installed --only-binary=:all: --python-version 3.12 <these platforms>
#     -c <the staged versions> llmcompressor==0.14.0.1 torch==2.13.0 transformers==5.17.0
# (torch as a stand-in wheel carrying its requirements without the nvidia-* ones), minus what the device has at a
# version llmcompressor accepts:
# - torch 2.13.0 (CUDA) and triton 3.7.1, and the staged wheels that the closure reaches: loguru 0.7.3, pydantic
#   2.14.4, pydantic-core 2.50.5, annotated-types 0.8.0, typing-inspection 0.4.5, typing-extensions 4.16.0,
#   anyio 4.16.0, idna 3.20, h11 0.16.0 (../shared/device/stage-wheels.sh);
# - the image's transformers 5.17.0 (llmcompressor caps it at <= 5.17.0) and tokenizers 0.23.2, recorded in every
#   visit's results (bench/results/gpu-smoke-h200.json "versions"), and what only torch or transformers require
#   and the image therefore has for them (jinja2, markupsafe, networkx, sympy, mpmath, setuptools; regex, typer
#   and typer's annotated-doc, rich, markdown-it-py, mdurl, pygments, shellingham).
# Everything else is here: the image's versions of it are not known here, and llmcompressor's side bounds most.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
Q=.whl/quant
PARTS=.whl/quant-parts
PART_MB=44   # a part plus the tracked tree (~16.7 MB) stays under the 64 MiB a device call carries
PINNED=(
  # the GPTQ: llmcompressor, and the compressed-tensors it pins (vLLM 0.28.0's is 0.17.0)
  llmcompressor==0.14.0.1 compressed-tensors==0.19.0
  # llmcompressor's own requirements (accelerate >= 1.15, auto-round <= 0.15.1, datasets >= 4.8.4,
  # numpy >= 2, pillow >= 10.4, pyyaml >= 6.0.1, requests >= 2.32.2, tqdm >= 4.66.3, nvidia-ml-py >= 12.560)
  accelerate==1.16.0 auto-round==0.15.1 datasets==5.2.0 numpy==2.5.5 pillow==13.0.0 pyyaml==6.0.4
  requests==2.34.2 tqdm==4.70.1 nvidia-ml-py==13.615.71
  # compressed-tensors' and accelerate's psutil, auto-round's py-cpuinfo, accelerate's safetensors
  psutil==7.2.2 py-cpuinfo==9.0.0 safetensors==0.8.0
  # datasets' (dill < 0.4.2, multiprocess < 0.70.20, fsspec <= 2026.9.0, pyarrow >= 24, huggingface-hub >= 1.31)
  dill==0.4.1 multiprocess==0.70.19 fsspec==2026.9.0 pyarrow==26.0.1 pandas==3.1.1 xxhash==4.1.0
  filelock==4.3.2 packaging==26.4 huggingface-hub==1.33.0
  # pandas': python-dateutil, tzdata
  python-dateutil==4.0.0 tzdata==2026.6
  # huggingface-hub's: hf-xet, httpx 0.x (the stage's httpx2 is another project), its httpcore, click
  hf-xet==1.8.0 httpx==0.29.0 httpcore==1.0.9 click==8.5.1
  # requests': urllib3, charset-normalizer, certifi
  urllib3==2.8.0 charset-normalizer==3.5.3 certifi==2026.10.19.post1
)
PLAT=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp)
for n in 5 12 17 24 27 28; do PLAT+=(--platform "manylinux_2_${n}_x86_64"); done
PLAT+=(--platform manylinux2014_x86_64 --platform manylinux2010_x86_64 --platform manylinux1_x86_64)
rm -rf "$Q" "$PARTS"
mkdir -p "$Q"
python3 -m pip download -q "${PLAT[@]}" -d "$Q" "${PINNED[@]}"
n=$(find "$Q" -name '*.whl' | wc -l)
[ "$n" -eq "${#PINNED[@]}" ] || { echo "stage-quant: $n wheels in $Q for ${#PINNED[@]} pins" >&2; exit 1; }
# (nvidia-ml-py, NVML's pure-Python bindings, is no CUDA library: hence nvidia_[!m]*)
if compgen -G "$Q/torch-*" >/dev/null || compgen -G "$Q/nvidia_[!m]*" >/dev/null; then
  echo "stage-quant: a torch or CUDA library wheel in $Q (the device has them)" >&2; exit 1
fi
bytes=$(du -cb "$Q"/*.whl | tail -1 | cut -f1)
echo "stage-quant: $n wheels in $Q, $(( bytes / 1000000 )) MB ($bytes bytes)"
if [ "$bytes" -gt $(( PART_MB * 1000000 )) ]; then
  # too much for one device call: one tar stream in PART_MB MiB parts, each carried by a call of its own
  mkdir -p "$PARTS"
  tar -cf - -C .whl quant | split -b "${PART_MB}m" -d -a 2 - "$PARTS/quant."
  echo "stage-quant: split into $(find "$PARTS" -name 'quant.*' | wc -l) parts of at most $PART_MB MiB in $PARTS"
fi
