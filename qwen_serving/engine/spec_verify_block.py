"""DFlash2's verify-block length per step: the drafter's short block, or the long one (`DFLASH_TOKENS`) whose tail
the lookup fills, scheduled only while a copy runs.

Enter the long block when a request has a fillable tail (the lookup matched with enough tokens left to fill the
positions past the drafter's) and the last two steps each emitted a full short block for it (drafts + bonus):
one saturated step happens inside prose, two in a row is a copy. Leave when no request qualifies, except that
with exactly one request in flight the long block is held `sticky` steps more: the flag drops for reasons that
have nothing to do with the copy ending, and earning the block back costs two steps. With several requests the
block length is batch-wide (one query length for the decode CUDA graphs), so a hold would make a request's
block depend on when the others arrived: no hold there.

The flags come from a host copy of the device's per-step output that lands one step late (reading the newest
would synchronise the device every step), so each decision sees the step before last.

Pure Python, no vLLM: the GPU work wires it into the V2 runner. The spec's `VLLM_DFLASH2_LOOKUP_STICKY` (3) has
no knob here yet; `sticky` is that value.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

DRAFTER_TOKENS = 7  # the drafts DFlash2's checkpoint proposes per step (its block minus the anchor)
STICKY = 3
SATURATED_STEPS = 2  # full short blocks in a row that make a copy


@dataclass(frozen=True)
class RequestFlags:
    """What one step produced for one request, as the device wrote it."""

    fillable_tail: bool  # the lookup has a match long enough to fill the long block's tail
    emitted: int  # tokens the step emitted (accepted drafts + the bonus or resampled token)


class VerifyBlockSchedule:
    """Call `step` once per decode step with that step's flags; it returns the drafts to verify next step."""

    def __init__(self, verify_tokens: int, drafter_tokens: int = DRAFTER_TOKENS, sticky: int = STICKY):
        if drafter_tokens < 1 or verify_tokens < drafter_tokens:
            raise ValueError(f"need 1 <= drafter_tokens <= verify_tokens (DFLASH_TOKENS), got "
                             f"{drafter_tokens} and {verify_tokens}")
        if sticky < 0:
            raise ValueError(f"sticky must be >= 0, got {sticky}")
        self.verify_tokens = verify_tokens
        self.drafter_tokens = drafter_tokens
        self.sticky = sticky
        self._in_flight: Mapping[str, RequestFlags] | None = None  # the newest copy, not landed yet
        self._saturated: dict[str, int] = {}  # request -> full short blocks in a row, as far as the host knows
        self._hold = 0  # steps the long block is still held without a qualifying request
        self.long = False

    def step(self, flags: Mapping[str, RequestFlags], running: int) -> int:
        """flags: request id -> what the step that just ran produced (its copy starts now and lands by the next
        call); running: requests in flight for the next step (host state, never stale)."""
        landed, self._in_flight = self._in_flight, dict(flags)
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
