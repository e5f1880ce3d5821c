"""MTP drafting over a reduced vocabulary: a small draft lm_head whose rows are a list of token ids.

prepare/build_draft_vocab.py stores the head as ``mtp.draft_lm_head.*`` (the lm_head's own format)
and names it in config.json: ``"draft_vocab": {"size": K, "ids_file": "draft_vocab_ids.json",
"head": "mtp.draft_lm_head"}``, the ids file holding ``{"ids": [sorted ids], ...}``. vLLM's MTP
drafter then computes K logits per draft instead of the full vocabulary and maps draft index ``i``
back to token ``ids[i]``: probabilistic drafts are drawn over the K rows themselves (``DraftVocab.sample``,
kernels/draft_sample.py, a seeded request's noise from its own generator: the draft probabilities land in a zeroed
full-vocabulary row for the rejection sampler, in propose's draft loop row i of one [rows, k, vocab] buffer a step,
``StepDraftProbs``), other callers of compute_logits see -inf outside the list, and greedy (local-argmax) drafts
take the argmax over the K rows. A token outside the list is never proposed.

The head lives on the inner MTP predictor (``Qwen3_5MultiTokenPredictor.draft_lm_head``), not on
``Qwen3_5MTP.lm_head``, which the V1 proposer replaces with the target's full head.
``VLLM_MTP_DRAFT_VOCAB=0`` drafts over the full head even when the checkpoint carries a draft head.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from .kernels.draft_sample import candidates, sample_draft
from .mtp_seeded_drafts import exponential_

ENV = "VLLM_MTP_DRAFT_VOCAB"
HEAD_NAME = "draft_lm_head"  # under the MTP module: checkpoint tensors mtp.draft_lm_head.*


def draft_vocab_entry(hf_config: object) -> dict | None:
    """The checkpoint's ``draft_vocab`` config entry (top level, or in the text config), or None."""
    for config in (hf_config, getattr(hf_config, "text_config", None)):
        entry = getattr(config, "draft_vocab", None) if config is not None else None
        if entry:
            return dict(entry)
    return None


def read_draft_ids(model_dir: str | Path, entry: dict, vocab_size: int) -> list[int]:
    """The draft id list named by ``entry``, checked against the vocabulary and the head's size."""
    path = Path(model_dir) / entry.get("ids_file", "draft_vocab_ids.json")
    if not path.is_file():
        raise FileNotFoundError(
            f"the checkpoint has a draft head but no id list at {path}; rebuild it with "
            f"prepare/build_draft_vocab.py, or set {ENV}=0 to draft over the full lm_head"
        )
    data = json.loads(path.read_text())
    ids = data["ids"] if isinstance(data, dict) else data
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids):
        raise ValueError(f"{path}: expected a non-empty list of token ids")
    if ids != sorted(set(ids)):
        raise ValueError(f"{path}: token ids must be sorted and unique (the head's rows follow that order)")
    if ids[0] < 0 or ids[-1] >= vocab_size:
        raise ValueError(f"{path}: token ids must lie in [0, {vocab_size})")
    if "size" in entry and int(entry["size"]) != len(ids):
        raise ValueError(f"{path}: {len(ids)} ids, but the config's draft head has {entry['size']} rows")
    return ids


