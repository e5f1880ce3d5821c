"""The small-k sampler against stock vLLM 0.28.0's own top-k/top-p dispatcher, ties and exact top-p cuts included.

Stock's ``apply_top_k_top_p`` picks its path by platform and rows: on CUDA its sort (every token tied at the
k-th value kept; a stable radix sort at the real vocabulary, so a top-p cut inside a tie masks the lower index
first) below 8 rows, and its Triton "Qrita" kernel (exactly k kept, the lower index first, also at the top-p
cut) from 8 rows up. Both sides run here as on CUDA: the pristine and the patched dispatcher see a CUDA-like
platform, the sort is made stable, and Qrita runs in the Triton interpreter from the pristine file with one
expression rewritten (``row_id.to(tl.int64)``: the interpreter's loop counter is a Python int), nothing else.

What is compared: the masked logits, exactly, at 1, 4, 8, 16 and 64 rows, on designed rows whose ties and
top-p boundaries are exact in fp32 (tokens tied at the top have probability 1/n exactly, so 1 - p is hit
exactly) plus random rows. Qrita's arithmetic is not exact everywhere: it finds a tie at the top-p cut by
rebuilding the logit as log(prob * sum) + max within 1e-9, which can miss a tie below the row's maximum (then
it keeps the whole tied group); the designed top-p ties therefore sit at the maximum, where that is exact.
"""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import pytest
import torch

from qwen_serving.engine.kernels.topk_topp import top_k_top_p_probs, top_k_top_p_reference
from tests.helpers.engine_trees import load, tree

VOCAB = 256
ROW_COUNTS = [1, 4, 8, 16, 64]
CUDA_LIKE = SimpleNamespace(is_cpu=lambda: False)


@pytest.fixture(scope="module")
def qrita(tmp_path_factory):
    """Stock's apply_top_k_top_p_triton, runnable by the interpreter."""
    source = (tree("pristine") / "v1/sample/ops/topk_topp_triton.py").read_text()
    assert source.count("row_id.to(tl.int64)") == 1, "vLLM's Triton top-k/top-p changed: revisit the shim"
    path = tmp_path_factory.mktemp("qrita") / "topk_topp_triton_interpretable.py"
    path.write_text(source.replace("row_id.to(tl.int64)", "(row_id + tl.zeros((), dtype=tl.int64))"))
    module = types.ModuleType("vllm.v1.sample.ops.qs_qrita_interpretable")
    module.__file__ = str(path)  # Triton reads the kernel's source from here
    sys.modules[module.__name__] = module
    exec(compile(path.read_text(), str(path), "exec"), module.__dict__)
    yield module.apply_top_k_top_p_triton
    del sys.modules[module.__name__]


@pytest.fixture
def dispatchers(monkeypatch, qrita):
    """(stock, ours): vLLM's dispatcher from the pristine and the patched tree, both on CUDA's paths."""
    from vllm.v1.sample.ops import topk_topp_sampler as patched

    pristine = load("pristine", "v1/sample/ops/topk_topp_sampler.py")
    for module in (pristine, patched):
        monkeypatch.setattr(module, "current_platform", CUDA_LIKE)
        monkeypatch.setattr(module, "HAS_TRITON", True)
    monkeypatch.setattr(pristine, "apply_top_k_top_p_triton", qrita)
    unstable = torch.Tensor.sort
    monkeypatch.setattr(torch.Tensor, "sort", lambda self, *a, **kw: unstable(self, *a, **{**kw, "stable": True}))

    def stock(logits, k, p):
        return pristine.apply_top_k_top_p(logits.clone(), k, p)

    def ours(logits, k, p):
        return patched.apply_top_k_top_p(logits.clone(), k, p, int(k.max()))

    return stock, ours


def _row(gen, **values):
    row = torch.randn(VOCAB, generator=gen) * 0.5 - 8.0  # far below the designed tokens
    for value, where in values.values():
        row[where] = value
    return row


