"""The DFlash2 lookup hook (qwen_serving/engine/spec_dflash2_lookup.py) on a CUDA GPU, reading the history the way the
V2 runner keeps it: pinned host memory seen through vLLM's UVA view (RequestState.all_token_ids is one).

    pytest -m gpu tests/gpu/test_lookup_hook_gpu.py        # seconds; needs vLLM 0.28.0 importable (UvaBuffer)

8 requests x 64k-token histories, the lookup kernel compiled: the fused drafts and the point-mass proposals equal
the merge rule applied to the plain-torch lookup on the CPU (the kernel in Triton's interpreter would take minutes
at this size). The cases: a long quote (strong match), a short match the drafter agrees with and one it does not,
a periodic tail, no match, and a request still prefilling.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from qwen_serving import model
from qwen_serving.engine import spec_dflash2_lookup as sdl
from qwen_serving.engine.kernels.lookup import lookup_draft_reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

K, REQS, WIDTH, TOP_K = 7, 8, 65_536, 16
PARAMS = sdl.LookupParams(nmin=6, nmax=12, nstrong=8, agree=2)


def _histories(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    history = torch.randint(0, model.VOCAB, (REQS, WIDTH), generator=gen, dtype=torch.int32)
    lengths = torch.tensor([WIDTH * n // 16 for n in (16, 15, 12, 10, 8, 5, 3, 1)], dtype=torch.int32)
    for b in (0, 5, 7):  # a verbatim quote of an early span: a 12-token match
        end = int(lengths[b])
        history[b, end - 40: end] = history[b, end // 4: end // 4 + 40]
    for b in (1, 2):  # a 7-token match only: weak (below NSTRONG 8)
        end = int(lengths[b])
        history[b, end - 7: end] = history[b, end // 2: end // 2 + 7]
    end = int(lengths[3])  # periodic tail: the match overlaps the suffix
    history[3, end - 30: end] = torch.tensor([5, 6, 7], dtype=torch.int32).repeat(10)
    return history, lengths


def test_the_hook_on_a_uva_history_equals_the_rule_on_the_cpu():
    from vllm.v1.worker.gpu.buffer_utils import UvaBuffer

    gen = torch.Generator().manual_seed(0)
    history, lengths = _histories(gen)
    uva = UvaBuffer((REQS, WIDTH), torch.int32)
    uva.cpu.copy_(history)
    slots = torch.randperm(REQS, generator=gen).to(torch.int32)  # batch entry -> request state
    by_state = {int(s): i for i, s in enumerate(slots)}
    num_sampled = torch.tensor([1, 3, 1, 2, 1, 1, 2, 4])
    num_sampled[by_state[5]] = 0  # a quote, but the request is still prefilling
    ref = lookup_draft_reference(history, lengths, K, PARAMS.nmin, PARAMS.nmax, slots=slots)
    drafted = torch.randint(0, model.VOCAB, (REQS, K), generator=gen)
    weak = [i for i in range(REQS) if int(slots[i]) == 1]  # the drafter agrees with request state 1's weak match
    drafted[weak, :2] = ref.tokens[weak, :2]

    draft_logits = torch.full((REQS, K, model.VOCAB), float("-inf"))
    cached = torch.stack([torch.randperm(model.VOCAB, generator=gen)[:TOP_K] for _ in range(REQS * K)]).view(
        REQS, K, TOP_K)
    draft_logits.scatter_(-1, cached, torch.randn(REQS, K, TOP_K, generator=gen))
    speculator = SimpleNamespace(num_speculative_steps=K, max_num_reqs=REQS, draft_logits=draft_logits.cuda(),
                                 _cached_candidate_ids=cached.cuda())
    hook = sdl.ContextLookup(speculator, uva.uva, lengths.cuda(), PARAMS)
    got = hook.fuse(drafted.cuda(), slots.cuda(), num_sampled.cuda()).cpu()

    filled = sdl.lookup_positions(drafted, ref, PARAMS, num_sampled > 0)
    assert torch.equal(got, torch.where(filled, ref.tokens, drafted))
    assert filled[by_state[0]].all() and filled[by_state[3]].any()  # the strong quote, the periodic tail
    assert filled[by_state[1]].tolist() == [False, False] + [True] * (K - 2)  # weak, agreed: after the two
    assert not filled[by_state[2]].any() and not filled[by_state[4]].any()  # weak unagreed; no match
    assert not filled[by_state[5]].any() and filled[by_state[7]].all()  # prefilling; a quote
    logits = speculator.draft_logits.cpu()
    for i, state in enumerate(slots.tolist()):
        for j in range(K):
            if filled[i, j]:
                assert torch.isfinite(logits[state, j]).sum() == 1 and logits[state, j, got[i, j]] == 0
                assert (speculator._cached_candidate_ids[state, j].cpu() == got[i, j]).all()
            else:
                assert torch.equal(logits[state, j], draft_logits[state, j])
