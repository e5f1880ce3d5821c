"""Prompt logprobs in blocks of rows (worker-prompt-logprobs-blocks.patch).

vLLM 0.28.0's V1 runner (``GPUModelRunner._get_prompt_logprobs_dict``) turns each request's scheduled prompt chunk
into logits in one ``compute_logits`` call over all of the chunk's positions, then a float32 log-softmax and the
top-N gather over the whole [rows, vocab] block. At max_num_batched_tokens = 2,048 rows and Qwen3.8's 248,320-token
vocabulary that is ~5 GB of transient device memory (bf16 logits 2 B + float32 scores 4 B + the float32 copy
log_softmax makes of its input 4 B, per row and token), which a 24 GB card does not have beside the weights and
the KV pool: a client asking ``prompt_logprobs`` on a long prompt can OOM the engine.

``fill_prompt_logprobs`` does the same per-row work one block of at most BLOCK_ROWS rows at a time and copies each
block's rows into the request's preallocated CPU LogprobsTensors at the same slice the original fills in one go.
Every step after ``compute_logits`` (log-softmax, top-k, gather, rank count) is row-wise, so the rows are the same
bits; ``compute_logits`` itself is a matmul of the block's rows instead of the chunk's (docs/gotchas.md 31: what
that can mean on a GPU).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

# At most this many prompt positions go through compute_logits and the log-softmax at once: 256 x 248,320 x ~10 B
# ~ 0.6 GB transient on Qwen3.8, against ~5 GB for a 2,048-token chunk in one go (the 24 GB card has no room for
# that beside the weights and the KV pool). 256 rows is still a sizeable lm_head GEMM (M = 256); its speed against one
# 2,048-row GEMM is not measured yet. Not a knob: prompt logprobs are rare, and nothing needs a larger block.
BLOCK_ROWS = 256

LOGITS_MODES = ("raw_logits", "processed_logits")


def fill_prompt_logprobs(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    sampler: Any,
    logprobs_mode: str,
    hidden_states: torch.Tensor,
    target_token_ids: torch.Tensor,
    num_prompt_logprobs: int,
    out: Any,
    start_idx: int,
    block_rows: int | None = None,
) -> None:
    """Write the prompt logprobs of ``hidden_states``' rows into ``out`` (a LogprobsTensors on the host) at rows
    ``start_idx`` onward, as vLLM 0.28.0's runner does for one request's chunk, in blocks of ``block_rows``
    (default BLOCK_ROWS).

    hidden_states: [n, hidden], the chunk's positions whose next prompt token is known; target_token_ids: [n] int64,
    that next token for each row; num_prompt_logprobs: the request's top-N (the vocabulary size for -1).
    Copies are non-blocking, as vLLM's: the caller synchronizes before it reads ``out``.
    """
    rows = hidden_states.shape[0]
    step = block_rows or BLOCK_ROWS
    if step < 1:
        raise ValueError(f"block_rows must be at least 1, not {step}")
    as_logits = logprobs_mode in LOGITS_MODES
    for begin in range(0, rows, step):
        end = min(begin + step, rows)
        logits = compute_logits(hidden_states[begin:end])
        # prompt tokens skip the sampling processors, so raw_* and processed_* are the same scores (vLLM's note)
        scores = logits.to(torch.float32) if as_logits else sampler.compute_logprobs(logits)
        del logits  # a bf16 block's float32 copy is what the gather needs; the block itself can go
        token_ids, logprobs, ranks, _ = sampler.gather_logprobs(scores, num_prompt_logprobs,
                                                                target_token_ids[begin:end])
        del scores  # before the next block's logits: one block's [rows, vocab] alive at a time
        chunk = slice(start_idx + begin, start_idx + end)
        out.logprob_token_ids[chunk].copy_(token_ids, non_blocking=True)
        out.logprobs[chunk].copy_(logprobs, non_blocking=True)
        out.selected_token_ranks[chunk].copy_(ranks, non_blocking=True)
