"""When vLLM's FlashAttention backend hands a batch to our kernels instead of ``flash_attn_varlen_func``.

Verify step (patches/spec-decode-attn.patch, ``VLLM_SPEC_DECODE_ATTN=1``): speculative-decode verify batches,
every request with the same small number of query tokens (2-16), go to qwen_serving.engine.kernels.spec_attn, whose
split-KV grid keeps the SMs busy where FlashAttention runs one program per (request, head). The kernel is exact
causal attention over the paged cache for any batch whose query lengths fit, so these rules only pick where it
pays; everything they refuse (prefill chunks, mixed batches, cascade attention, windows, soft caps, sinks,
ALiBi, context parallelism, quantized queries, fp8 or other KV dtypes, head sizes the kernel lacks) stays on
FlashAttention. Decided from host values only: no device sync in the forward pass.

By architecture: both kernels stand in for FlashAttention 2 only, which vLLM runs on sm80/86/89 (the 3090's path).
On sm90 vLLM runs FlashAttention 3, which was faster than either kernel at every geometry measured on the H200
(bench/results/kernels-h200.json: the 5-query verify at 0.49-0.67x FA3's speed from 1.5k to 32k context, int8
prefill at 0.70-0.90x); FA4 (sm100) is unmeasured, so it is left alone too. `--attention-config.flash_attn_version=2`
puts an H200 on the 3090's path.

The kernel's scratch (split partials) is allocated once, when the first layer is built, so CUDA graphs capture
fixed addresses and vLLM's memory profiling counts it; layers of one geometry share it (they run one at a time).

Prefill (patches/prefill-int8-attn.patch, ``VLLM_PREFILL_INT8_ATTN=1``): a prefill chunk of a single request on
a head_dim-256 layer goes to qwen_serving.engine.kernels.prefill_int8_attn (int8 Q.K^T), with the request's context
gathered from the paged cache into contiguous K/V. The context length is the metadata's host ``max_seq_len``:
for one request in prefill that is its exact length (computed + scheduled prompt tokens; prompt tokens are never
rejected, unlike drafts). Anything else stays on FlashAttention, and so does a chunk under CUDA-graph capture
(the kernel allocates its int8 copies per call).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .kernels.prefill_int8_attn import prefill_int8_attention
from .kernels.spec_attn import SpecAttention

MIN_VERIFY_QUERY = 2  # one query token is plain decode, which FlashAttention already splits
MAX_VERIFY_QUERY = 16
MAX_SPLITS = 32
SCRATCH_BUDGET_BYTES = 64 << 20  # per layer geometry; the splits shrink to fit
HALF_DTYPES = (torch.bfloat16, torch.float16)
# No fp8: FlashAttention takes an fp8 cache only with FA3 (sm90) / FA4 (sm100), where the layer quantizes the
# query to fp8 too, and the kernel reads K/V in the query's dtype.
VERIFY_KV_CACHE_DTYPES = ("auto", "bfloat16", "float16")
PREFILL_HEAD_DIM = 256  # the serving geometry the int8 kernel is tuned for
STANDS_IN_FOR_FA = 2  # the FlashAttention version the kernels replace (see the module docstring)
MIN_PREFILL_QUERY = MAX_VERIFY_QUERY + 1


@dataclass(frozen=True)
class VerifyGeometry:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_batch: int
    max_query_len: int
    max_splits: int

    def scratch_bytes(self) -> int:
        rows = self.max_query_len * self.num_heads // self.num_kv_heads
        return self.max_batch * self.num_kv_heads * self.max_splits * rows * (self.head_dim + 1) * 4


def layer_refusal(impl: Any) -> str | None:
    """Why a FlashAttentionImpl can never take the verify kernel (None: it can)."""
    head = impl.head_size
    checks = {
        "not decoder self-attention": str(getattr(impl.attn_type, "value", impl.attn_type)) != "decoder",
        "ALiBi": impl.alibi_slopes is not None,
        "sliding window": tuple(impl.sliding_window) != (-1, -1),
        "logit soft cap": bool(impl.logits_soft_cap),
        "attention sinks": impl.sinks is not None,
        "decode context parallelism": impl.dcp_world_size != 1,
        f"head size {head} (the kernel needs a power of two >= 16)": head < 16 or head & (head - 1) != 0,
        f"KV cache dtype {impl.kv_cache_dtype}": impl.kv_cache_dtype not in VERIFY_KV_CACHE_DTYPES,
        "query heads not a multiple of KV heads": impl.num_heads % impl.num_kv_heads != 0,
        # None: no vllm_flash_attn build to ask (CPU, where the kernels run interpreted)
        f"FlashAttention {impl.vllm_flash_attn_version}, faster than the kernels where measured (sm90)":
            impl.vllm_flash_attn_version not in (None, STANDS_IN_FOR_FA),
    }
    return next((why for why, refused in checks.items() if refused), None)


def prefill_layer_refusal(impl: Any) -> str | None:
    """Why a FlashAttentionImpl can never take the int8 prefill kernel (None: it can)."""
    if impl.head_size != PREFILL_HEAD_DIM:
        return f"head size {impl.head_size} (the int8 prefill kernel is for {PREFILL_HEAD_DIM})"
    if impl.kv_cache_dtype not in ("auto", "bfloat16", "float16"):
        return f"KV cache dtype {impl.kv_cache_dtype} (the kernel reads bf16/fp16 K/V)"
    return layer_refusal(impl)


def verify_geometry(impl: Any, max_num_seqs: int, num_speculative_tokens: int | None, num_sms: int) -> VerifyGeometry:
    """Scratch sizing: the scheduler's batch cap, the verify block (drafts + 1, at most 16; 16 when vLLM does not
    speculate), and as many splits as one wave needs at batch 1 (the kernel's own default) within the budget."""
    max_query_len = MAX_VERIFY_QUERY if not num_speculative_tokens else min(MAX_VERIFY_QUERY,
                                                                              num_speculative_tokens + 1)
    max_query_len = max(MIN_VERIFY_QUERY, max_query_len)
    one = VerifyGeometry(impl.num_heads, impl.num_kv_heads, impl.head_size, max(1, max_num_seqs), max_query_len, 1)
    wave = -(-num_sms // impl.num_kv_heads)
    fit = SCRATCH_BUDGET_BYTES // one.scratch_bytes()
    splits = max(1, min(MAX_SPLITS, wave, fit))
    return VerifyGeometry(one.num_heads, one.num_kv_heads, one.head_dim, one.max_batch, max_query_len, splits)


_shared: dict[tuple, SpecAttention] = {}  # (geometry, device) -> the kernel every such layer uses


def release_verify_kernels() -> None:
    """Drop the shared verify kernels and their scratch, so a rebuilt engine (or a test) allocates afresh."""
    _shared.clear()


def verify_attention_for(impl: Any, vllm_config: Any) -> SpecAttention | None:
    """The shared verify kernel for this layer's geometry, allocated on first use; None if the layer never
    qualifies (or there is no engine config to size it from)."""
    if vllm_config is None or layer_refusal(impl) is not None:
        return None
    device = torch.device(vllm_config.device_config.device)
    if device.type == "cuda":
        num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    else:
        num_sms = 8  # the kernel's CPU (interpreter) default
    spec = vllm_config.speculative_config
    geometry = verify_geometry(impl, vllm_config.scheduler_config.max_num_seqs,
                               spec.num_speculative_tokens if spec is not None else None, num_sms)
    key = (geometry, str(device))
    if key not in _shared:
        _shared[key] = SpecAttention(geometry.num_heads, geometry.num_kv_heads, geometry.head_dim,
                                     max_batch=geometry.max_batch, max_query_len=geometry.max_query_len,
                                     max_splits=geometry.max_splits, device=device)
    return _shared[key]


def takes_verify_path(spec_attn: SpecAttention, metadata: Any, query: torch.Tensor, key_cache: torch.Tensor) -> bool:
    """Whether this batch is a verify batch the kernel takes (FlashAttentionMetadata, host values only)."""
    if not _plain_causal(metadata):
        return False
    query_len = metadata.max_query_len
    num_reqs = metadata.query_start_loc.shape[0] - 1
    if not MIN_VERIFY_QUERY <= query_len <= spec_attn.max_query_len or not 1 <= num_reqs <= spec_attn.max_batch:
        return False
    if metadata.num_actual_tokens != num_reqs * query_len:
        return False  # not uniform: a prefill chunk or a mix of requests with and without drafts
    return query.dtype in HALF_DTYPES and key_cache.dtype == query.dtype


def _plain_causal(metadata: Any) -> bool:
    return (not metadata.use_cascade and metadata.causal is True and metadata.mm_prefix_query_range_tensor is None
            and metadata.rswa_prefix_lens is None)


def takes_prefill_path(metadata: Any, query: torch.Tensor, key_cache: torch.Tensor) -> bool:
    """Whether this batch is one request's prefill chunk the int8 kernel takes (host values only)."""
    if not _plain_causal(metadata) or metadata.query_start_loc.shape[0] != 2:
        return False  # exactly one request
    if not MIN_PREFILL_QUERY <= metadata.max_query_len <= metadata.max_seq_len:
        return False  # decode and verify steps stay on FlashAttention
    if query.dtype not in HALF_DTYPES or key_cache.dtype != query.dtype:
        return False
    return not (query.is_cuda and torch.cuda.is_current_stream_capturing())


def run_prefill(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    metadata: Any,
    output: torch.Tensor,
    softmax_scale: float,
) -> torch.Tensor:
    """The int8 prefill kernel on FlashAttention's arguments: the request's pages (this chunk's K/V already
    written) gathered into contiguous [context, kv_heads, head_dim] K and V; writes the chunk's output rows."""
    n_q, n_k = metadata.max_query_len, metadata.max_seq_len
    page = key_cache.shape[1]
    blocks = metadata.block_table[0, : -(-n_k // page)].long()
    keys = key_cache[blocks].flatten(0, 1)[:n_k]
    values = value_cache[blocks].flatten(0, 1)[:n_k]
    return prefill_int8_attention(query[:n_q], keys, values, softmax_scale, out=output[:n_q])


def run_verify(
    spec_attn: SpecAttention,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    metadata: Any,
    output: torch.Tensor,
    softmax_scale: float,
) -> torch.Tensor:
    """The verify kernel on FlashAttention's arguments: caches as [num_blocks, block_size, kv_heads, head_dim]
    views; writes the first num_actual_tokens rows of output."""
    tokens = metadata.num_actual_tokens
    return spec_attn(
        query[:tokens], key_cache, value_cache, metadata.block_table, metadata.seq_lens, metadata.query_start_loc,
        metadata.max_query_len, softmax_scale, out=output[:tokens],
    )
