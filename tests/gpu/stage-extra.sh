#!/usr/bin/env bash
# Runs HERE: download the vLLM runtime deps that ../shared/device/stage-wheels.sh does not ship and
# the H200 image lacks, into .whl/extra/ (git-ignored, ~15 MB). Carry .whl/extra with the first test
# call; run_on_device.sh installs it into /tmp/site. Found on the H200 on 2026-11-29: the
# qwen3_coder tool parser imports ijson, vLLM's tool-parser registry imports mistral_common, and
# validating a structured-output request imports lm-format-enforcer (HTTP 500 without it). py-spy is for
# bench/host_profile.py.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
mkdir -p .whl/extra
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl/extra \
  ijson==3.6.0 mistral_common==1.13.1 pydantic-extra-types==2.11.1 pycountry==26.2.16 jsonschema==4.26.0 \
  jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1 \
  lm-format-enforcer==0.11.3 interegular==0.3.3
# py-spy (a static binary in a wheel): bench/host_profile.py samples the engine core's Python with it
python3 -m pip download -q --no-deps --only-binary=:all: --platform manylinux_2_5_x86_64 -d .whl/extra py-spy==0.4.3
ls .whl/extra
