"""Marlin W4A8-INT8: negative group scales folded into the int4 codes, and per-layer selection.

The kernel's own arithmetic is emulated: vLLM requantizes group scales to int16 bits and the CUDA
kernel reads them unsigned (``int16_scales_as_read``); everything else here is vLLM's own code.
"""

from __future__ import annotations

import pytest
import torch

from qwen_serving.checkpoint.int4 import negate_groups, pack_int4, quantize_int4_groups
from qwen_serving.engine.marlin_int8 import (
    dequantize,
    fold_negative_scales,
    int8_activations_for,
    int16_scales_as_read,
    unpack_codes,
)
from tests.helpers.engine_trees import load

GROUP = 128
MARLIN = "model_executor/kernels/linear/mixed_precision/marlin.py"


def autoround_symmetric(weight: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """AutoRound-style symmetric int4 of weight [N, K]: the largest-magnitude weight of a group gets
    code -8, so groups whose extreme is positive get a negative scale. Returns codes [N, K], scales."""
    n, k = weight.shape
    grouped = weight.view(n, k // group, group)
    hi, lo = grouped.amax(-1).clamp(min=0), grouped.amin(-1).clamp(max=0)
    extreme = torch.where(hi >= -lo, hi, lo)
    scales = (-extreme / 8).to(torch.float16)
    codes = torch.round(grouped / scales.float().unsqueeze(-1)).clamp(-8, 7).to(torch.int8)
    return codes.view(n, k), scales


def canonical(codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Checkpoint [N, K] codes / [N, G] scales -> Marlin canonical packed [K/8, N], scales [G, N]."""
    return pack_int4(codes).t().contiguous(), scales.t().contiguous()


@pytest.fixture
def autoround_layer():
    torch.manual_seed(0)
    codes, scales = autoround_symmetric(torch.randn(256, 1024))
    return canonical(codes, scales)


def test_fold_is_exact_where_negation_exists():
    torch.manual_seed(1)
    codes, scales = quantize_int4_groups(torch.randn(128, 512), GROUP)  # codes in [-7, 7]
    codes, scales = negate_groups(codes, scales, torch.rand(scales.shape) < 0.5, GROUP)
    qweight, s = canonical(codes, scales)
    before = dequantize(qweight, s, GROUP)
    stats = fold_negative_scales(qweight, s, GROUP)
    assert stats.negative_groups > 0 and stats.clamped_codes == 0
    assert bool((s >= 0).all())
    assert torch.equal(dequantize(qweight, s, GROUP), before)


def test_fold_clamps_only_plus_eight(autoround_layer):
    qweight, s = autoround_layer
    codes, before = unpack_codes(qweight), dequantize(qweight, s, GROUP)
    plus_eight = (codes == -8) & (s.repeat_interleave(GROUP, 0) < 0)
    share_negative = float((s < 0).float().mean())
    stats = fold_negative_scales(qweight, s, GROUP)
    after = dequantize(qweight, s, GROUP)
    assert 0.3 < share_negative < 0.7 and stats.negative_groups == int((s.numel() * share_negative) + 0.5)
    assert stats.clamped_codes == int(plus_eight.sum()) > 0
    assert torch.equal(after[~plus_eight], before[~plus_eight])
    # +8|s| became +7|s|: off by exactly one scale step
    step = s.float().repeat_interleave(GROUP, 0)[plus_eight]
    assert torch.equal(before[plus_eight] - after[plus_eight], step)


def test_fold_error_is_small_next_to_int4_error():
    torch.manual_seed(2)
    weight = torch.randn(512, 2048)
    codes, scales = autoround_symmetric(weight)
    qweight, s = canonical(codes, scales)
    reference = weight.t()
    int4_error = float(((dequantize(qweight, s, GROUP) - reference) ** 2).sum())
    stats = fold_negative_scales(qweight, s, GROUP)
    folded_error = float(((dequantize(qweight, s, GROUP) - reference) ** 2).sum())
    print(f"\nAutoRound-style int4 g128 of N(0,1) 512x2048: {stats.describe()}; "
          f"squared error vs the bf16 weight +{folded_error / int4_error - 1:.1%} over the int4 rounding")
    assert stats.clamped_codes > 0.9 * stats.negative_groups
    assert folded_error < 1.25 * int4_error


def test_fold_with_act_order_groups():
    torch.manual_seed(3)
    codes, scales = autoround_symmetric(torch.randn(64, 256))
    qweight, s = canonical(codes, scales)
    perm = torch.randperm(256)
    g_idx = torch.arange(256) // GROUP
    # the same layer with its input rows shuffled, g_idx telling each row's group
    shuffled = pack_int4(unpack_codes(qweight)[perm].t().contiguous()).t().contiguous()
    s2 = s.clone()
    fold_negative_scales(qweight, s, GROUP)
    fold_negative_scales(shuffled, s2, GROUP, g_idx[perm])
    assert torch.equal(s, s2) and torch.equal(unpack_codes(shuffled), unpack_codes(qweight)[perm])


def test_fold_rejects_mismatched_scales(autoround_layer):
    qweight, s = autoround_layer
    with pytest.raises(ValueError, match="scale rows"):
        fold_negative_scales(qweight, s[:1], GROUP)


def test_unsigned_int16_scales_are_garbage_without_the_fold(autoround_layer):
    from vllm.model_executor.layers.quantization.utils.marlin_utils import marlin_act_int8_process_scales

    qweight, s = autoround_layer
    codes = unpack_codes(qweight).float()
    truth = dequantize(qweight, s, GROUP)

    def kernel_weight(scales):
        requant, factor = marlin_act_int8_process_scales(scales.clone())
        return codes * int16_scales_as_read(requant, factor).repeat_interleave(GROUP, 0)

    stock_error = (kernel_weight(s) - truth).norm() / truth.norm()
    fold_negative_scales(qweight, s, GROUP)
    codes = unpack_codes(qweight).float()
    fixed_error = (kernel_weight(s) - truth).norm() / truth.norm()
    assert stock_error > 5  # a scale of -x reads as 65536 - x
    assert fixed_error < 0.05  # the +8 clamp plus the int16 scale rounding


def _marlin_layer(kernel_module, qweight_nk8: torch.Tensor, scales_ng: torch.Tensor):
    """Run one tree's MarlinLinearKernel.process_weights_after_loading on CPU (repack = identity)."""
    from vllm.model_executor.kernels.linear.mixed_precision.MPLinearKernel import MPLinearLayerConfig
    from vllm.model_executor.parameter import GroupQuantScaleParameter, PackedvLLMParameter
    from vllm.scalar_type import scalar_types

    n, k = qweight_nk8.shape[0], qweight_nk8.shape[1] * 8
    layer = torch.nn.Module()
    layer.weight_packed = PackedvLLMParameter(data=qweight_nk8.clone(), input_dim=1, output_dim=0, packed_dim=1,
                                              packed_factor=8, weight_loader=None)
    layer.weight_scale = GroupQuantScaleParameter(data=scales_ng.clone(), input_dim=1, output_dim=0,
                                                  weight_loader=None)
    config = MPLinearLayerConfig(full_weight_shape=(k, n), partition_weight_shape=(k, n),
                                 weight_type=scalar_types.uint4b8, act_type=torch.int8, group_size=GROUP,
                                 zero_points=False, has_g_idx=False)
    kernel = kernel_module.MarlinLinearKernel(config, "weight_packed", "weight_scale")
    kernel.process_weights_after_loading(layer)
    return layer


def test_process_weights_after_loading(monkeypatch):
    import vllm.model_executor.parameter as parameter
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers.quantization.utils.marlin_utils import marlin_permute_scales

    monkeypatch.setattr(ops, "gptq_marlin_repack", lambda q, **_: q, raising=False)
    monkeypatch.setattr(parameter, "get_tensor_model_parallel_rank", lambda: 0)
    monkeypatch.setattr(parameter, "get_tensor_model_parallel_world_size", lambda: 1)
    torch.manual_seed(4)
    codes, scales = autoround_symmetric(torch.randn(128, 256))
    truth = (codes.float().view(128, 2, GROUP) * scales.float().unsqueeze(-1)).view(128, 256).t()
    # where each scale lands after Marlin's column permutation
    where = marlin_permute_scales(torch.arange(2 * 128, dtype=torch.float32).view(2, 128), 256, 128, GROUP,
                                  is_a_8bit=True).long().flatten()
    errors = {}
    for tree in ("pristine", "patched"):
        module = load(tree, MARLIN)
        monkeypatch.setattr(module, "marlin_make_workspace_new", lambda device, existing=None: None)
        layer = _marlin_layer(module, pack_int4(codes), scales)
        read = int16_scales_as_read(layer.weight_scale.data, layer.input_global_scale.data).flatten()
        unpermuted = torch.empty_like(read)
        unpermuted[where] = read
        effective = unpack_codes(layer.weight_packed.data).float() * unpermuted.view(2, 128).repeat_interleave(GROUP, 0)
        errors[tree] = float((effective - truth).norm() / truth.norm())
    assert errors["pristine"] > 5
    assert errors["patched"] < 0.05


REAL_LAYERS = {
    # name in the 27B checkpoint as vLLM prefixes it -> (default "mlp", INT8_ACT's "mlp|linear_attn|self_attn")
    "language_model.model.layers.0.linear_attn.in_proj_qkvz": (False, True),
    "language_model.model.layers.0.linear_attn.in_proj_ba": (False, True),
    "language_model.model.layers.0.linear_attn.out_proj": (False, True),
    "language_model.model.layers.0.mlp.gate_up_proj": (True, True),
    "language_model.model.layers.0.mlp.down_proj": (True, True),
    "language_model.model.layers.3.self_attn.qkv_proj": (False, True),
    "language_model.model.layers.63.self_attn.o_proj": (False, True),
    "language_model.model.layers.63.mlp.down_proj": (True, True),
    "language_model.lm_head": (False, False),
    "language_model.model.embed_tokens": (False, False),
    "mtp.fc": (False, False),
    "mtp.layers.0.mlp.gate_up_proj": (False, False),
    "mtp.layers.0.self_attn.qkv_proj": (False, False),
}


@pytest.mark.parametrize(("name", "expected"), REAL_LAYERS.items())
def test_layer_selection_table(name, expected):
    assert int8_activations_for(name) is expected[0]
    assert int8_activations_for(name, "mlp|linear_attn|self_attn") is expected[1]
    assert int8_activations_for(name, ".") is not (name.startswith("mtp") or "lm_head" in name or "embed" in name)


def test_layer_selection_rejects_bad_regex():
    with pytest.raises(ValueError, match="VLLM_MARLIN_INT8_INCLUDE_RE"):
        int8_activations_for("language_model.model.layers.0.mlp.down_proj", "mlp(")


def test_get_marlin_input_dtype_selects(monkeypatch):
    from vllm.model_executor.layers.quantization.utils.marlin_utils import get_marlin_input_dtype

    monkeypatch.setenv("VLLM_MARLIN_INPUT_DTYPE", "int8")
    mlp, attn = "language_model.model.layers.0.mlp.down_proj", "language_model.model.layers.3.self_attn.o_proj"
    assert get_marlin_input_dtype(mlp) is torch.int8
    assert get_marlin_input_dtype(attn) is None
    assert get_marlin_input_dtype("language_model.lm_head") is None
    assert get_marlin_input_dtype("") is torch.int8  # prefix-less callers keep upstream's answer
    monkeypatch.setenv("VLLM_MARLIN_INT8_INCLUDE_RE", "self_attn")
    assert get_marlin_input_dtype(attn) is torch.int8 and get_marlin_input_dtype(mlp) is None
    monkeypatch.delenv("VLLM_MARLIN_INPUT_DTYPE")
    assert get_marlin_input_dtype(mlp) is None

