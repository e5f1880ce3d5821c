"""engine/spec_verify_block.py: when DFlash2 verifies the long block (entry, hold, exit, batch > 1), that every
decision reads the flags one step stale (the schedule, and the host copy the hook lands them through), and what the
patch asks of vLLM's config (the drafter's view, the decode query lengths captured)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from qwen_serving.engine import spec_verify_block as svb
from qwen_serving.engine.spec_verify_block import RequestFlags, StaleFlags, VerifyBlockSchedule
from tests.helpers.event_log import Events

SHORT, LONG = 7, 15
FULL = RequestFlags(fillable_tail=True, emitted=SHORT + 1)  # a copying step: full short block, tail fillable
PROSE = RequestFlags(fillable_tail=False, emitted=3)


def _run(schedule: VerifyBlockSchedule, steps: list[dict[str, RequestFlags]], running: int | None = None) -> list[int]:
    return [schedule.step(flags, len(flags) if running is None else running) for flags in steps]


def test_entry_needs_two_saturated_steps_and_a_fillable_tail_seen_one_step_late():
    # the flags of call i land at call i + 1: two copying steps are seen at the third call
    assert _run(VerifyBlockSchedule(LONG), [{"a": FULL}] * 4) == [SHORT, SHORT, LONG, LONG]
    # one saturated step inside prose buys nothing
    single = [{"a": PROSE}, {"a": FULL}, {"a": PROSE}, {"a": FULL}, {"a": PROSE}, {"a": PROSE}]
    assert _run(VerifyBlockSchedule(LONG), single) == [SHORT] * 6
    # saturated steps without a fillable tail (the drafter alone is copying well) keep the short block
    no_tail = RequestFlags(fillable_tail=False, emitted=SHORT + 1)
    assert _run(VerifyBlockSchedule(LONG), [{"a": no_tail}] * 5) == [SHORT] * 5
    # a tail but a short-of-full step: one token missing from the block is not a copy
    almost = RequestFlags(fillable_tail=True, emitted=SHORT)
    assert _run(VerifyBlockSchedule(LONG), [{"a": almost}] * 5) == [SHORT] * 5


def test_hold_sticky_steps_then_exit_with_one_request():
    steps = [{"a": FULL}] * 3 + [{"a": PROSE}] * 6
    # long from call 3; the first prose flags land at call 5, then 3 held steps, short from call 8
    assert _run(VerifyBlockSchedule(LONG, sticky=3), steps) == [SHORT, SHORT, LONG, LONG] + [LONG] * 3 + [SHORT] * 2
    assert _run(VerifyBlockSchedule(LONG, sticky=0), steps) == [SHORT, SHORT, LONG, LONG] + [SHORT] * 5


def test_a_flag_that_returns_inside_the_hold_rearms_it():
    steps = [{"a": FULL}] * 3 + [{"a": PROSE}] * 2 + [{"a": FULL}] * 3 + [{"a": PROSE}] * 5
    got = _run(VerifyBlockSchedule(LONG, sticky=3), steps)
    assert got[2:] == [LONG] * 10 + [SHORT]  # the streak restarts, the hold covers the gap until it qualifies


def test_batch_of_two_takes_the_long_block_for_one_copy_and_never_holds():
    copy_then_stop = [{"a": FULL, "b": PROSE}] * 3 + [{"a": PROSE, "b": PROSE}] * 4
    assert _run(VerifyBlockSchedule(LONG), copy_then_stop) == [SHORT, SHORT, LONG, LONG, SHORT, SHORT, SHORT]
    # the saturation streak is per request: alternating saturated steps across two requests is no copy
    alternating = [{"a": FULL, "b": PROSE}, {"a": PROSE, "b": FULL}] * 3
    assert _run(VerifyBlockSchedule(LONG), alternating) == [SHORT] * 6


def test_hold_only_while_one_request_is_in_flight():
    schedule = VerifyBlockSchedule(LONG)
    assert _run(schedule, [{"a": FULL}] * 3) == [SHORT, SHORT, LONG]
    # a second request is admitted; the copies that land still qualify, so the block stays long
    assert schedule.step({"a": FULL}, running=2) == LONG
    assert schedule.step({"a": PROSE}, running=2) == LONG
    # the copy's prose flags land with two in flight: short at once, no hold
    assert schedule.step({"a": PROSE, "b": PROSE}, running=2) == SHORT


def test_finished_request_loses_its_streak():
    steps = [{"a": FULL}, {"a": FULL}, {"b": FULL}, {"b": PROSE}]
    # "a" finished after two saturated steps; "b" starts from nothing, so its one saturated step is not enough
    assert _run(VerifyBlockSchedule(LONG, sticky=0), steps) == [SHORT, SHORT, LONG, SHORT]


def test_stale_flags_decide_not_the_newest():
    schedule = VerifyBlockSchedule(LONG, sticky=0)
    _run(schedule, [{"a": FULL}] * 3)
    # the newest flags say prose, but the copy that landed (the step before) still says copy
    assert schedule.step({"a": PROSE}, 1) == LONG
    assert schedule.step({"a": FULL}, 1) == SHORT  # now the prose copy has landed
    assert schedule.long is False


def test_short_block_setting_never_goes_long_and_bad_settings_raise():
    assert _run(VerifyBlockSchedule(SHORT), [{"a": FULL}] * 6) == [SHORT] * 6
    with pytest.raises(ValueError, match="DFLASH_TOKENS"):
        VerifyBlockSchedule(5)
    with pytest.raises(ValueError, match="sticky"):
        VerifyBlockSchedule(LONG, sticky=-1)


# ---------------------------------------------------------------- the host copy the hook lands the flags through


def test_the_flags_land_one_call_late_waiting_only_on_the_previous_copy():
    events = Events()
    flags = StaleFlags(4, torch.device("cpu"), new_event=events)
    assert flags.swap(["a", "b"], torch.tensor([True, False]), torch.tensor([8, 3])) is None
    assert events.log == [("record", 1)]
    # the second call returns the first call's flags, though its own (the buffer's next content) differ
    got = flags.swap(["a"], torch.tensor([False]), torch.tensor([2]))
    assert got == {"a": RequestFlags(True, 8), "b": RequestFlags(False, 3)}
    assert events.log == [("record", 1), ("wait", 1), ("record", 2)]  # the old copy waited on, then the new one
    assert flags.swap([], torch.tensor([], dtype=torch.bool), torch.tensor([], dtype=torch.int64)) == {
        "a": RequestFlags(False, 2)}  # request "b" finished: absent
    assert events.log[-2:] == [("wait", 2), ("record", 3)]


def test_the_schedule_fed_through_the_host_copy_equals_the_host_model():
    """decide(StaleFlags.swap(...)) is what step(...) models: the same blocks for the same flags."""
    steps = [{"a": FULL}] * 3 + [{"a": PROSE}] * 5 + [{"a": FULL, "b": PROSE}] * 3 + [{"a": PROSE, "b": PROSE}] * 2
    modelled = _run(VerifyBlockSchedule(LONG), steps)
    schedule, copy = VerifyBlockSchedule(LONG), StaleFlags(4, torch.device("cpu"))
    wired = []
    for flags in steps:
        ids = list(flags)
        landed = copy.swap(ids, torch.tensor([flags[r].fillable_tail for r in ids]),
                           torch.tensor([flags[r].emitted for r in ids]))
        wired.append(schedule.decide(landed, len(ids)))
    assert wired == modelled and LONG in wired and wired[-1] == SHORT


# ---------------------------------------------------------------- what the patch asks of vLLM's config


def _config(k: int, architectures=("DFlash2DraftModel",), block_size: int | None = 8):
    dflash = {"block_size": block_size} if block_size else {}
    draft = SimpleNamespace(architectures=list(architectures), hf_config=SimpleNamespace(dflash_config=dflash))
    return SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=k, draft_model_config=draft),
                           scheduler_config=object())


def test_the_drafter_keeps_its_block_and_both_query_lengths_are_captured():
    config = _config(15)
    view = svb.drafter_config(config)
    assert view.speculative_config.num_speculative_tokens == 7  # the checkpoint's block_size 8 minus the anchor
    assert config.speculative_config.num_speculative_tokens == 15  # the runner's own config untouched
    assert view.scheduler_config is config.scheduler_config  # a shallow view: the rest is the runner's
    assert svb.decode_query_lens(config, 16) == [8, 16]
    assert svb.decode_query_lens(view, 8) == [8]  # the speculator's own graphs: its one query block
    # the drafter's block, where the checkpoint names none, is DFlash2's 7
    assert svb.long_block(_config(15, block_size=None)) == (7, 15)


@pytest.mark.parametrize("config", [_config(7), _config(15, architectures=("DFlashDraftModel",)),
                                    SimpleNamespace(speculative_config=None)])
def test_no_long_block_leaves_vllm_as_it_is(config):
    assert svb.drafter_config(config) is config
    assert svb.decode_query_lens(config, 8) == [8]
