"""Triton kernels for the decode and prefill hot paths, each beside its plain-torch reference.

lookup: drafts from the request's own token history. topk_topp: sort-free small-k top-k/top-p.
spec_attn: split-KV multi-query (verify) attention over vLLM's paged KV cache.
prefill_int8_attn: SageAttention-style int8-QK causal prefill attention.
"""
