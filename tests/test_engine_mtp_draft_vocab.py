"""patches/qwen3_5-mtp-draft-vocab.patch: MTP drafts over a reduced draft head mapped back to the vocabulary.

A tiny Qwen3.5 target and its MTP drafter are built through vLLM's own initialize_model (as in
tests/test_embed_quant.py, in conftest's vllm_world), with a draft head over 100 of the 1000 token ids.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from qwen_serving.engine.mtp_draft_vocab import DraftVocab, StepDraftProbs, read_draft_ids

HIDDEN, VOCAB, K = 256, 1000, 100
IDS = sorted(torch.randperm(VOCAB, generator=torch.Generator().manual_seed(0))[:K].tolist())


def build(tmp_path: Path, with_draft_vocab: bool = True):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.transformers_utils.configs.qwen3_5 import Qwen3_5Config
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    cfg = Qwen3_5Config(
        text_config=dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], hidden_size=HIDDEN,
                         intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                         linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
                         linear_value_head_dim=64, vocab_size=VOCAB, tie_word_embeddings=False,
                         mtp_num_hidden_layers=1, max_position_embeddings=1024),
        vision_config=dict(depth=1, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=HIDDEN),
    )
    cfg.architectures = ["Qwen3_5ForConditionalGeneration"]
    if with_draft_vocab:  # what prepare/build_draft_vocab.py writes
        cfg.draft_vocab = {"size": K, "ids_file": "draft_vocab_ids.json", "head": "mtp.draft_lm_head"}
        (tmp_path / "draft_vocab_ids.json").write_text(json.dumps({"k": K, "ids": IDS}))
    cfg.save_pretrained(tmp_path)
    vllm_config = EngineArgs(model=str(tmp_path), skip_tokenizer_init=True, dtype="float32", max_model_len=1024,
                             max_num_seqs=2, language_model_only=True, enforce_eager=True,
                             speculative_config={"method": "mtp", "num_speculative_tokens": 1}).create_engine_config()
    target = initialize_model(vllm_config=vllm_config)
    spec = vllm_config.speculative_config
    draft_config = SpecDecodeBaseProposer._create_draft_vllm_config(
        SimpleNamespace(speculative_config=spec, vllm_config=vllm_config))
    drafter = initialize_model(vllm_config=draft_config, model_config=spec.draft_model_config)
    return vllm_config, target, drafter


def checkpoint(weight: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    return [("lm_head.weight", weight), ("mtp.draft_lm_head.weight", weight[IDS].clone())]


def load(model, vllm_config, weights) -> set[str]:
    """load_weights, then the per-layer post-processing the model loader runs (CPU linears need it)."""
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    loaded = model.load_weights(weights)
    process_weights_after_loading(model, vllm_config.model_config, torch.device("cpu"))
    return loaded


def share_lm_head(vllm_config, target, drafter) -> None:
    """What the V1 proposer does once the drafter is loaded (llm_base_proposer._maybe_share_lm_head)."""
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    proposer = SimpleNamespace(model=drafter, vllm_config=vllm_config, use_local_argmax_reduction=True)
    SpecDecodeBaseProposer._maybe_share_lm_head(proposer, target.get_language_model())


def test_drafts_over_the_draft_vocabulary(vllm_world, tmp_path):
    vllm_config, target, drafter = build(tmp_path)
    weight = torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(1))
    loaded = load(drafter, vllm_config, checkpoint(weight))
    assert "model.draft_lm_head.weight" in loaded
    load(target, vllm_config, [("lm_head.weight", weight)])
    share_lm_head(vllm_config, target, drafter)
    assert drafter.lm_head is target.get_language_model().lm_head  # the full head went to lm_head ...
    assert drafter.model.draft_lm_head.weight.shape[0] >= K  # ... and the draft head stayed

    hidden = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(2))
    logits = drafter.compute_logits(hidden)
    draft = hidden @ weight[IDS].t()
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[IDS] = False
    assert logits.shape == (5, VOCAB)
    assert bool(torch.isneginf(logits[:, outside]).all())
    torch.testing.assert_close(logits[:, IDS], draft)
    expected = torch.tensor(IDS)[draft.argmax(-1)]
    assert torch.equal(logits.argmax(-1), expected)  # greedy through compute_logits
    assert torch.equal(drafter.get_top_tokens(hidden), expected)  # greedy through the local argmax
    assert torch.softmax(logits, -1)[:, outside].sum() == 0  # sampled drafts never leave the list


def test_sampled_drafts_are_drawn_over_the_draft_rows(vllm_world, tmp_path):
    """The proposer's _sample_draft_tokens with probabilistic drafts takes the drafter's sample_draft: q over the
    draft ids only, the request's top-k and top-p applied, the draft a token q gives mass to."""
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    vllm_config, target, drafter = build(tmp_path)
    weight = torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(1))
    load(drafter, vllm_config, checkpoint(weight))
    load(target, vllm_config, [("lm_head.weight", weight)])
    share_lm_head(vllm_config, target, drafter)
    hidden = torch.randn(4, HIDDEN, generator=torch.Generator().manual_seed(3)) * 0.05
    metadata = SimpleNamespace(all_greedy=False, generators={}, temperature=torch.tensor([0.6, 1.0, 0.0, 0.8]),
                               top_k=torch.tensor([20, 5, 20, 1000]), top_p=torch.tensor([0.95, 1.0, 0.95, 0.5]))
    proposer = SimpleNamespace(model=drafter, _enable_probabilistic_draft_probs=True)
    tokens, q = SpecDecodeBaseProposer._sample_draft_tokens(proposer, hidden, metadata)
    draft = hidden @ weight[IDS].t()
    assert q.shape == (4, VOCAB) and q.dtype == torch.float32
    torch.testing.assert_close(q.sum(-1), torch.ones(4), rtol=0, atol=1e-5)
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[IDS] = False
    assert q[:, outside].sum() == 0 and bool((q[torch.arange(4), tokens] > 0).all())
    assert (q > 0).sum(-1)[1] == 5  # top-k 5, top-p 1
    assert (q > 0).sum(-1)[0] <= 20
    assert tokens[2] == torch.tensor(IDS)[draft[2].argmax()]  # a greedy row takes the largest draft logit
    kept = q[1] > 0  # q is the tempered softmax over the kept draft rows
    torch.testing.assert_close(q[1, kept], torch.softmax(draft[1][torch.isin(torch.tensor(IDS), kept.nonzero().flatten())], 0),
                               rtol=1e-4, atol=1e-6)

    # propose()'s step buffer: the drafter writes the same q into the draft's row of it (the same noise)
    step_probs = StepDraftProbs(3)
    for _ in range(2):
        step_probs.next_row(4, VOCAB, hidden.device)
    torch.manual_seed(0)
    tokens, q = SpecDecodeBaseProposer._sample_draft_tokens(proposer, hidden, metadata)
    torch.manual_seed(0)
    step_tokens, row = SpecDecodeBaseProposer._sample_draft_tokens(proposer, hidden, metadata, step_probs)
    assert step_probs.written == 3 and row.data_ptr() == step_probs.buffer[:, 2].data_ptr()
    assert torch.equal(step_tokens, tokens) and torch.equal(step_probs.buffer[:, 2], q)


