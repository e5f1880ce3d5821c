"""Marlin W4A8-INT8 (``VLLM_MARLIN_INPUT_DTYPE=int8``): sign folding and per-layer selection.

With int8 activations vLLM requantizes a layer's group scales to int16 (``s / s.max() * 4096``,
``marlin_act_int8_process_scales``) and the kernel reads them as unsigned, so a negative group
scale (about half of them in AutoRound's symmetric exports) turns into a huge positive one. The
fix is to move every sign into the int4 codes at load time, before Marlin repacks them:
``s * q == |s| * -q``. One value has no negation: code -8 under a negative scale is the weight
``+8|s|``, and +8 is not an int4 code. AutoRound puts -8 on the largest-magnitude weight of a
group, so this is common, and it is clamped to +7 (an error of exactly ``|s|`` on that one weight,
counted in ``FoldStats``). Re-scaling the group to ``8|s|/7`` instead would move every other weight
of the group by up to ``0.57|s|``; the clamp costs far less in squared error.

Layouts here are Marlin's canonical ones (what ``permute_param_layout_(x, input_dim=0,
output_dim=1, packed_dim=0)`` produces): packed codes int32 ``[K/8, N]`` holding the code of input
row ``8r + j`` in bits ``4j..4j+3`` as ``code + 8``, scales ``[K/G, N]``.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import torch

DEFAULT_INCLUDE_RE = "mlp"
INCLUDE_ENV = "VLLM_MARLIN_INT8_INCLUDE_RE"
# Module names that never take int8 activations: the int8-weight lm_head/embed (Marlin has no
# W8A8 and refuses to load) and the MTP draft module (its acceptance is worth more than its GEMMs).
ALWAYS_EXCLUDED = frozenset({"lm_head", "embed_tokens", "mtp"})

_NIBBLES_PER_WORD = 8


@dataclass(frozen=True)
class FoldStats:
    groups: int  # group scales in the layer
    negative_groups: int  # scales that were negative (now positive)
    clamped_codes: int  # codes -8 under a negative scale, stored as +7

    def describe(self) -> str:
        return (
            f"{self.negative_groups}/{self.groups} negative group scales folded into the codes, "
            f"{self.clamped_codes} codes clamped from +8 to +7"
        )


def fold_negative_scales(
    qweight: torch.Tensor, scales: torch.Tensor, group_size: int, g_idx: torch.Tensor | None = None
) -> FoldStats:
    """Make every group scale non-negative by negating the codes of its group, in place.

    qweight int32 [K/8, N], scales [G, N] (any float dtype), ``g_idx`` [K] for act-order layers
    (group of each input row), else rows are grouped by ``group_size``.
    """
    if qweight.dtype != torch.int32 or qweight.dim() != 2:
        raise ValueError(f"packed int4 weight must be 2-D int32, got {qweight.dtype} {tuple(qweight.shape)}")
    size_k = qweight.shape[0] * _NIBBLES_PER_WORD
    if scales.dim() != 2 or scales.shape[1] != qweight.shape[1]:
        raise ValueError(f"scales {tuple(scales.shape)} do not match packed weight {tuple(qweight.shape)}")
    if g_idx is not None and g_idx.numel() == size_k:
        row_group = g_idx.to(device=qweight.device, dtype=torch.long)
    else:
        if group_size <= 0 or size_k % group_size or size_k // group_size != scales.shape[0]:
            raise ValueError(f"{scales.shape[0]} scale rows do not cover K={size_k} in groups of {group_size}")
        row_group = torch.arange(size_k, device=qweight.device) // group_size

    negative = scales < 0
    num_negative = int(negative.sum())
    if num_negative == 0:
        return FoldStats(scales.numel(), 0, 0)
    clamped = 0
    for j in range(_NIBBLES_PER_WORD):
        shift = 4 * j
        flip = negative[row_group[j::_NIBBLES_PER_WORD]]  # [K/8, N]
        nibble = (qweight >> shift) & 0xF
        # stored nibble u = code + 8; -code is stored as 16 - u, and u == 0 (code -8) saturates at 15
        negated = torch.clamp(16 - nibble, max=15)
        clamped += int((flip & (nibble == 0)).sum())
        qweight ^= torch.where(flip, nibble ^ negated, torch.zeros_like(nibble)) << shift
    scales.copy_(torch.where(negative, -scales, scales))
    return FoldStats(scales.numel(), num_negative, clamped)


def unpack_codes(qweight: torch.Tensor) -> torch.Tensor:
    """int32 [K/8, N] -> int8 codes [K, N] in [-8, 7] (Marlin canonical layout)."""
    shifts = torch.arange(_NIBBLES_PER_WORD, device=qweight.device, dtype=torch.int32) * 4
    nibbles = (qweight.unsqueeze(1) >> shifts.view(1, -1, 1)) & 0xF  # [K/8, 8, N]
    return (nibbles - 8).to(torch.int8).reshape(-1, qweight.shape[1])


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """float32 weight [K, N] = scale * code for the canonical layout."""
    codes = unpack_codes(qweight).to(torch.float32)
    return codes * scales.to(torch.float32).repeat_interleave(group_size, dim=0)


def int16_scales_as_read(requantized: torch.Tensor, global_scale: torch.Tensor | float) -> torch.Tensor:
    """The group scales the int8 Marlin kernel uses: int16 bits read unsigned, times the layer factor.

    ``requantized`` is the output of vLLM's ``marlin_act_int8_process_scales`` (int16 bits stored in
    a 16-bit float tensor).
    """
    unsigned = requantized.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    return unsigned.to(torch.float32) * float(global_scale)


def fold_layer_scales(layer: torch.nn.Module, w_q_name: str, w_s_name: str, g_idx_name: str | None,
                      group_size: int) -> FoldStats | None:
    """vLLM hook (``MarlinLinearKernel.process_weights_after_loading``): fold a layer's signs.

    Only needed where vLLM requantizes the scales to int16, i.e. more than one group along K; a
    channelwise scale stays a float the kernel reads signed.
    """
    from vllm.model_executor.parameter import permute_param_layout_

    qweight, scales = getattr(layer, w_q_name), getattr(layer, w_s_name)
    permute_param_layout_(qweight, input_dim=0, output_dim=1, packed_dim=0)
    permute_param_layout_(scales, input_dim=0, output_dim=1)
    if scales.shape[0] <= 1:
        return None
    g_idx = getattr(layer, g_idx_name) if g_idx_name else None
    stats = fold_negative_scales(qweight.data, scales.data, group_size, g_idx)
    if stats.negative_groups:
        from vllm.logger import init_logger

        init_logger(__name__).debug("W4A8 %s: %s", getattr(layer, "prefix", type(layer).__name__), stats.describe())
    return stats


@functools.lru_cache(maxsize=8)
def _compiled(pattern: str) -> re.Pattern[str]:
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise ValueError(f"{INCLUDE_ENV}={pattern!r} is not a valid regular expression: {exc}") from None


def int8_activations_for(prefix: str, include_re: str = DEFAULT_INCLUDE_RE) -> bool:
    """Whether the linear layer named ``prefix`` runs with int8 activations.

    ``include_re`` is searched in the layer name; layers under lm_head, embed_tokens or mtp never
    qualify, whatever the pattern says.
    """
    if ALWAYS_EXCLUDED.intersection(prefix.split(".")):
        return False
    return _compiled(include_re).search(prefix) is not None
