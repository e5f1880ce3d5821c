"""The inputs of each chained draft pass in one kernel (mtp-draft-inputs.patch).

Before each draft forward after the first, vLLM 0.28.0's ``SpecDecodeBaseProposer.propose`` (the MTP/EAGLE
loop) launches, for a model with M-RoPE positions like Qwen3.5:

* ``draft_token_ids_list[-1].int()``: the last draft's ids as int32;
* ``eagle_step_slot_mapping_metadata_kernel`` (``_update_positions_dependent_metadata``): position + 1 (clamped
  at ``max_model_len``), its KV slot from the block table, ``seq_lens`` + 1, padding slots set to
  ``PADDING_SLOT_ID``;
* ``mrope_positions[1:, :bs] = mrope_positions[0, :bs]``: the new position into the other two M-RoPE rows;
* ``input_ids[:bs] = ...`` and ``hidden_states[:bs] = ...``: the draft ids and the last forward's hidden states
  into the buffers the draft forward reads.

Four of the five are eager torch operations, each a Python dispatch and a launch on a step that waits on the host
(issue #17). ``advance_draft_inputs`` writes the same values into the same buffers with one Triton kernel, the
clamping and slot arithmetic written as vLLM's kernel writes them, and does the host-side bookkeeping of
``_update_positions_dependent_metadata`` unchanged (``slot_mapping``, ``max_seq_len``, the host sequence-length
shadows). Buffer entries beyond the batch stay as they were, as in vLLM, but for the padding slots.

Proposers that change the ids (heterogeneous vocabularies), embed them eagerly (multimodal drafters), keep their
positions fixed (``constant_draft_positions``) or carry XD-RoPE positions keep vLLM's path (``fused_supported``).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from vllm.v1.spec_decode.utils import PADDING_SLOT_ID

BLOCK_H = 1024  # hidden-state columns per iteration of the row copy


@triton.jit
def advance_kernel(
    pos_src_ptr,  # [bs] int64: the last pass's positions (M-RoPE: row 0)
    pos_src_stride,
    pos_out_ptr,  # [POS_ROWS, N] int64: the positions buffer the draft forward reads
    pos_out_stride,
    block_table_ptr,  # [bs, n_blocks_per_req] int32
    block_table_stride,
    seq_lens_ptr,  # [bs] int32, updated in place
    slot_out_ptr,  # [input_batch_size] int64
    tokens_ptr,  # [bs] the last pass's draft ids
    tokens_stride,
    input_ids_ptr,  # [>= bs] int32
    hid_src_ptr,  # [bs, HIDDEN] the last forward's hidden states
    hid_src_stride,
    hid_out_ptr,  # [>= bs, HIDDEN]
    hid_out_stride,
    batch_size,
    HIDDEN: tl.constexpr,
    BLOCK_H: tl.constexpr,
    POS_ROWS: tl.constexpr,
    block_size: tl.constexpr,
    max_model_len: tl.constexpr,
    n_blocks_per_req: tl.constexpr,
    PAD_ID: tl.constexpr,
):
    r = tl.program_id(0)
    if r >= batch_size:  # CUDA-graph padding: only the slot
        tl.store(slot_out_ptr + r, PAD_ID)
        return
    # vLLM's eagle_step_slot_mapping_metadata_kernel arithmetic, term for term
    position = tl.load(pos_src_ptr + r * pos_src_stride)
    new_position = position + 1
    exceeds_max = new_position >= max_model_len
    clamped_position = tl.where(exceeds_max, 0, new_position)
    block_number = tl.minimum(clamped_position // block_size, n_blocks_per_req - 1)
    block_id = tl.load(block_table_ptr + r * block_table_stride + block_number)
    slot_id = block_id * block_size + (clamped_position % block_size)
    slot_id = tl.where(exceeds_max, PAD_ID, slot_id)
    seq_len = tl.load(seq_lens_ptr + r)
    new_seq_len = tl.minimum(tl.where(exceeds_max, 1, seq_len + 1), max_model_len)
    for row in tl.static_range(POS_ROWS):
        tl.store(pos_out_ptr + row * pos_out_stride + r, clamped_position)
    tl.store(slot_out_ptr + r, slot_id)
    tl.store(seq_lens_ptr + r, new_seq_len)
    tl.store(input_ids_ptr + r, tl.load(tokens_ptr + r * tokens_stride).to(tl.int32))
    for start in range(0, HIDDEN, BLOCK_H):
        cols = start + tl.arange(0, BLOCK_H)
        keep = cols < HIDDEN
        row_values = tl.load(hid_src_ptr + r.to(tl.int64) * hid_src_stride + cols, mask=keep)
        tl.store(hid_out_ptr + r.to(tl.int64) * hid_out_stride + cols, row_values, mask=keep)


def fused_supported(proposer: Any) -> bool:
    """Whether ``propose``'s draft loop may take ``advance_draft_inputs`` for this proposer."""
    return not (proposer.use_heterogeneous_vocab or proposer.supports_mm_inputs
                or proposer.constant_draft_positions
                or (proposer.uses_xdrope_dim > 0 and proposer.draft_uses_xdrope_dim > 0))


