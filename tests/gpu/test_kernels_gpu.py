"""The four kernels at the real model's shapes on a CUDA GPU (issue 7): the CPU tests' comparisons, full size.

Needs only torch + triton (vLLM is used for one extra comparison when importable):
    pytest -m gpu tests/gpu/test_kernels_gpu.py        # about a minute on an H200
Shapes: 24 query / 4 KV heads, head_dim 256, vocabulary 248,320, vLLM's packed paged KV layout.
Tolerances: lookup and sampler masks exact; attention max |error| <= 1e-2 (bf16) and
cosine >= 0.9999; int8 prefill cosine >= 0.9999 per head.
"""

from __future__ import annotations

import pytest
import torch

from qwen_serving import model
from qwen_serving.engine.kernels.draft_sample import MAX_CANDIDATES, sample_draft, sample_draft_reference
from qwen_serving.engine.kernels.lookup import lookup_draft, lookup_draft_reference
from qwen_serving.engine.kernels.prefill_int8_attn import prefill_attention_reference, prefill_int8_attention
from qwen_serving.engine.kernels.spec_attn import SpecAttention, spec_attention_reference
from qwen_serving.engine.kernels.topk_topp import (
    apply_top_k_top_p_small_k,
    sample_top_k_top_p,
    softmax,
    top_k_top_p_probs,
    top_k_top_p_reference,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

HQ, HKV, HEAD_DIM, VOCAB = model.Q_HEADS, model.KV_HEADS, model.HEAD_DIM, model.VOCAB


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()


# ---- lookup: 64k-token histories, batch 8 -------------------------------------------------------------------


def test_lookup_64k_batch_8():
    gen = torch.Generator().manual_seed(0)
    width = 65536
    history = torch.randint(0, VOCAB, (8, width), generator=gen, dtype=torch.int32)
    lengths = torch.tensor([width - 37 * b for b in range(8)], dtype=torch.int32)
    for b in range(8):
        end = int(lengths[b])
        if b in (1, 5):  # a verbatim quote of an early span: a 12-token match far back
            history[b, end - 40 : end] = history[b, 1000 + 97 * b : 1040 + 97 * b]
        elif b == 2:  # periodic tail: the match overlaps the suffix
            history[b, end - 30 : end] = torch.tensor([5, 6, 7], dtype=torch.int32).repeat(10)
        elif b in (3, 7):  # tiny vocabulary everywhere: ties, matches of every length
            history[b] = torch.randint(0, 2, (width,), generator=gen, dtype=torch.int32)
        elif b == 6:  # a 7-token match only: shorter than nmax, longer than nmin
            history[b, end - 7 : end] = history[b, 5000:5007]
    got = lookup_draft(history.cuda(), lengths.cuda(), 8)
    want = lookup_draft_reference(history, lengths, 8)
    for name in ("match_len", "num_valid", "tokens"):
        assert torch.equal(getattr(got, name).cpu(), getattr(want, name)), name
    assert got.match_len.tolist() == [0, 12, 12, 12, 0, 12, 7, 12]


# ---- top-k / top-p over the real vocabulary ---------------------------------------------------------------


def _sampler_rows(rows: int = 16, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    logits = (torch.randn(rows, VOCAB, device="cuda", generator=gen) * 3).bfloat16().float()
    k = torch.randint(1, 21, (rows,), device="cuda", generator=gen)
    p = torch.rand(rows, device="cuda", generator=gen) * 0.9 + 0.1
    k[:5] = 20
    p[0] = 0.95
    kth = logits[1].topk(5).values[-1]
    logits[1, torch.arange(7, VOCAB, 20011, device="cuda")] = kth  # ties at the 5th value, within the candidates
    k[1] = 5
    logits[2, torch.arange(3, VOCAB, 997, device="cuda")] = logits[2].max() - 1.0  # 250 ties at the k-th value
    logits[3, 1000:] = float("-inf")  # a grammar mask
    p[4] = 1.0
    return logits, k, p


def test_topk_topp_masks_match_reference_248k():
    logits, k, p = _sampler_rows()
    for pp in (p, None):
        got = apply_top_k_top_p_small_k(logits.clone(), k, pp, 20)
        want = top_k_top_p_reference(logits, k, pp)
        bad = (got.isinf() != want.isinf()).any(dim=1).nonzero().flatten().tolist()
        assert not bad, f"rows {bad}"
        probs = top_k_top_p_probs(logits, k, pp, 20)
        torch.testing.assert_close(probs, want.softmax(dim=-1), atol=1e-6, rtol=1e-5)


def test_topk_topp_matches_vllm_on_cuda():
    try:
        from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch
    except Exception as err:  # vLLM is optional here
        pytest.skip(f"vLLM not importable: {err}")
    logits, k, p = _sampler_rows(seed=1)
    got = apply_top_k_top_p_small_k(logits.clone(), k, p, 20)
    want = apply_top_k_top_p_pytorch(logits.clone(), k, p)
    assert torch.equal(got.isinf(), want.isinf())  # also shows vLLM's CUDA sort orders ties by index


def test_sampling_stays_in_support_and_softmax_248k():
    logits, k, p = _sampler_rows(rows=5, seed=2)
    tokens, probs = sample_top_k_top_p(logits, k, p, 20)
    assert (probs[torch.arange(5, device="cuda"), tokens] > 0).all()
    torch.testing.assert_close(softmax(logits), logits.softmax(dim=-1), atol=1e-7, rtol=1e-5)


# ---- split-KV verify attention: 16k context -----------------------------------------------------------------


def _paged(seq_lens, q_lens, page, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    pages = [-(-s // page) for s in seq_lens]
    num_blocks = sum(pages) + 8
    kv = torch.randn(num_blocks, page, HKV, 2 * HEAD_DIM, device="cuda", generator=gen).bfloat16()
    perm = torch.randperm(num_blocks, device="cuda", generator=gen).int()
    block_table = torch.zeros(len(seq_lens), max(pages) + 4, dtype=torch.int32, device="cuda")
    used = 0
    for b, n in enumerate(pages):
        block_table[b, :n] = perm[used : used + n]
        used += n
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q = torch.randn(int(qsl[-1]), HQ, HEAD_DIM, device="cuda", generator=gen).bfloat16()
    seq = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    return q, kv, block_table, seq, qsl


@pytest.mark.parametrize("width", [3707, 40960])
def test_draft_sample_matches_reference_at_draft_vocab_sizes(width):
    # the draft head's K columns (the scripted checkpoint's 3,707, the spec's ~40k) into the full vocabulary
    gen = torch.Generator().manual_seed(width)
    rows, vocab = 8, model.VOCAB
    logits = (torch.randn(rows, width, generator=gen) * 3).to(torch.bfloat16)
    ids = torch.randperm(vocab, generator=gen)[:width].sort().values
    temperature = torch.tensor([0.0, 0.6, 0.6, 1.0, 0.8, 0.6, 1.2, 0.6])
    top_k = torch.tensor([20, 20, 1, 5, 100, 20, 20, 64])
    top_p = torch.tensor([0.95, 0.95, 1.0, 0.5, 0.9, 0.2, 1.0, 0.95])
    noise = torch.empty(rows, MAX_CANDIDATES).exponential_(generator=gen)
    tokens, probs = sample_draft(logits.cuda(), ids.cuda(), vocab, temperature.cuda(), top_k.cuda(), top_p.cuda(),
                                 noise.cuda())
    want_tokens, want_probs = sample_draft_reference(logits, ids, vocab, temperature, top_k, top_p, noise)
    assert torch.equal(tokens.cpu(), want_tokens)
    torch.testing.assert_close(probs.cpu(), want_probs, rtol=0, atol=1e-6)


@pytest.mark.parametrize("q_len,page", [(5, 16), (16, 16), (5, 528)])
def test_spec_attn_16k_bf16(q_len, page):
    seq_lens = [16384, 16384 - 1000, 1500, 16384 - 3]
    q, kv, bt, seq, qsl = _paged(seq_lens, [q_len] * 4, page)
    kc, vc = kv[..., :HEAD_DIM], kv[..., HEAD_DIM:]  # vLLM 0.28.0 FlashAttention: K|V packed per head
    attn = SpecAttention(HQ, HKV, HEAD_DIM, max_batch=4, max_query_len=16, max_splits=64, device="cuda")
    got = attn(q, kc, vc, bt, seq, qsl, q_len, HEAD_DIM**-0.5).float()
    want = spec_attention_reference(q, kc, vc, bt, seq, qsl, HEAD_DIM**-0.5)
    assert (got - want).abs().max().item() <= 1e-2 and _cos(got, want) >= 0.9999


def test_spec_attn_cuda_graph_replay_with_new_lengths():
    q, kv, bt, seq, qsl = _paged([16384, 16384], [5, 5], 16, seed=2)
    kc, vc = kv[..., :HEAD_DIM], kv[..., HEAD_DIM:]
    attn = SpecAttention(HQ, HKV, HEAD_DIM, max_batch=2, max_query_len=8, max_splits=64, device="cuda")
    out = torch.empty_like(q)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        attn(q, kc, vc, bt, seq, qsl, 5, HEAD_DIM**-0.5, out=out)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        attn(q, kc, vc, bt, seq, qsl, 5, HEAD_DIM**-0.5, out=out)
    for lengths in ([16384, 700], [33, 12000]):
        seq.copy_(torch.tensor(lengths, dtype=torch.int32))
        q.copy_(torch.randn_like(q, dtype=torch.float32).bfloat16())
        graph.replay()
        want = spec_attention_reference(q, kc, vc, bt, seq, qsl, HEAD_DIM**-0.5)
        assert (out.float() - want).abs().max().item() <= 1e-2


# ---- int8-QK prefill -----------------------------------------------------------------------------------------


def _per_head_cos(q, k, v, got) -> float:
    group = HQ // HKV
    worst = 1.0
    for kvh in range(HKV):  # one KV head at a time keeps the fp32 score matrix to a few GB
        heads = slice(kvh * group, (kvh + 1) * group)
        want = prefill_attention_reference(q[:, heads], k[:, kvh : kvh + 1], v[:, kvh : kvh + 1])
        for h in range(group):
            worst = min(worst, _cos(got[:, heads][:, h], want[:, h]))
    return worst


@pytest.mark.parametrize("n_q,n_k,key_bias", [(4096, 4096, 0.0), (4096, 4096, 20.0), (16384, 16384, 0.0),
                                              (2048, 8192, 5.0)])
def test_prefill_int8_cosine(n_q, n_k, key_bias):
    gen = torch.Generator(device="cuda").manual_seed(n_q + n_k)
    q = torch.randn(n_q, HQ, HEAD_DIM, device="cuda", generator=gen).bfloat16()
    k = torch.randn(n_k, HKV, HEAD_DIM, device="cuda", generator=gen)
    k = (k + key_bias * torch.randn(1, HKV, HEAD_DIM, device="cuda", generator=gen)).bfloat16()
    v = torch.randn(n_k, HKV, HEAD_DIM, device="cuda", generator=gen).bfloat16()
    got = prefill_int8_attention(q, k, v)
    assert _per_head_cos(q, k, v, got) >= 0.9999
