"""VISION_OFFLOAD=1 on a CUDA GPU (engine/vision_offload.py, patches/vision-offload.patch): the real-size vision tower
(model.VISION_CONFIG: 27 blocks, BF16, seeded random weights) built from vLLM 0.28.0's own Qwen3_VisionTransformer
encodes one 8192-patch image with the whole tower on the card, then again after `offload_after_load` (the patch's
hook) at the launcher's default budget. First run: visit 14 (2026-12-04, bench/results/vision-offload-h200.json):
bit-exact, 37.9 -> 50.8 ms median encode.

    pytest -m gpu tests/gpu/test_vision_offload_gpu.py

Asserted: the two encodings are bit-identical; the allocated device memory drops by at least the bytes moved to
host RAM less 1 MiB; the host buffers are pinned; the offloaded encode's peak above the card's baseline exceeds
the resident encode's (its activations) by at most the one staging slot (and 1 MiB). Recorded, never asserted: each encode's median time
(CUDA events, after one warm-up) and the memory figures, in $QS_GPU_RESULTS/vision-offload-h200.json (the spec's
reference RTX 3090: 296 -> 333 ms).
"""

from __future__ import annotations

import statistics
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace

import pytest
import smoke_lib as lib
import torch

from bench import serving
from qwen_serving import knobs, model, patchset
from qwen_serving.engine import vision_offload
from tests.helpers import vision_tower

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

GRID = (1, 64, 128)  # 8192 patches, the spec's image; 2048 image tokens after the 2 x 2 merge
REPEATS = 5
MiB = 1 << 20


def encode_timed(tower, pixels) -> tuple[torch.Tensor, list[float], int]:
    """The output, each repeat's milliseconds, and the peak allocated bytes above the start of the encodes."""
    out = vision_tower.encode(tower, pixels, GRID)  # warm-up
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(REPEATS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = vision_tower.encode(tower, pixels, GRID)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return out, times, torch.cuda.max_memory_allocated() - base


def test_offloaded_encode_equals_the_resident_one(vllm_world, monkeypatch):
    monkeypatch.setenv("VLLM_VISION_OFFLOAD_GIB", str(knobs.VISION_OFFLOAD_GIB))
    import vllm
    from vllm.config import VllmConfig

    tower = vision_tower.build(model.VISION_CONFIG, device="cuda")
    pixels = vision_tower.patches(tower, GRID).bfloat16().pin_memory()
    whole, whole_ms, whole_peak = encode_timed(tower, pixels)
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    done = vision_offload.offload_after_load(SimpleNamespace(visual=tower), VllmConfig())
    after = torch.cuda.memory_allocated()
    offloaded, offloaded_ms, offloaded_peak = encode_timed(tower, pixels)
    record = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"), "gpu": lib.gpu_description(),
        "torch": torch.__version__, "vllm": vllm.__version__, "vllm_dir": str(Path(vllm.__file__).parent),
        "patch_series": [p.name for p in patchset.read_series(patchset.DEFAULT_SERIES)], "grid_thw": list(GRID),
        "budget_gib": knobs.VISION_OFFLOAD_GIB, "kept": list(done.kept), "streamed": len(done.streamed),
        "host_mib": done.host_bytes / MiB, "pinned": done.pinned, "freed_mib": (before - after) / MiB,
        "peak_above_baseline_mib": {"whole": whole_peak / MiB, "offloaded": offloaded_peak / MiB},
        "encode_ms_median": {"whole": statistics.median(whole_ms), "offloaded": statistics.median(offloaded_ms)},
        "encode_ms": {"whole": whole_ms, "offloaded": offloaded_ms},
        "bit_exact": bool(torch.equal(whole, offloaded)),
    }
    lib.RESULTS.mkdir(parents=True, exist_ok=True)
    serving.write_json_atomic(lib.RESULTS / "vision-offload-h200.json", record)
    assert record["bit_exact"], record
    assert before - after >= done.host_bytes - MiB and done.pinned, record
    assert offloaded_peak <= whole_peak + done.slot_bytes + MiB, record
