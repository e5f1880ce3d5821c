#!/usr/bin/env bash
# Runs HERE: vLLM 0.28.0's own sampler and rejection-sampler unit tests (issue #17: run against the patched
# tree), from the release's source archive on PyPI (sha256 pinned), into .whl/vllm-tests/ (git-ignored, ~150 KB).
# Nothing of it is committed: the files are vLLM's, fetched each time. Carry .whl/vllm-tests with the last chunk;
# tests/gpu/vllm_sampler_tests.sh runs them on the device, stock and patched.
# The tests import one helper, large_gpu_mark, from vLLM's tests/utils.py, whose other imports (anthropic, ...)
# the device does not have: a stand-in of ours takes its place.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
URL=https://files.pythonhosted.org/packages/22/39/096d88cfe34ee43a8b6e7c957d1ad6338fa5256474d6ff9a32008c6f8cd6/vllm-0.28.0.tar.gz
SHA256=ac96dd0ec5be9c13f2aa4bfb50498c4727110406f6e4980b58a4097e4d18634a
FILES=(tests/__init__.py tests/v1/__init__.py tests/v1/sample/__init__.py tests/v1/sample/utils.py
       tests/v1/sample/test_sampler.py tests/v1/sample/test_rejection_sampler.py tests/v1/sample/test_topk_topp_sampler.py)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
curl -fsSL --retry 3 -o "$work/vllm.tar.gz" "$URL"
echo "$SHA256  $work/vllm.tar.gz" | sha256sum -c --quiet -
tar -xzf "$work/vllm.tar.gz" -C "$work" "${FILES[@]/#/vllm-0.28.0/}"
cat > "$work/vllm-0.28.0/tests/utils.py" <<'PY'
"""Stand-in for vLLM's tests/utils.py: the one helper the sampler tests import (qwen-serving, not vLLM's code)."""
import pytest
import torch


def large_gpu_mark(min_gb: int) -> pytest.MarkDecorator:
    total = torch.cuda.get_device_properties(0).total_memory / 2**30 if torch.cuda.is_available() else 0
    return pytest.mark.skipif(total < min_gb, reason=f"needs a GPU with at least {min_gb} GB")
PY
rm -rf .whl/vllm-tests.new && mkdir -p .whl && mv "$work/vllm-0.28.0" .whl/vllm-tests.new
rm -rf .whl/vllm-tests && mv .whl/vllm-tests.new .whl/vllm-tests
find .whl/vllm-tests -name '*.py' | sort
