"""Drafting from the context on DFlash2 (`LOOKUP=1`): the lookup's continuation fused with the drafter's block.

patches/dflash2-lookup.patch builds a `ContextLookup` beside the V2 model runner's request states when the
speculator is DFlash2's and VLLM_DFLASH2_LOOKUP=1, and calls `fuse` right after each `propose`, before the drafts
are stored for the next verify step. `fuse` runs kernels/lookup over every request's own token history (the
runner's RequestState.all_token_ids, `total_len` tokens long: the step's accepted tokens and bonus included),
in chunks of candidates across the GPU, and merges what it found with the drafter's block:
- a match of at least `nstrong` tokens is taken alone: its continuation replaces the drafter's tokens;
- a shorter one only where the drafter proposed the same first `agree` tokens: those stay the drafter's (the same
  tokens, with the drafter's own proposal), the lookup fills the positions after them;
- positions past the continuation's end, requests with no match and requests still prefilling (nothing sampled
  this step) keep the drafter's tokens and proposals untouched.

The verify stays exact. Every position the lookup filled carries a point-mass proposal (draft logits 0 on the token,
-inf elsewhere), which vLLM's rejection rule accepts with probability p(x) and whose residual is p without x
(tests/test_spec_rejection_lookup.py). Whether position j is filled depends only on the history and the drafts
before j, never on the token drafted at j or later: that is why the agreed positions keep the drafter's proposal
(a point mass reported for a token that was sampled from q would make the proposal depend on its own sample).
With greedy draft sampling the speculator keeps no draft logits and the rejection rule already treats every draft
as a point mass; only the tokens change then.

The long verify block (`DFLASH_TOKENS` above the drafter's 7; patches/dflash2-verify-block.patch, the schedule and
what vLLM does with the length in engine/spec_verify_block.py): the runner verifies up to `verify_tokens` drafts,
the drafter still proposes its 7. `fuse` then returns `verify_tokens` drafts per request: the merged block, then
the lookup's continuation on every position past it (token 0 past the continuation's end), each a point mass in
the positions the hook adds to the draft-logits cache. That tail depends only on the history and the merged
block, so any tail keeps the verify exact; the schedule decides how much of it the next step verifies
(`next_block`), from the flags the step before last left: a fillable tail (a match taken whose continuation fills
every verify position) and the tokens each request emitted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from qwen_serving.engine import spec_verify_block as svb
from qwen_serving.engine.kernels.lookup import MAX_NMAX, LookupDraft, lookup_draft, lookup_scratch

ENABLE_ENV = "VLLM_DFLASH2_LOOKUP"
PARAM_ENVS = {"nmin": "VLLM_DFLASH2_LOOKUP_NMIN", "nmax": "VLLM_DFLASH2_LOOKUP_NMAX",
              "nstrong": "VLLM_DFLASH2_LOOKUP_NSTRONG", "agree": "VLLM_DFLASH2_LOOKUP_AGREE"}
SPECULATOR = "DFlash2Speculator"  # the V2 runner's DFlash2 speculator class (its draft-logits cache is handled here)


@dataclass(frozen=True)
class LookupParams:
    nmin: int  # shortest suffix that may match
    nmax: int  # longest suffix tried
    nstrong: int  # a match this long is taken alone
    agree: int  # a shorter match needs the drafter's first `agree` tokens to equal its own

    def check(self, num_draft: int) -> None:
        if not 1 <= self.nmin <= self.nmax <= MAX_NMAX:
            raise ValueError(f"{PARAM_ENVS['nmin']}={self.nmin} and {PARAM_ENVS['nmax']}={self.nmax}: need "
                             f"1 <= NMIN <= NMAX <= {MAX_NMAX}")
        if self.nstrong < 1:
            raise ValueError(f"{PARAM_ENVS['nstrong']}={self.nstrong}: need >= 1")
        if not 1 <= self.agree <= num_draft:
            raise ValueError(f"{PARAM_ENVS['agree']}={self.agree}: need 1..{num_draft} (the drafts per step)")

    @classmethod
    def from_env(cls) -> LookupParams:
        import vllm.envs as envs

        return cls(nmin=envs.VLLM_DFLASH2_LOOKUP_NMIN, nmax=envs.VLLM_DFLASH2_LOOKUP_NMAX,
                   nstrong=envs.VLLM_DFLASH2_LOOKUP_NSTRONG, agree=envs.VLLM_DFLASH2_LOOKUP_AGREE)


def taken_matches(drafted: torch.Tensor, found: LookupDraft, params: LookupParams,
                  decoding: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """([batch] bool: the match is taken, [batch]: the first position it fills) by the merge rule.

    drafted: [batch, num_draft] the drafter's tokens; found: the lookup over the same batch (at least num_draft
    tokens wide); decoding: [batch] bool, False for a request still prefilling."""
    agree = min(params.agree, drafted.shape[1])
    matched = found.match_len > 0
    strong = found.match_len >= params.nstrong
    agreed = (found.num_valid >= agree) & (drafted[:, :agree] == found.tokens[:, :agree]).all(dim=1)
    first = torch.where(strong, 0, agree)  # a weak match leaves the agreed positions to the drafter
    return matched & (strong | agreed) & decoding, first


def lookup_positions(drafted: torch.Tensor, found: LookupDraft, params: LookupParams,
                     decoding: torch.Tensor) -> torch.Tensor:
    """[batch, num_draft] bool: the drafter positions the lookup fills (the merge rule in the module docstring)."""
    return _filled(*taken_matches(drafted, found, params, decoding), found.num_valid, drafted.shape[1])


def _filled(taken: torch.Tensor, first: torch.Tensor, num_valid: torch.Tensor, num_draft: int) -> torch.Tensor:
    positions = torch.arange(num_draft, device=taken.device)
    return taken[:, None] & (positions >= first[:, None]) & (positions < num_valid[:, None])


def write_point_masses(draft_logits: torch.Tensor, cached_ids: torch.Tensor, slots: torch.Tensor,
                       filled: torch.Tensor, tokens: torch.Tensor) -> None:
    """Turn the cached proposal rows of the filled positions into point masses on the lookup's tokens.

    DFlash2 caches its proposal per (request state, step) as draft_logits [max_reqs, num_draft, vocab], finite only
    at the K candidate ids it records in cached_ids [max_reqs, num_draft, K] (its cache kernel resets exactly those
    to -inf next step). A filled row becomes -inf at its candidates and 0 at the token, and records the token K
    times, so the next step's reset clears it as well. No host synchronisation: every row is written, unfilled
    rows with their own values."""
    num_draft = filled.shape[1]
    rows = slots.long()[:, None].expand(-1, num_draft)
    steps = torch.arange(num_draft, device=slots.device)[None, :].expand_as(rows)
    old_ids = cached_ids[rows, steps]  # [batch, num_draft, K]
    mask = filled[..., None].expand_as(old_ids)
    draft_logits[rows[..., None], steps[..., None], old_ids] = torch.where(
        mask, float("-inf"), draft_logits[rows[..., None], steps[..., None], old_ids])
    draft_logits[rows, steps, tokens] = torch.where(filled, 0.0, draft_logits[rows, steps, tokens])
    cached_ids[rows, steps] = torch.where(mask, tokens[..., None], old_ids)


def write_tail_point_masses(draft_logits: torch.Tensor, tail_ids: torch.Tensor, slots: torch.Tensor,
                            tokens: torch.Tensor) -> None:
    """The long block's tail proposals: draft_logits [max_reqs, verify, vocab] columns verify - T .. verify - 1
    become point masses on tokens [batch, T]; tail_ids [max_reqs, T] records each column's token so the next
    write clears it (nothing else writes these columns). No host synchronisation."""
    tail = tokens.shape[1]
    first = draft_logits.shape[1] - tail
    rows = slots.long()[:, None].expand(-1, tail)
    cols = torch.arange(tail, device=slots.device)[None, :].expand_as(rows)
    draft_logits[rows, cols + first, tail_ids[rows, cols]] = float("-inf")
    draft_logits[rows, cols + first, tokens] = 0.0
    tail_ids[rows, cols] = tokens


class ContextLookup:
    """The hook: built once beside the runner's request states, `fuse` called once per drafting step."""

    def __init__(self, speculator, history: torch.Tensor, lengths: torch.Tensor, params: LookupParams,
                 verify_tokens: int | None = None, sticky: int = svb.STICKY):
        self.num_draft = speculator.num_speculative_steps  # the drafter's block
        self.verify_tokens = verify_tokens or self.num_draft  # the runner's: the long block's length
        params.check(self.num_draft)
        self.speculator = speculator
        self.history = history  # [max_num_reqs, max_model_len] int32, rows by request state
        self.lengths = lengths  # [max_num_reqs] tokens held per row
        self.params = params
        max_reqs, device = speculator.max_num_reqs, history.device
        self.found = LookupDraft(torch.zeros(max_reqs, self.verify_tokens, dtype=torch.int64, device=device),
                                 torch.zeros(max_reqs, dtype=torch.int32, device=device),
                                 torch.zeros(max_reqs, dtype=torch.int32, device=device))
        self.scratch = lookup_scratch(max_reqs, history.shape[1], device=device)  # the kernel's per-chunk bests
        self.next_block = self.num_draft  # the drafts the next step verifies
        self.schedule: svb.VerifyBlockSchedule | None = None
        if self.verify_tokens > self.num_draft:
            self.schedule = svb.VerifyBlockSchedule(self.verify_tokens, self.num_draft, sticky)
            self.flags = svb.StaleFlags(max_reqs, device)
            self.tail_ids = torch.zeros(max_reqs, self.verify_tokens - self.num_draft, dtype=torch.int64,
                                        device=device)
            if speculator.draft_logits is not None:
                # the rejection sampler reads the speculator's cache for every verify position: widen it (before
                # any step); DFlash2's cache kernel writes its own columns by stride, the hook the tail's. Costs
                # verify - drafter more fp32 vocabulary rows per seat (~7.9 MB at 8 x 248,320), not in memory.py
                wide = speculator.draft_logits.new_full((max_reqs, self.verify_tokens, speculator.vocab_size),
                                                        float("-inf"))
                wide[:, : self.num_draft] = speculator.draft_logits
                speculator.draft_logits = wide

    def fuse(self, draft_tokens: torch.Tensor, idx_mapping: torch.Tensor, num_sampled: torch.Tensor,
             req_ids: Sequence[str] = ()) -> torch.Tensor:
        """Merge the lookup into draft_tokens [num_reqs, num_draft]; idx_mapping: each batch entry's request state;
        num_sampled: tokens each request sampled this step (0 while it prefills); req_ids: the batch's request ids
        (the long block's schedule keys its flags by them). Returns the drafts to store, [num_reqs, verify_tokens]:
        draft_tokens itself, merged in place, when both blocks are the drafter's."""
        batch = draft_tokens.shape[0]
        if batch == 0:
            return draft_tokens
        found = LookupDraft(*(t[:batch] for t in self.found))
        lookup_draft(self.history, self.lengths, self.verify_tokens, self.params.nmin, self.params.nmax,
                     slots=idx_mapping, out=found, scratch=self.scratch[:batch])
        head = LookupDraft(found.tokens[:, : self.num_draft], found.num_valid, found.match_len)
        taken, first = taken_matches(draft_tokens, head, self.params, num_sampled > 0)
        filled = _filled(taken, first, found.num_valid, self.num_draft)
        speculator = self.speculator
        if speculator.draft_logits is not None:
            write_point_masses(speculator.draft_logits, speculator._cached_candidate_ids, idx_mapping, filled,
                               head.tokens)
        draft_tokens.copy_(torch.where(filled, head.tokens, draft_tokens))
        if self.schedule is None:
            return draft_tokens
        tail = found.tokens[:, self.num_draft :]
        if speculator.draft_logits is not None:
            write_tail_point_masses(speculator.draft_logits, self.tail_ids, idx_mapping, tail)
        fillable = taken & (found.num_valid >= self.verify_tokens)
        landed = self.flags.swap(req_ids, fillable, num_sampled)
        # the next batch is not scheduled yet: this one's size stands for the requests in flight
        self.next_block = self.schedule.decide(landed, running=len(req_ids))
        return torch.cat([draft_tokens, tail], dim=1)


def attach(speculator, req_states) -> ContextLookup | None:
    """The runner's hook, or None: not DFlash2's speculator (or no speculator), or VLLM_DFLASH2_LOOKUP=0. The
    runner's request drafts (req_states.draft_tokens, num_speculative_tokens wide) give the verify block."""
    import vllm.envs as envs

    if speculator is None or type(speculator).__name__ != SPECULATOR:
        return None
    verify_tokens = req_states.draft_tokens.shape[1]
    if not envs.VLLM_DFLASH2_LOOKUP:
        if verify_tokens > speculator.num_speculative_steps:
            raise ValueError(f"num_speculative_tokens={verify_tokens} verifies more than DFlash2's drafter "
                             f"proposes ({speculator.num_speculative_steps}); only the lookup fills the rest: set "
                             f"{ENABLE_ENV}=1 (LOOKUP=1) or num_speculative_tokens={speculator.num_speculative_steps}")
        return None
    return ContextLookup(speculator, req_states.all_token_ids.gpu, req_states.total_len.gpu, LookupParams.from_env(),
                         verify_tokens, envs.VLLM_DFLASH2_LOOKUP_STICKY)
