"""The GDN layer's verify step without vLLM's copies of q, k, v and of its output.

In a batch of speculative decodes only (every single-user MTP step), vLLM 0.28.0's
``QwenGatedDeltaNetAttention._forward_core`` (``model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py``)
runs the conv in place on the qkv columns of the input projection, so the conv output is strided (a row is the
whole qkvz row). ``rearrange_mixed_qkv`` then makes q, k and v contiguous with three ``reshape(-1)`` copies and
a ``torch.cat`` of them into one buffer, and the recurrent kernel's fresh output is copied into
``core_attn_out``. Here the same buffer, laid out the same way, is filled by two strided copies (q and k have
the same width, so one copy writes both), and the kernel writes into ``core_attn_out`` itself.

Same kernels on the same values, so every row the kernel writes is bit-identical to vLLM's. The rows it skips
(tokens past the last speculating request: CUDA-graph padding) keep the zeros the layer allocated
``core_attn_out`` with; vLLM copied the uninitialised rows of its ``new_empty`` output there. No host sync and
no data-dependent shape: every size is a Python int of the metadata or a tensor shape, fixed when a FULL CUDA
graph is captured.
"""

from __future__ import annotations

import torch


def planar_qkv(layer, mixed_qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``layer.rearrange_mixed_qkv(mixed_qkv)``: q, k, v as contiguous ``[1, tokens, heads, dim]`` views of one
    fresh buffer (q's rows, then k's, then v's), filled by two copies where vLLM runs three and a cat."""
    tokens = mixed_qkv.shape[0]
    k_dim = layer.key_dim // layer.tp_size
    v_dim = layer.value_dim // layer.tp_size
    qk, v = mixed_qkv.split([2 * k_dim, v_dim], dim=-1)
    fused = mixed_qkv.new_empty(tokens * (2 * k_dim + v_dim))
    q_end, k_end = tokens * k_dim, 2 * tokens * k_dim
    # [tokens, 2, k_dim] seen as [2, tokens, k_dim]: q's block then k's, in one strided copy
    fused[:k_end].view(2, tokens, k_dim).copy_(qk.unflatten(-1, (2, k_dim)).transpose(0, 1))
    fused[k_end:].view(tokens, v_dim).copy_(v)
    query = fused[:q_end].view(1, tokens, -1, layer.head_k_dim)
    key = fused[q_end:k_end].view(1, tokens, -1, layer.head_k_dim)
    value = fused[k_end:].view(1, tokens, -1, layer.head_v_dim)
    return query, key, value


def forward_spec_only(layer, mixed_qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
                      core_attn_out: torch.Tensor, attn_metadata) -> bool:
    """vLLM's ``_forward_core`` for a batch of speculative decodes only, into ``core_attn_out``; False (nothing
    done) for any other batch, or where the kernel's output dtype is not ``core_attn_out``'s (vLLM's copy casts)."""
    if (attn_metadata.spec_sequence_masks is None or attn_metadata.num_prefills != 0
            or attn_metadata.num_decodes != 0 or core_attn_out.dtype != mixed_qkv.dtype):
        return False
    # the layer module's own names, looked up now: the kernels vLLM's code calls
    from vllm.model_executor.layers.mamba.gdn import qwen_gdn_linear_attn as gdn

    state_indices = attn_metadata.spec_state_indices_tensor
    assert state_indices is not None
    conv_state = layer.kv_cache[0] if gdn.is_conv_state_dim_first() else layer.kv_cache[0].transpose(-1, -2)
    num_tokens = attn_metadata.num_actual_tokens
    num_requests = attn_metadata.num_spec_decodes
    conv_weights = layer.conv1d.weight.view(layer.conv1d.weight.size(0), layer.conv1d.weight.size(2))
    mixed_qkv = gdn.causal_conv1d_update(
        mixed_qkv[:num_tokens],
        conv_state,
        conv_weights,
        layer.conv1d.bias,
        layer.activation,
        conv_state_indices=state_indices[:, 0][:num_requests],
        num_accepted_tokens=attn_metadata.num_accepted_tokens,
        query_start_loc=attn_metadata.spec_query_start_loc,
        max_query_len=state_indices.size(-1),
        validate_data=False,
    )
    query, key, value = planar_qkv(layer, mixed_qkv)
    gdn.fused_sigmoid_gating_delta_rule_update(
        A_log=layer.A_log,
        a=a[:num_tokens],
        b=b[:num_tokens],
        dt_bias=layer.dt_bias,
        q=query,
        k=key,
        v=value,
        initial_state=layer.kv_cache[1],
        inplace_final_state=True,
        cu_seqlens=attn_metadata.spec_query_start_loc[: num_requests + 1],
        ssm_state_indices=state_indices,
        num_accepted_tokens=attn_metadata.num_accepted_tokens,
        use_qk_l2norm_in_kernel=True,
        out=core_attn_out[:num_tokens],
    )
    return True