def position_buffer(proposer: Any) -> tuple[torch.Tensor, int]:
    """The positions buffer the draft forward reads, as rows, and how many rows carry the position."""
    if proposer.uses_mrope:
        return proposer.mrope_positions, 3
    return proposer.positions.view(1, -1), 1


def advance_draft_inputs(proposer: Any, draft_token_ids: torch.Tensor, positions: torch.Tensor,
                         hidden_states: torch.Tensor, common_attn_metadata: Any, batch_size: int,
                         input_batch_size: int) -> torch.Tensor:
    """The top of one draft pass of vLLM's loop (the id cast, ``_update_positions_dependent_metadata``, the id
    and hidden-state copies) in one launch; returns the pass's positions as ``_update_positions_dependent_metadata``
    does. ``positions`` are the last pass's ([3, bs] with M-RoPE), ``hidden_states`` the last forward's [bs, H]."""
    cad = common_attn_metadata
    hidden_out = proposer.hidden_states
    if hidden_states.dtype != hidden_out.dtype or hidden_states.shape[1] != hidden_out.shape[1]:
        raise ValueError("draft hidden states must be rows of the hidden-state buffer's width and dtype")
    if hidden_states.stride(1) != 1:  # the kernel copies rows of unit stride (the forward's outputs are)
        hidden_states = hidden_states.contiguous()
    source = positions[0] if proposer.uses_mrope else positions
    out, rows = position_buffer(proposer)
    block_table = cad.block_table_tensor
    slots = proposer._slot_mapping_buffer
    advance_kernel[(input_batch_size,)](
        source, source.stride(0), out, out.stride(0), block_table, block_table.stride(0), cad.seq_lens, slots,
        draft_token_ids, draft_token_ids.stride(0), proposer.input_ids, hidden_states, hidden_states.stride(0), hidden_out,
        hidden_out.stride(0), batch_size,
        HIDDEN=hidden_out.shape[1], BLOCK_H=min(BLOCK_H, triton.next_power_of_2(hidden_out.shape[1])),
        POS_ROWS=rows, block_size=proposer.block_size, max_model_len=proposer.max_model_len,
        n_blocks_per_req=block_table.shape[1], PAD_ID=PADDING_SLOT_ID,
    )
    # the host half of _update_positions_dependent_metadata, as vLLM has it
    cad.slot_mapping = slots[:batch_size]
    cad.max_seq_len = min(cad.max_seq_len + 1, proposer.max_model_len)
    if cad._seq_lens_cpu is not None:
        cad._seq_lens_cpu += 1
    if cad._num_computed_tokens_cpu is not None:
        cad._num_computed_tokens_cpu += 1
    if cad.seq_lens_cpu_upper_bound is not None:
        cad.seq_lens_cpu_upper_bound += 1
    return proposer.mrope_positions[:, :batch_size] if proposer.uses_mrope else proposer.positions[:batch_size]
