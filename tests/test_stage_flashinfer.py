"""tests/gpu/stage-flashinfer.sh's pins against vLLM 0.28.0's own requirements, install-flashinfer.sh's version, and the
FlashInfer JIT cache's trip through pack_jit_cache.sh (issue #20 item 1: FlashInfer for the offline H200)."""

from __future__ import annotations

import os
import re
import subprocess
import tarfile
from importlib import metadata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
GPU = REPO / "tests" / "gpu"
STAGE = (GPU / "stage-flashinfer.sh").read_text()
STACK = (REPO.parent / "shared" / "device" / "stage-wheels.sh")


def pinned() -> dict[str, str]:
    block = re.search(r"^PINNED=\(\n(.*?)^\)", STAGE, re.S | re.M).group(1)
    pins = re.findall(r'^\s*"([A-Za-z0-9_.-]+)==(\S+) --hash=sha256:[0-9a-f]{64}"$', block, re.M)
    assert len(pins) == len([line for line in block.splitlines() if line.strip()]), "a pin without its sha256"
    return dict(pins)


def vllm_requires() -> dict[str, str]:
    """vLLM 0.28.0's exact (==) requirements, from the installed distribution's metadata."""
    out = {}
    for req in metadata.requires("vllm") or []:
        m = re.match(r"([A-Za-z0-9_.-]+)\s*==\s*([^;\s]+)\s*$", req)
        if m:
            out[m.group(1).lower()] = m.group(2)
    return out


def test_flashinfer_is_the_version_vllm_pins_and_install_checks_for():
    pins, vllm = pinned(), vllm_requires()
    assert metadata.version("vllm") == "0.28.0"
    assert pins["flashinfer-python"] == vllm["flashinfer-python"] == "0.6.16.post3"
    install = (GPU / "install-flashinfer.sh").read_text()
    assert re.search(r"^VERSION=(\S+)$", install, re.M).group(1) == pins["flashinfer-python"]
    assert set(pins) == {"flashinfer-python", "ninja"}  # the rest is the stack's or the image's (the script's header)


def test_the_stack_already_stages_the_tvm_ffi_vllm_pins():
    if not STACK.is_file():
        pytest.skip(f"no {STACK}: the shared device scripts sit beside the checkout on the development machine only")
    staged = dict(re.findall(r"\b(apache-tvm-ffi)==(\S+)", STACK.read_text()))
    assert staged["apache-tvm-ffi"] == vllm_requires()["apache-tvm-ffi"]
    assert "apache-tvm-ffi" not in pinned()


def test_flashinfers_jit_cache_is_packed_after_the_others_and_unpacks_as_it_was(tmp_path):
    home, out = tmp_path / "home", tmp_path / "out"
    built = home / ".cache" / "flashinfer" / "0.6.16.post3" / "90a" / "cached_ops" / "m"
    built.mkdir(parents=True)
    (built / "m.so").write_bytes(os.urandom(1000))
    (built / "a.cuda.o").write_bytes(b"o")
    os.utime(built / "a.cuda.o", (1_700_000_000, 1_700_000_000))  # ninja compares mtimes: they must survive
    (home / ".triton" / "cache").mkdir(parents=True)
    (home / ".triton" / "cache" / "k").write_text("k")
    (home / ".cache" / "vllm" / "torch_compile_cache").mkdir(parents=True)
    out.mkdir()
    res = subprocess.run(["bash", str(GPU / "pack_jit_cache.sh"), str(out)], env={**os.environ, "HOME": str(home)},
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "FlashInfer's JIT cache:" in res.stdout
    parts = sorted(out.glob("flashinfer-cache.t?z.*"))
    assert parts and sorted(out.glob("jit-cache.t?z.*"))
    joined = tmp_path / ("joined." + parts[0].name.split(".")[1])
    joined.write_bytes(b"".join(p.read_bytes() for p in parts))
    with tarfile.open(joined) as tar:
        members = {m.name: m for m in tar.getmembers()}
    assert members[".cache/flashinfer/0.6.16.post3/90a/cached_ops/m/a.cuda.o"].mtime == 1_700_000_000
    assert members[".cache/flashinfer/0.6.16.post3/90a/cached_ops/m/m.so"].size == 1000
    # run_on_device.sh restores both kinds from the stage
    restore = (GPU / "run_on_device.sh").read_text()
    assert '"$STAGE"/{jit-cache,flashinfer-cache}.{txz,tgz}' in restore
