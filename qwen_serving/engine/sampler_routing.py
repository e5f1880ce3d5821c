"""When vLLM's sampler takes the sort-free small-k top-k/top-p kernel (qwen_serving.engine.kernels.topk_topp).

patches/sampler-small-topk.patch hands vLLM's ``apply_top_k_top_p`` the batch's largest top-k, read from the
host array vLLM fills the device top-k from (so no device sync), and calls these functions, which decide from
shapes, dtypes and that bound alone. Anything they do not take returns None and vLLM's own path runs.

The patch asks only where vLLM's own dispatch would sort (under 8 rows on CUDA; from 8 rows vLLM's Triton
top-k/top-p keeps exactly k at a tie and runs as it is), and there the kernel's masks are the sort's (ties
included, tests/test_kernel_topk_topp.py), so the target distribution is unchanged. Drafts are different: vLLM samples them from the plain softmax and ignores top-k/top-p; sampling them
from the target's truncated support instead only changes the proposal distribution q, which rejection sampling
corrects for exactly, and spares drafts that the target could never accept.
"""

from __future__ import annotations

import os

import torch

from .kernels.topk_topp import MAX_K, apply_top_k_top_p_small_k, top_k_top_p_probs


def _fits(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None, k_max: int | None) -> bool:
    if k is None or k_max is None or not 1 <= k_max <= MAX_K:
        return False  # no top-k, or one large enough that the candidate sort stops being cheap
    if logits.dim() != 2 or logits.stride(1) != 1:
        return False
    rows = logits.shape[0]
    if tuple(k.shape) != (rows,) or (p is not None and tuple(p.shape) != (rows,)):
        return False  # e.g. per-request parameters against per-token rows: vLLM expands them itself
    if k.device != logits.device or (p is not None and p.device != logits.device):
        return False
    # the kernels need a Triton backend: a CUDA device, or the interpreter (CPU tests)
    return logits.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def takes_small_k(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None, k_max: int | None) -> bool:
    """Whether the kernel can stand in for vLLM's masking of these float32 logits."""
    return logits.dtype == torch.float32 and _fits(logits, k, p, k_max)


def apply_top_k_top_p(
    logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None, k_max: int | None
) -> torch.Tensor | None:
    """vLLM's ``apply_top_k_top_p`` through the kernel (logits masked in place and returned), or None."""
    if not takes_small_k(logits, k, p, k_max):
        return None
    return apply_top_k_top_p_small_k(logits, k, p, k_max)


def draft_probs(
    logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None, k_max: int | None
) -> torch.Tensor | None:
    """Draft probabilities over the top-k/top-p support (fp32, one row per request), or None.

    logits: the temperature-scaled draft logits in the model dtype; they are left as they are.
    """
    if not logits.dtype.is_floating_point or not _fits(logits, k, p, k_max):
        return None
    return top_k_top_p_probs(logits.float(), k, p, k_max)
