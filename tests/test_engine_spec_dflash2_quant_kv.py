"""engine/spec_dflash2_quant_kv.py on vLLM's own QKVParallelLinear (CPU): it declines bf16 layers, and its
per-layer projection lays the k/v columns out as the fused GEMM of qwen3_dflash.py does, bias included.

The whole drafter through vLLM's model code, int4 q/k/v against the dequantized weights and the bf16 drafter
pristine against patched, is tests/test_drafter_dflash2.py."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from qwen_serving.engine.spec_dflash2_quant_kv import PerLayerContextKV, attach

HIDDEN, HEAD_DIM, HEADS, KV_HEADS, LAYERS = 64, 16, 4, 2, 3


class DenseStandIn:
    """A quant method other than UnquantizedLinearMethod that computes with the layer's dense weight."""

    def apply(self, layer, x, bias=None):
        return F.linear(x, layer.weight, bias)


@pytest.fixture
def layers(vllm_world):
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.linear import QKVParallelLinear

    gen = torch.Generator().manual_seed(0)
    out = []
    with set_current_vllm_config(VllmConfig()):
        for i in range(LAYERS):
            qkv = QKVParallelLinear(HIDDEN, HEAD_DIM, HEADS, KV_HEADS, bias=True, params_dtype=torch.float32,
                                    prefix=f"layers.{i}.self_attn.qkv_proj")
            qkv.weight.data.copy_(torch.randn(qkv.weight.shape, generator=gen))
            qkv.bias.data.copy_(torch.randn(qkv.bias.shape, generator=gen))
            qkv.cpu_linear = F.linear  # what process_weights_after_loading sets on the CPU
            out.append(types.SimpleNamespace(qkv_proj=qkv, q_size=HEADS * HEAD_DIM, kv_size=KV_HEADS * HEAD_DIM))
    return out


def test_bf16_layers_are_declined(layers):
    assert type(layers[0].qkv_proj.quant_method).__name__ == "UnquantizedLinearMethod"
    assert attach(layers) is None


def test_the_per_layer_projection_is_laid_out_as_the_fused_gemm(layers):
    x = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(1))
    # qwen3_dflash.py's fused K/V: every layer's rows past q_size stacked, one F.linear
    fused = F.linear(x, torch.cat([a.qkv_proj.weight[a.q_size :] for a in layers]),
                     torch.cat([a.qkv_proj.bias[a.q_size :] for a in layers]))
    layers[1].qkv_proj.quant_method = DenseStandIn()  # one quantized layer sends them all per layer
    per_layer = attach(layers)
    assert isinstance(per_layer, PerLayerContextKV)
    got = per_layer.project(x)
    assert got.shape == (5, LAYERS * 2 * KV_HEADS * HEAD_DIM)
    assert torch.allclose(got, fused, rtol=1e-6, atol=1e-5)


def test_layers_of_different_kv_size_are_refused(layers):
    layers[0].qkv_proj.quant_method = DenseStandIn()
    layers[2].kv_size = HEAD_DIM
    with pytest.raises(ValueError, match="same kv_size"):
        attach(layers)
