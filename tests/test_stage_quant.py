"""tests/gpu/stage-quant.sh's pinned list (the quant environment staged for the offline H200, issue #19)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STAGE = (REPO / "tests" / "gpu" / "stage-quant.sh").read_text()
INSTALL = (REPO / "tests" / "gpu" / "install-quant.sh").read_text()


def pinned() -> dict[str, str]:
    block = re.search(r"^PINNED=\(\n(.*?)^\)", STAGE, re.S | re.M).group(1)
    words = [w for line in block.splitlines() if not line.strip().startswith("#") for w in line.split()]
    assert all("==" in w for w in words), words
    pins = {re.sub(r"[-_.]+", "-", w.split("==")[0]).lower(): w.split("==")[1] for w in words}
    assert len(pins) == len(words), "a project pinned twice"
    return pins


def test_pins_the_llmcompressor_of_the_quant_venv_and_its_compressed_tensors():
    pins = pinned()
    install_pin = re.search(r"^PIN_LLMCOMPRESSOR=(\S+)$", (REPO / "drafter" / "install.sh").read_text(), re.M).group(1)
    assert pins["llmcompressor"] == install_pin
    assert pins["compressed-tensors"] == "0.19.0"
    # install-quant.sh checks the version the quant site gives, and the stack's own beside it
    assert f'[ "$got" = {pins["compressed-tensors"]} ]' in INSTALL
    assert '[ "$got" = "0.28.0 0.17.0" ]' in INSTALL


def test_stages_no_torch_and_no_cuda_library():
    # the device has torch 2.13.0 (CUDA), triton, torchvision and the CUDA libraries; nvidia-ml-py is NVML's
    # pure-Python bindings
    staged_elsewhere = {"torch", "triton", "torchvision", "vllm"}
    pins = pinned()
    assert not staged_elsewhere & set(pins)
    assert [n for n in pins if n.startswith(("nvidia-", "cuda-"))] == ["nvidia-ml-py"]
