"""Triton kernels for the decode and prefill hot paths, each beside its plain-torch reference.

lookup: drafts from the request's own token history. topk_topp: sort-free small-k top-k/top-p.
spec_attn: split-KV multi-query (verify) attention over vLLM's paged KV cache.
prefill_int8_attn: SageAttention-style int8-QK causal prefill attention.
kvarn: the KVarN 4/2-bit KV cache tiles; kv_fidelity: vLLM's int4 per-token-head cache in torch and the
attention-output error of either against 16-bit K/V.
"""