def designed_cases(gen):
    """(name, row, k, p, tokens kept by the sort rule, by the exact-k rule); None: not designed to a count."""
    spread8 = torch.arange(3, VOCAB, 30)[:8]
    return [
        # a tie at the k-th value: the sort keeps all 6 tied tokens, Triton the 2 of lowest index
        ("tie at k", _row(gen, top=(5.0, [200, 201]), tie=(3.0, spread8[:6])), 4, 1.0, 8, 4),
        ("tie at k, p", _row(gen, top=(5.0, [200, 201]), tie=(3.0, spread8[:6])), 4, 0.999, 8, 4),
        # 8 tokens tied at the top, probability 1/8 each: 1 - p = 3/8 masks exactly 3
        ("exact 1-p", _row(gen, tie=(4.0, spread8)), 8, 0.625, 5, 5),
        # k cuts the tie (exact-k: 4 x 1/4, 1 - p = 1/4 masks 1; sort: 8 x 1/8 masks 2)
        ("k then exact 1-p", _row(gen, tie=(4.0, spread8)), 4, 0.75, 6, 3),
        ("exact 1-p = 1/2", _row(gen, tie=(2.0, spread8[:4])), 4, 0.5, 2, 2),
        # more tokens tied at the k-th value than the kernel's k_max + 1 candidates: ranked across the row
        ("ties past the candidates", _row(gen, top=(3.0, [78]), tie=(1.0, torch.arange(5, VOCAB, 12))), 3, 1.0,
         1 + 21, 3),
        ("k = 1", _row(gen, tie=(2.0, spread8[:3])), 1, 1.0, 3, 1),
        ("random", torch.randn(VOCAB, generator=gen) * 3, 8, 0.7, None, None),
        ("random, small p", torch.randn(VOCAB, generator=gen) * 3, 6, 0.2, None, None),
    ]


def batch(rows: int, with_p: bool):
    gen = torch.Generator().manual_seed(rows)
    cases = designed_cases(gen)
    picked = [cases[i % len(cases)] for i in range(rows)]
    logits = torch.stack([c[1] for c in picked])
    k = torch.tensor([c[2] for c in picked])
    p = torch.tensor([c[3] for c in picked]) if with_p else None
    return picked, logits, k, p


@pytest.mark.parametrize(("rows", "with_p"), [(r, True) for r in ROW_COUNTS] + [(r, False) for r in ROW_COUNTS[:-1]])
def test_masks_equal_stock_dispatcher(dispatchers, rows, with_p):
    stock, ours = dispatchers
    picked, logits, k, p = batch(rows, with_p)
    want, got = stock(logits, k, p), ours(logits, k, p)
    bad = [picked[r][0] for r in (want.isinf() != got.isinf()).any(dim=1).nonzero().flatten().tolist()]
    assert not bad, f"masks differ on {bad}"
    assert torch.equal(got, want)
    exact_k = rows >= 8
    kept = (~got.isinf()).sum(dim=1).tolist()
    for r, (name, _, kk, _, sort_count, exact_count) in enumerate(picked):  # the cases test what they say
        if with_p and sort_count is not None:
            assert kept[r] == (exact_count if exact_k else sort_count), name
        if exact_k and not with_p:
            assert kept[r] == kk, name
    if rows == ROW_COUNTS[-1]:
        return  # (interpreted kernels are slow; the rule is the same at every row count)
    # the probabilities of the truncated distribution (drafts, rejection sampling) follow the same rule
    probs = top_k_top_p_probs(logits, k, p, int(k.max()), exact_k=exact_k)
    torch.testing.assert_close(probs, want.softmax(dim=-1), atol=1e-6, rtol=1e-5)
    assert torch.equal(top_k_top_p_reference(logits, k, p, exact_k=exact_k), want)


def test_tied_top_p_cut_keeps_the_lower_index_on_the_triton_path(dispatchers):
    # the same tie, 8 and 7 rows: the two stock paths disagree about which tied tokens stay, and so do we
    stock, ours = dispatchers
    gen = torch.Generator().manual_seed(0)
    row = _row(gen, tie=(4.0, torch.arange(3, VOCAB, 30)[:8]))
    kept = {}
    for rows in (7, 8):
        logits, k, p = row.expand(rows, -1).contiguous(), torch.full((rows,), 8), torch.full((rows,), 0.625)
        got = ours(logits, k, p)
        assert torch.equal(got, stock(logits, k, p))
        kept[rows] = (~got[0].isinf()).nonzero().flatten().tolist()
    assert kept[8] == [3, 33, 63, 93, 123]  # Triton: the five lowest indices
    assert kept[7] == [93, 123, 153, 183, 213]  # sort: the three lowest masked