class DraftVocab(nn.Module):
    """Maps a draft head's K outputs to the full vocabulary (no weights: the ids are a buffer)."""

    def __init__(self, ids: Sequence[int], vocab_size: int):
        super().__init__()
        from vllm.model_executor.layers.logits_processor import LogitsProcessor

        self.vocab_size = vocab_size
        self.logits_processor = LogitsProcessor(len(ids))
        self.register_buffer("target_ids", torch.tensor(list(ids), dtype=torch.long), persistent=False)

    def scatter(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """[..., K] draft logits -> [..., vocab] with -inf outside the draft vocabulary."""
        full = draft_logits.new_full((*draft_logits.shape[:-1], self.vocab_size), float("-inf"))
        return full.index_copy_(-1, self.target_ids, draft_logits)

    def full_logits(self, head: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor | None:
        logits = self.logits_processor(head, hidden_states)
        return None if logits is None else self.scatter(logits)

    def sample(self, head: nn.Module, hidden_states: torch.Tensor, sampling_metadata,
               step_probs: StepDraftProbs | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Probabilistic drafts drawn over the K draft rows (kernels/draft_sample.py): (token ids, q over the full
        vocabulary for the rejection sampler, the step's next row of ``step_probs`` when given); None, for vLLM's
        full-vocabulary path, where the batch's sampling parameters are not one per draft row."""
        temperature, top_k, top_p = sampling_metadata.temperature, sampling_metadata.top_k, sampling_metadata.top_p
        rows = hidden_states.shape[0]
        if temperature is None or any(x is not None and tuple(x.shape) != (rows,) for x in (temperature, top_k, top_p)):
            return None
        logits = self.logits_processor(head, hidden_states)
        if logits is None:
            return None
        # a seeded request's noise from its own generator: its drafts are the same every run
        noise = exponential_(logits.new_empty(rows, candidates(logits.shape[1]), dtype=torch.float32),
                             sampling_metadata.generators)
        out = None if step_probs is None else step_probs.next_row(rows, self.vocab_size, logits.device)
        return sample_draft(logits, self.target_ids, self.vocab_size, temperature, top_k, top_p, noise, out=out)

    def top_tokens(self, head: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
        """Greedy drafts through the vocab-parallel local argmax, as token ids of the full vocabulary."""
        return self.target_ids[self.logits_processor.get_top_tokens(head, hidden_states)]


class StepDraftProbs:
    """One ``propose`` step's draft probabilities: a zeroed [rows, k, vocab] float32 buffer that the first draft
    sampled by the draft head allocates, draft i writing its q into row i in place. vLLM's loop zeroes one
    [rows, vocab] row a draft and stacks the k rows after the loop: k memsets and a copy of the whole buffer
    (4 MB at k=4, batch 1) where one memset does."""

    def __init__(self, num_drafts: int):
        self.num_drafts = num_drafts
        self.buffer: torch.Tensor | None = None
        self.written = 0  # drafts whose q is in the buffer

    def next_row(self, rows: int, vocab_size: int, device: torch.device) -> torch.Tensor:
        if self.buffer is None:
            self.buffer = torch.zeros(rows, self.num_drafts, vocab_size, dtype=torch.float32, device=device)
        row = self.buffer[:, self.written]
        self.written += 1
        return row

    def stacked(self, draft_probs: list[torch.Tensor]) -> torch.Tensor:
        """What vLLM's ``torch.stack(draft_probs, dim=1).contiguous()`` returns: the buffer itself when every draft
        of the step wrote its row there (each entry is then that row), else vLLM's stack."""
        if self.written == len(draft_probs) == self.num_drafts:
            return self.buffer
        return torch.stack(draft_probs, dim=1).contiguous()


def attach_draft_head(predictor: nn.Module, vllm_config, prefix: str) -> None:
    """vLLM hook (end of ``Qwen3_5MultiTokenPredictor.__init__``): add ``draft_lm_head`` and
    ``draft_vocab`` when the checkpoint has a draft head and ``VLLM_MTP_DRAFT_VOCAB`` is on."""
    import vllm.envs as envs

    model_config = vllm_config.model_config
    entry = draft_vocab_entry(model_config.hf_config)
    if entry is None or envs.VLLM_MTP_DRAFT_VOCAB == "0":
        return
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    vocab_size = predictor.config.vocab_size
    ids = read_draft_ids(model_config.model, entry, vocab_size)
    predictor.draft_lm_head = ParallelLMHead(
        len(ids), predictor.config.hidden_size, quant_config=vllm_config.quant_config, prefix=f"{prefix}.{HEAD_NAME}"
    )
    predictor.draft_vocab = DraftVocab(ids, vocab_size)


def skip_weight(predictor: nn.Module, checkpoint_name: str) -> bool:
    """vLLM hook (``Qwen3_5MTP.load_weights``): draft-head tensors with no head to load them into."""
    return checkpoint_name.startswith(f"mtp.{HEAD_NAME}.") and not hasattr(predictor, HEAD_NAME)