def test_switched_off(vllm_world, tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_MTP_DRAFT_VOCAB", "0")
    vllm_config, target, drafter = build(tmp_path)
    assert not hasattr(drafter.model, "draft_lm_head")
    weight = torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(1))
    assert not any("draft_lm_head" in name for name in load(drafter, vllm_config, checkpoint(weight)))
    hidden = torch.randn(3, HIDDEN)
    torch.testing.assert_close(drafter.compute_logits(hidden), hidden @ weight.t())


def test_no_draft_head_in_checkpoint(vllm_world, tmp_path):
    _, _, drafter = build(tmp_path, with_draft_vocab=False)
    assert not hasattr(drafter.model, "draft_lm_head")


def test_scatter():
    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig()):  # LogitsProcessor is a CustomOp
        vocab = DraftVocab([1, 4, 6], 8)
    out = vocab.scatter(torch.tensor([[0.5, -1.0, 2.0]]))
    assert out.tolist() == [[float("-inf"), 0.5, float("-inf"), float("-inf"), -1.0, float("-inf"), 2.0,
                             float("-inf")]]


@pytest.mark.parametrize(("ids", "entry", "error"), [
    ([3, 1], {}, "sorted and unique"),
    ([1, 1], {}, "sorted and unique"),
    ([1, VOCAB], {}, "must lie in"),
    ([], {}, "non-empty"),
    ([1, 2], {"size": 3}, "has 3 rows"),
])
def test_read_draft_ids_rejects(tmp_path, ids, entry, error):
    (tmp_path / "draft_vocab_ids.json").write_text(json.dumps({"ids": ids}))
    with pytest.raises(ValueError, match=error):
        read_draft_ids(tmp_path, entry, VOCAB)


def test_read_draft_ids_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="VLLM_MTP_DRAFT_VOCAB=0"):
        read_draft_ids(tmp_path, {"ids_file": "draft_vocab_ids.json"}, VOCAB)
