"""Keep a prefill that has the shape of a speculative decode out of the FULL verify graph (mtp-uniform-decode-guard.patch).

vLLM 0.28.0's V1 runner calls a batch a uniform decode from its shape alone: every request scheduled
1 + k tokens. A prompt of exactly 1 + k tokens (or a prompt's last chunk of that length, alone or beside
decodes of the same length) has that shape, and is then replayed through the FULL CUDA graph captured for
the verify step. The graph runs the Gated DeltaNet layers' speculative kernels on the buffers of the capture,
which the metadata builder refreshes only for batches without prefills: the request's recurrent state is
neither read from its prompt nor written, and its logits (prompt logprobs, first token) are garbage. Measured
on the H200 (visit 16, single-user plan, MTP k = 4): a 5-token prompt's four prompt logprobs came back ~-12
where the design's tokens sit at ~-0.3, the engine's top token wrong at all four. The V2 runner already asks
whether any request is still prefilling (`get_uniform_decode_token_count(..., has_prefill)`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence


def uniform_decode_override(num_spec_tokens: int, req_ids: Sequence[str], num_scheduled_tokens: Sequence[int],
                            scheduled_spec_decode_tokens: Mapping[str, Sequence[int]]) -> bool | None:
    """`force_uniform_decode` for this step: False when the batch has the verify step's shape but a request in it
    is not a decode with its k drafts (a prefill); None (vLLM decides from the shape) otherwise."""
    if num_spec_tokens <= 0 or not req_ids:
        return None
    query_len = 1 + num_spec_tokens
    if any(n != query_len for n in num_scheduled_tokens):
        return None  # not the verify shape: vLLM's own test says so already
    for req_id in req_ids:
        if len(scheduled_spec_decode_tokens.get(req_id, ())) != num_spec_tokens:
            return False
    return None
