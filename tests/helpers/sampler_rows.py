"""Logits rows that tell top-k/top-p rules apart (tests/test_engine_hooks_sampler.py, and on a GPU at the real
vocabulary tests/gpu/test_engine_hooks_gpu.py)."""

from __future__ import annotations

import torch


def designed(rows: int, vocab: int, device: str = "cpu", seed: int = 0):
    """(logits, k, p): rows in four kinds, in turn: bf16-level random logits; 10 tokens tied at the k-th largest
    value (k = 4 under one larger token: the sort keeps all 11, vLLM's Triton path exactly 4); exact top-p cuts
    (8 tokens at 0, the rest -inf, p = 0.625: the 3 lowest carry exactly 1 - p of the mass, which the sort masks);
    4 tokens at 0 under k = 12, more than the finite tokens (p = 0.75: one masked at exactly 1 - p)."""
    gen = torch.Generator(device=device).manual_seed(seed + rows)
    logits = (torch.randn(rows, vocab, generator=gen, device=device) * 2).bfloat16().float()
    k = torch.randint(1, 21, (rows,), generator=gen, device=device)
    p = torch.rand(rows, generator=gen, device=device) * 0.8 + 0.15
    for r in range(rows):
        kind = r % 4
        if kind == 1:
            logits[r] = logits[r].clamp(max=0.0)
            logits[r, 2] = 3.0
            logits[r, torch.arange(5, 5 + 4 * 10, 4, device=device)] = 1.0
            k[r] = 4
        elif kind == 2:
            logits[r] = float("-inf")
            logits[r, 40:48] = 0.0
            k[r], p[r] = 8, 0.625
        elif kind == 3:
            logits[r] = float("-inf")
            logits[r, [3, 90, 91, vocab - 1]] = 0.0
            k[r], p[r] = 12, 0.75
    return logits, k, p
