"""drafter/capture.py's statistics with `--device cuda` against the CPU's (issue #19: the product visit captures on
the GPU before it quantizes): the tiny scripted checkpoint (8 layers, so that a DFlash2 drafter has its 5 taps) and
its scripted drafter, the fast variant's capture and the DFlash2 one, each once per device. First run: 2026-12-04 on
the H200 with the image's torch 2.11 (no stack; the shell form of this check, bench/results/drafter-capture-h200/):
the largest relative difference of any statistic 5.5e-7 (fast variant) and 1.1e-6 (DFlash2), the integer ones
(row counts, metadata) equal.

    pytest -m gpu tests/gpu/test_drafter_capture_gpu.py

Asserted: the same tensors on both devices, integer ones equal, every float one (Hessian sums, held-out rows) within
1e-5 of the CPU's in relative norm: float32 forwards on two devices, summed in float64.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from qwen_serving.checkpoint import drafter_capture
from tests.helpers.tiny_checkpoint import make_scripted_with_drafter

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PROMPTS = 6
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def scripted(tmp_path_factory) -> tuple[Path, Path]:
    return make_scripted_with_drafter(tmp_path_factory.mktemp("capture-gpu"))


def _compare(cpu: Path, cuda: Path) -> float:
    a, b = load_file(str(cpu)), load_file(str(cuda))
    assert a.keys() == b.keys()
    worst = 0.0
    for name, x in a.items():
        y = b[name]
        assert x.shape == y.shape and x.dtype == y.dtype, name
        if not x.is_floating_point():
            assert torch.equal(x, y), name
        elif x.numel():
            worst = max(worst, ((x.double() - y.double()).norm() / x.double().norm().clamp_min(1e-30)).item())
    return worst


@pytest.mark.parametrize("kind", ["fast", "dflash2"])
def test_the_gpu_capture_is_the_cpus(scripted, tmp_path, kind):
    ckpt, drafter = scripted
    outs = {}
    for device in ("cpu", "cuda"):
        outs[device] = tmp_path / f"{kind}-{device}.safetensors"
        if kind == "fast":
            drafter_capture.capture(ckpt, outs[device], max_prompts=PROMPTS, device=device)
        else:
            drafter_capture.capture_dflash2(ckpt, drafter, outs[device], max_prompts=PROMPTS, device=device)
    assert _compare(outs["cpu"], outs["cuda"]) < TOLERANCE
