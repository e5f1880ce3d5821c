"""The other GDN KV-cache groups' attention metadata from the step's first GDN build (gdn-metadata-reuse.patch).

vLLM 0.28.0 cuts the hybrid model's 48 GDN layers into three KV-cache groups of equal spec, and builds each group's
``GDNAttentionMetadata`` from the same batch: only the block table differs between them. The GDN builder did not
support ``update_block_table``, so ``GPUModelRunner._build_attention_metadata`` ran its full ``build()`` (host
counts, mask indexing, host-to-device copies, CUDA-graph buffer fills) three times a step.

``update_block_table`` here returns what ``build()`` would return for another group, field for field:

* redone from that group's block table: ``spec_state_indices_tensor``, ``non_spec_state_indices_tensor`` and
  ``prefill_state_indices``, through the same ``mamba_get_block_table_tensor`` gather (prefix-caching "align"
  mode) and the same row selection as ``build()`` (``spec_rows`` for a batch of speculative decodes only, vLLM's
  host-mask indexing in a mixed one);
* taken over from the first build: everything else (counts, query locations, token indices, accepted counts,
  chunk and conv1d metadata), which ``build()`` computes from the batch alone. The group's layers share these
  tensors as the layers of one group already do;
* in the FULL-CUDA-graph decode paths, every tensor ``build()`` returns as a view of the builder's persistent
  buffers is written into *this* builder's buffers and returned as their view: that group's graphs were captured
  against them.

``build()`` records on its metadata what the reuse needs and the metadata does not hold (``remember_build``):
the host speculation mask, the device ``seq_lens`` the align-mode gather reads, and the padded batch size.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from vllm.v1.attention.backends.utils import NULL_BLOCK_ID, mamba_get_block_table_tensor

from qwen_serving.engine.gdn_spec_rows import spec_rows

RECORD = "_qs_gdn_build"


@dataclasses.dataclass(frozen=True)
class BuildRecord:
    """What a GDN ``build()`` read besides the block table and its metadata keeps no trace of."""

    seq_lens: torch.Tensor  # the batch's device seq_lens (the align-mode gather's start block)
    spec_mask_cpu: torch.Tensor | None  # build()'s spec_sequence_masks_cpu: None when no row speculates
    batch_size: int  # common_attn_metadata.num_reqs (padded for CUDA graphs)


def reuse_supported(vllm_config: Any) -> bool:
    """Whether the runner may hand this builder another group's metadata. Not with micro-batching: the runner's
    cache key holds no micro-batch id, so it would pass one micro-batch's metadata with the next one's table."""
    return not vllm_config.parallel_config.use_ubatching


def remember_build(metadata: Any, common_attn_metadata: Any, spec_mask_cpu: torch.Tensor | None) -> None:
    setattr(metadata, RECORD, BuildRecord(common_attn_metadata.seq_lens, spec_mask_cpu,
                                          common_attn_metadata.num_reqs))


def _into_buffer(buffer: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``values`` written into the front of a persistent buffer; the view build() returns."""
    view = buffer[: values.size(0)]
    view.copy_(values, non_blocking=True)
    return view


def update_block_table(builder: Any, metadata: Any, block_table: torch.Tensor) -> Any:
    """``builder.build()``'s metadata for the group whose block table is ``block_table``, from ``metadata``, the
    same step's build for another group of the same spec and builder class."""
    record: BuildRecord | None = getattr(metadata, RECORD, None)
    if record is None:
        raise ValueError("GDN metadata without a build record: update_block_table takes a GDN build() result")
    if block_table.size(0) != record.batch_size:
        raise ValueError(f"block table of {block_table.size(0)} rows for a batch of {record.batch_size}")
    rows = mamba_get_block_table_tensor(
        block_table, record.seq_lens, builder.kv_cache_spec, builder.vllm_config.cache_config.mamba_cache_mode)
    mask = record.spec_mask_cpu
    batch = record.batch_size
    num_spec_decodes, num_decodes, num_prefills = metadata.num_spec_decodes, metadata.num_decodes, \
        metadata.num_prefills
    cudagraph_max = builder.decode_cudagraph_max_bs
    fields: dict[str, Any] = {}

    if mask is None:
        non_spec_state = rows[:, 0]
        if num_prefills > 0:
            fields["prefill_state_indices"] = non_spec_state[num_decodes:] if num_decodes > 0 else non_spec_state
        if builder.use_full_cuda_graph and num_prefills == 0 and num_decodes <= cudagraph_max:
            builder.non_spec_state_indices_tensor[:num_decodes].copy_(non_spec_state, non_blocking=True)
            non_spec_state = builder.non_spec_state_indices_tensor[:batch]
            non_spec_state[num_decodes:].fill_(NULL_BLOCK_ID)
            fields["non_spec_query_start_loc"] = _into_buffer(builder.non_spec_query_start_loc,
                                                              metadata.non_spec_query_start_loc)
        fields["non_spec_state_indices_tensor"] = non_spec_state
        return dataclasses.replace(metadata, **fields)

    spec_columns = rows[:, : builder.num_spec + 1]
    if num_prefills == 0 and num_decodes == 0:
        spec_state = spec_rows(spec_columns, mask, num_spec_decodes)
    else:
        # a mixed batch (num_decodes is 0 here: build() counts them as prefills beside speculative decodes)
        spec_state = spec_columns[mask]
        fields["non_spec_state_indices_tensor"] = rows[~mask, 0]
        if num_prefills > 0:
            fields["prefill_state_indices"] = fields["non_spec_state_indices_tensor"]
    if (builder.use_full_cuda_graph and num_prefills == 0 and num_decodes == 0
            and num_spec_decodes <= cudagraph_max and metadata.num_spec_decode_tokens <= cudagraph_max):
        builder.spec_state_indices_tensor[:num_spec_decodes].copy_(spec_state, non_blocking=True)
        spec_state = builder.spec_state_indices_tensor[:batch]
        spec_state[num_spec_decodes:].fill_(NULL_BLOCK_ID)
        # build() fills these from the batch alone: the first build's values, padding included
        for name in ("spec_sequence_masks", "spec_token_indx", "non_spec_token_indx", "spec_query_start_loc",
                     "num_accepted_tokens"):
            fields[name] = _into_buffer(getattr(builder, name), getattr(metadata, name))
    fields["spec_state_indices_tensor"] = spec_state
    return dataclasses.replace(metadata, **fields)
