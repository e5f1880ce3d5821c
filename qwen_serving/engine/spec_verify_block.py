"""DFlash2's verify-block length per step: the drafter's short block, or the long one (`DFLASH_TOKENS`) whose tail
the lookup fills, scheduled only while a copy runs.

Enter the long block when a request has a fillable tail (the lookup matched with enough tokens left to fill the
positions past the drafter's) and the last two steps each emitted a full short block for it (drafts + bonus):
one saturated step happens inside prose, two in a row is a copy. Leave when no request qualifies, except that
with exactly one request in flight the long block is held `sticky` steps more (VLLM_DFLASH2_LOOKUP_STICKY): the
flag drops for reasons that have nothing to do with the copy ending, and earning the block back costs two steps.
With several requests the block length is batch-wide (one query length for the decode CUDA graphs), so a hold
would make a request's block depend on when the others arrived: no hold there.

The flags come from a host copy of the device's per-step output that lands one step late (reading the newest
would synchronise the device every step), so each decision sees the step before last.

How vLLM 0.28.0's V2 runner sets the verify length (read from its sources, pristine tree):
- The scheduler schedules, per request, as many drafts as the list the worker handed back last step
  (`Scheduler.update_draft_token_ids` -> `request.spec_token_ids`); the V2 runner hands back
  `DraftTokensHandler.set_draft_tokens(drafts)`'s width, `-1` placeholders unless structured output needs the
  tokens. The runner then takes per-request draft counts from `scheduled_spec_decode_tokens` (`cu_num_logits`,
  `expand_idx_mapping`, the rejection sampler's `num_speculative_steps` is only the buffers' width). So the
  length can change every step, by the width handed to `set_draft_tokens`: the patch trims it to the schedule's
  choice. Async scheduling does not wait for that list: `AsyncScheduler` schedules `num_spec_tokens_to_schedule`
  placeholders (`num_speculative_tokens`, or the dynamic-SD table by batch size) before the step's drafts exist,
  so the choice never reaches it (the planner keeps ASYNC_SCHED=0 with SPEC=dflash2).
- `num_speculative_tokens` sizes everything the target side holds (request draft buffer, sampler, rejection
  sampler, structured-output mask, KV look-ahead, the decode query length 1 + K) and, through
  `speculative_config`, the DFlash2 speculator (`num_speculative_steps`, its query block 1 + K, its draft-logit
  cache) and the drafter model (`DFlash2Qwen3DecoderLayer`'s grouped-conv block 1 + K). The drafter keeps its
  checkpoint's block only if the speculator reads a config whose K is the drafter's: `drafter_config` is that
  view (the runner's own config keeps DFLASH_TOKENS).
- Uniform-decode CUDA graphs: `CudaGraphManager._init_candidates` captures one uniform query length,
  `decode_query_len`, unless dynamic speculative decoding lists several (`num_speculative_tokens_per_batch_size`,
  which also changes the scheduler); the V2 runner does not round the capture sizes to it. The patch makes the
  list `decode_query_lens` (both lengths for the long block), and the dispatcher already matches a batch by its
  uniform token count, so a short step replays a short graph.

Not run on a GPU yet: the patched runner, its CUDA graphs and the scheduling feedback are checked on the CPU only
(tests/test_engine_spec_verify_block.py, tests/test_engine_dflash2_lookup.py). The GDN layers' spec-decode state
paths and the split-KV verify kernel see both query lengths per request; that is vLLM's dynamic-SD path too, but
nothing here has run it.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

DRAFTER_TOKENS = 7  # the drafts DFlash2's checkpoint proposes per step (its block minus the anchor)
STICKY = 3
STICKY_ENV = "VLLM_DFLASH2_LOOKUP_STICKY"
SATURATED_STEPS = 2  # full short blocks in a row that make a copy
DFLASH2_ARCH = "DFlash2DraftModel"  # what init_speculator builds DFlash2's speculator for


@dataclass(frozen=True)
class RequestFlags:
    """What one step produced for one request, as the device wrote it."""

    fillable_tail: bool  # the lookup has a match long enough to fill the long block's tail
    emitted: int  # tokens the step emitted (accepted drafts + the bonus or resampled token)


class VerifyBlockSchedule:
    """`decide` once per decode step with the flags that have landed; it returns the drafts to verify next step.
    `step` is the same with the one-step-late landing done on the host (flags in, landed next call)."""

    def __init__(self, verify_tokens: int, drafter_tokens: int = DRAFTER_TOKENS, sticky: int = STICKY):
        if drafter_tokens < 1 or verify_tokens < drafter_tokens:
            raise ValueError(f"need 1 <= drafter_tokens <= verify_tokens (DFLASH_TOKENS), got "
                             f"{drafter_tokens} and {verify_tokens}")
        if sticky < 0:
            raise ValueError(f"sticky ({STICKY_ENV}) must be >= 0, got {sticky}")
        self.verify_tokens = verify_tokens
        self.drafter_tokens = drafter_tokens
        self.sticky = sticky
        self._in_flight: Mapping[str, RequestFlags] | None = None  # `step`'s newest flags, not landed yet
        self._saturated: dict[str, int] = {}  # request -> full short blocks in a row, as far as the host knows
        self._hold = 0  # steps the long block is still held without a qualifying request
        self.long = False

    def step(self, flags: Mapping[str, RequestFlags], running: int) -> int:
        """flags: request id -> what the step that just ran produced (its copy starts now and lands by the next
        call); running: requests in flight for the next step (host state, never stale)."""
        landed, self._in_flight = self._in_flight, dict(flags)
        return self.decide(landed, running)

    def decide(self, landed: Mapping[str, RequestFlags] | None, running: int) -> int:
        """landed: the flags of the step before last (None before any has landed)."""
        if landed is not None:
            self._land(landed)
        qualifies = landed is not None and any(
            f.fillable_tail and self._saturated.get(rid, 0) >= SATURATED_STEPS for rid, f in landed.items())
        if self.verify_tokens == self.drafter_tokens:
            self.long = False
        elif qualifies:
            self.long, self._hold = True, self.sticky
        elif self.long and running == 1 and self._hold > 0:
            self._hold -= 1
        else:
            self.long, self._hold = False, 0
        return self.verify_tokens if self.long else self.drafter_tokens

    def _land(self, landed: Mapping[str, RequestFlags]) -> None:
        full = self.drafter_tokens + 1
        self._saturated = {rid: self._saturated.get(rid, 0) + 1 if f.emitted >= full else 0
                           for rid, f in landed.items()}  # a request absent from the copy has finished


class StaleFlags:
    """The per-step flags' device-to-host copy, read one step late.

    `swap` first lands the copy the previous step started (waiting on that step's event only: its work was
    enqueued before everything the host has queued since), then starts this step's copy into the same pinned
    buffer and records its event. The host reads the buffer through a numpy view made once, so the per-step
    path converts no tensor to host values."""

    def __init__(self, max_reqs: int, device: torch.device, new_event=None):
        cuda = device.type == "cuda"
        # one row per request: a batch's rows are one contiguous block, so each copy is a single async transfer
        self._host = torch.zeros(max_reqs, 2, dtype=torch.int32, pin_memory=cuda)
        self._view = self._host.numpy()
        self._new_event = new_event or ((lambda: torch.cuda.Event()) if cuda else None)
        self._pending: tuple[list[str], object] | None = None  # (request ids, event) of the copy in flight

    def swap(self, req_ids: Sequence[str], fillable: torch.Tensor, emitted: torch.Tensor
             ) -> dict[str, RequestFlags] | None:
        """Start the copy of this step's flags ([num_reqs] each, on the device); return the previous step's."""
        landed = None
        if self._pending is not None:
            ids, event = self._pending
            if event is not None:
                event.synchronize()
            landed = {rid: RequestFlags(bool(fill), int(out)) for rid, (fill, out)
                      in zip(ids, self._view[: len(ids)], strict=True)}
        flags = torch.stack([fillable.to(torch.int32), emitted.to(torch.int32)], dim=1)
        self._host[: len(req_ids)].copy_(flags, non_blocking=True)
        event = self._new_event() if self._new_event is not None else None
        if event is not None:
            event.record()
        self._pending = (list(req_ids), event)
        return landed


def drafter_tokens(speculative_config) -> int | None:
    """The drafts DFlash2's checkpoint proposes per step (its dflash_config block minus the anchor), or None for a
    speculator that is not DFlash2's."""
    draft = getattr(speculative_config, "draft_model_config", None)
    if speculative_config is None or draft is None or DFLASH2_ARCH not in (draft.architectures or ()):
        return None
    block = (getattr(draft.hf_config, "dflash_config", None) or {}).get("block_size")
    return int(block) - 1 if block else DRAFTER_TOKENS


def long_block(vllm_config) -> tuple[int, int] | None:
    """(drafter's drafts, verify drafts) when the runner verifies more than DFlash2's drafter proposes, else None."""
    spec = vllm_config.speculative_config
    drafts = drafter_tokens(spec)
    if drafts is None or spec.num_speculative_tokens <= drafts:
        return None
    return drafts, spec.num_speculative_tokens


def drafter_config(vllm_config):
    """The config the speculator is built from: the runner's, or for the long block a shallow view whose
    speculative_config proposes the drafter's own block (the speculator's buffers, query block and the drafter
    model's conv block read num_speculative_tokens). Shallow: every other sub-config is the runner's object."""
    block = long_block(vllm_config)
    if block is None:
        return vllm_config
    view = copy.copy(vllm_config)
    view.speculative_config = copy.copy(vllm_config.speculative_config)
    view.speculative_config.num_speculative_tokens = block[0]
    return view


def decode_query_lens(vllm_config, decode_query_len: int) -> list[int]:
    """The uniform-decode query lengths to capture CUDA graphs for: both blocks' for the long block."""
    block = long_block(vllm_config)
    if block is None:
        return [decode_query_len]
    bonus = decode_query_len - block[1]
    return [block[0] + bonus, decode_query_len]
