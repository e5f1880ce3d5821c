"""The vLLM config a real GDNAttentionMetadataBuilder reads, as a namespace: the GDN engine tests build one per group."""

from __future__ import annotations

from types import SimpleNamespace


def builder_config(num_spec: int, full_graphs: bool, mode: str, max_num_seqs: int,
                   ubatching: bool = False) -> SimpleNamespace:
    from vllm.config import CUDAGraphMode

    return SimpleNamespace(
        compilation_config=SimpleNamespace(
            cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE if full_graphs else CUDAGraphMode.PIECEWISE,
            max_cudagraph_capture_size=None),
        speculative_config=(SimpleNamespace(num_speculative_tokens=num_spec, parallel_drafting=False)
                            if num_spec else None),
        scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs),
        cache_config=SimpleNamespace(mamba_cache_mode=mode),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1, use_ubatching=ubatching),
        additional_config={},
    )
