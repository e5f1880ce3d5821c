"""The DFlash2 drafter's context-KV precompute when its q/k/v projections are quantized (upstream vllm#51581).

vLLM 0.28.0's `DFlashQwen3Model` (qwen3_dflash.py, which DFlash2 inherits) projects the context rows of every
layer in one GEMM: `_build_context_kv_buffers` stacks `qkv_proj.weight[q_size:]` of all layers into a fused
[layers x 2 x kv_size, hidden] weight at the end of load_weights, and `_project_context_kv` multiplies the
normed context rows by it with F.linear. A quantized qkv_proj has no dense `.weight` (a W4A16 one holds
`weight_packed` / `weight_scale`, repacked for Marlin after loading), so the load fails with
`AttributeError: 'QKVParallelLinear' object has no attribute 'weight'` (the 36-matrix drafter of
drafter/quantize.py --dflash2, the spec's W4A16 layout).

patches/dflash2-quantized-kv.patch calls `attach` where the fused weight is built. When any layer's qkv_proj
has a quant method other than vLLM's UnquantizedLinearMethod, it returns a `PerLayerContextKV`, no fused weight
is built, and `_project_context_kv` takes its `project` instead of the fused F.linear: each layer's own
qkv_proj (its quant method: Marlin for W4A16 on a GPU) over the normed context rows, the k/v columns of each
copied into one [rows, layers x 2 x kv_size] tensor laid out as the fused GEMM's output (layer-major, k then v),
so the k-norm, RoPE and cache writes after it run unchanged. With every qkv_proj unquantized `attach` returns
None and the patched code runs the original lines: the bf16 drafter's buffers and results are the same bytes.

Why this and not the other fix (dequantize the k/v rows once at load into a fused bf16 weight):
- exactness: the context K/V become, row for row, what the layer's own qkv_proj gives for those rows, through
  the same kernel and weights the query block's k/v go through, so context and block keys agree with each
  other; against the unquantized path run on the dequantized weights they differ only by bf16 rounding (the
  weights as bf16, the summation order). A load-time dequantization reads the checkpoint layout, which holds
  only until process_weights_after_loading repacks for Marlin: the lazy rebuild in
  precompute_and_store_context_kv (the "buffer initialization was skipped" path) would read repacked codes.
- memory: no buffer. The dequantized fused weight at the drafter's shapes (qwen_serving/model.py: 5 layers,
  8 KV heads x 128, the target's hidden 5,120, which the drafter shares) is 5 x 2 x 8 x 128 x 5,120 x 2 bytes = 104,857,600 bytes (100 MiB) per GPU
  at TP 1, beside the int4 k/v the layers keep for the query block; on a 24 GB card that is KV cache.
- the cost: each layer's GEMM computes its q columns too and throws them away. With the scripted `full`
  drafter's 32 query heads x 128 (docs/scripted-dflash2.md; the shipped drafter's are not known here) that is
  4,096 of each layer's 6,144 output columns: 2/3 of the multiply-adds, 3x what the k/v need (5 x 5,120 x 4,096
  = 105M wasted multiply-adds per context row). The weights read per precompute are the int4 q/k/v,
  5 x 6,144 x 5,120 / 2 = 78.6 MB plus 2.5 MB of scales, against 104.9 MB for the fused bf16 k/v; and 5 GEMM
  launches instead of 1. Each layer's [rows, 6,144] output lives until its k/v are copied out (counted: the
  dummy run of vLLM's memory profiling calls the precompute too). Computed from the shapes, not measured: not
  run on a GPU yet.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from vllm.model_executor.layers.linear import UnquantizedLinearMethod


def _quantized(qkv_proj: nn.Module) -> bool:
    # UnquantizedLinearMethod is vLLM's bf16 path: a dense `.weight` that the fused GEMM reads
    return not isinstance(qkv_proj.quant_method, UnquantizedLinearMethod)


class PerLayerContextKV:
    """The context K/V projection through each layer's own qkv_proj (any quant method)."""

    def __init__(self, layers_attn: Sequence[nn.Module]):
        self.projections = [attn.qkv_proj for attn in layers_attn]
        self.q_sizes = [attn.q_size for attn in layers_attn]
        self.kv_size = layers_attn[0].kv_size
        if any(attn.kv_size != self.kv_size for attn in layers_attn):
            raise ValueError("DFlash context K/V: every layer needs the same kv_size")

    def project(self, normed_context_states: torch.Tensor) -> torch.Tensor:
        """[rows, layers x 2 x kv_size]: per layer its k then v columns, as the fused F.linear lays them out."""
        width = 2 * self.kv_size
        out = normed_context_states.new_empty(normed_context_states.shape[0], len(self.projections) * width)
        for i, (projection, q_size) in enumerate(zip(self.projections, self.q_sizes, strict=True)):
            qkv, _ = projection(normed_context_states)  # bias, if any, added by the layer as in its forward
            out[:, i * width : (i + 1) * width].copy_(qkv[:, q_size : q_size + width])
        return out


def attach(layers_attn: Sequence[nn.Module]) -> PerLayerContextKV | None:
    """The per-layer projection when any layer's qkv_proj is quantized; None (the fused bf16 GEMM) otherwise."""
    if not any(_quantized(attn.qkv_proj) for attn in layers_attn):
        return None
    return PerLayerContextKV(layers_attn)
