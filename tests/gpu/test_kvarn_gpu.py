"""The KVarN tile kernels at the real attention shape on a CUDA GPU: the CPU test's comparisons, full size
(4 KV heads of 256, 128-token tiles, 64k tokens), plus the int4 per-token-head reference against vLLM 0.28.0's
own write kernel when vLLM is importable. Ran on the H200 on 2026-12-04 without vLLM (docs/kvarn.md, "What the
GPU session runs"):

    pytest -m gpu tests/gpu/test_kvarn_gpu.py      # then: python bench/kv_fidelity.py (issue 20 item 2)

Tolerances as on CPU: codes equal on >= 99.9% of bytes; the two read-backs within 0.3% of each other (fp16
scales one step apart).
"""

from __future__ import annotations

import pytest
import torch

from qwen_serving import model
from qwen_serving.engine.kernels import kv_fidelity as fid
from qwen_serving.engine.kernels import kvarn

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _kv(tokens: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    shape = (tokens, model.KV_HEADS, model.HEAD_DIM)
    channel = torch.rand(1, 1, model.HEAD_DIM, device="cuda", generator=g) * 3 + 0.1
    k = torch.randn(*shape, device="cuda", generator=g) * channel
    return k.bfloat16(), torch.randn(*shape, device="cuda", generator=g).bfloat16()


@pytest.mark.parametrize(("rows", "cols", "bits"), [(256, 128, 4), (128, 256, 2)])
def test_tiles_at_the_real_shape(rows, cols, bits):
    x = torch.randn(512, rows, cols, device="cuda") * torch.rand(512, rows, 1, device="cuda") * 4
    got, want = kvarn.quantize_tiles(x, bits), kvarn.quantize_tiles_reference(x, bits)
    assert (got.codes == want.codes).float().mean() >= 0.999
    torch.testing.assert_close(kvarn.dequantize_tiles(want, bits), kvarn.dequantize_tiles_reference(want, bits))


def test_cache_records_at_64k():
    k, v = _kv(65536)
    layout = kvarn.KvarnLayout(head_dim=model.HEAD_DIM)
    got = kvarn.kvarn_quantize(k, v, layout, impl="triton")
    want = kvarn.kvarn_quantize(k, v, layout, impl="reference")
    d, tile = model.HEAD_DIM, layout.tile
    for start, size in ((layout.k_codes, d * tile // 2), (layout.v_codes, d * tile // 4)):  # code bytes, K then V
        assert (got[..., start:start + size] == want[..., start:start + size]).float().mean() >= 0.999
    # The codes agree (H200, 2026-12-04: all but 1.5e-6 of K's bytes); the scales, fp16, may land one step (2^-11 of
    # the value) apart after Sinkhorn's exp/log in another order, row and column scale each: up to ~0.2% of the norm.
    # Measured there: K 0.106%, V 0.110%, above the 0.1% this test first asked.
    for a, b in zip(kvarn.kvarn_dequantize(got, layout), kvarn.kvarn_dequantize(want, layout), strict=True):
        assert (a - b).norm() / b.norm() < 3e-3
    kd, vd = kvarn.kvarn_dequantize(got, layout)
    # min-max rounding of Gaussian rows of 128: range ~5.2 sigma, step range / 15 at 4 bits, error step / sqrt(12)
    # ~ 0.10 sigma (H200: 0.099); range / 3 at 2 bits ~ 0.5 sigma
    assert ((kd - k.float()).norm() / k.float().norm()) < 0.11
    assert ((vd - v.float()).norm() / v.float().norm()) < 0.62


def test_int4pth_reference_equals_vllm_on_cuda():
    ops = pytest.importorskip("vllm.v1.attention.ops.int4_per_token_head")
    tokens, block = 4096, 16
    k, v = _kv(tokens, seed=1)
    blocks = tokens // block
    caches = [torch.zeros(blocks, block, model.KV_HEADS, model.HEAD_DIM // 2, dtype=torch.uint8, device="cuda")
              for _ in range(2)]
    steps = [torch.zeros(blocks, block, model.KV_HEADS, device="cuda") for _ in range(2)]
    ops.reshape_and_cache_int4(k, v, *caches, torch.arange(tokens, device="cuda"), k_scale_cache=steps[0],
                               v_scale_cache=steps[1])
    for x, cache in ((k, caches[0]), (v, caches[1])):
        # the GPU's Hadamard (hadacore, bf16) rounds differently from the CPU butterfly: codes agree almost always
        assert (cache.reshape(tokens, model.KV_HEADS, -1) == fid.int4pth_quantize(x).codes).float().mean() > 0.98
