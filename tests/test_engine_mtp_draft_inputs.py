"""qwen_serving.engine.mtp_draft_inputs (mtp-draft-inputs.patch): the fused inputs of a chained draft pass equal
what vLLM's own loop lines leave behind, buffer for buffer and field for field, pass after pass.

vLLM's side is its own code on CPU: the int32 cast, ``SpecDecodeBaseProposer._update_positions_dependent_metadata``
(its Triton kernel interpreted) and the two buffer copies, as ``propose`` runs them between draft forwards; then the
whole ``propose`` of vLLM 0.28.0's file against the patched one, on a stand-in drafter that records every forward's
inputs and every metadata build. Both sides start from the same buffers, stale entries beyond the batch included,
and the same metadata.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from qwen_serving.engine import mtp_draft_inputs
from tests.helpers.spec_propose import (
    BLOCK,
    HIDDEN,
    CountedDrafter,
    CountOps,
    CountPropose,
    NoLaunch,
    StubDrafter,
    launches,
    make_proposer,
    pristine_proposer_module,
    same,
    stub_proposer,
    verify_batch,
)

PASSES = 3  # k = 4: the passes after the first


@dataclasses.dataclass
class Case:
    start: list[int]  # each row's position in the first pass's sample (after rejection)
    input_batch_size: int | None = None  # CUDA-graph padded size (None: the batch's)
    mrope: bool = True
    max_model_len: int = 64
    cpu_shadows: bool = False  # _seq_lens_cpu / _num_computed_tokens_cpu still set


CASES = {
    "batch 1": Case([17]),
    "batch 1, padded to 2": Case([30], input_batch_size=2),
    "batch 4, rows accepting different counts": Case([9, 22, 5, 40]),
    "batch 3, padded to 8": Case([12, 3, 27], input_batch_size=8),
    "a row reaches max_model_len": Case([11, 61, 62], input_batch_size=4),
    "1-D positions": Case([9, 22, 5], mrope=False),
    "1-D positions, padded, at the limit": Case([62, 8], input_batch_size=4, mrope=False),
    "host shadows kept": Case([14, 35], cpu_shadows=True),
}


def make_metadata(case: Case, seed: int):
    """The loop's common metadata after propose's first pass: seq_lens less the rejected tokens, host shadows."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    bs = len(case.start)
    gen = torch.Generator().manual_seed(seed)
    width = case.max_model_len // BLOCK
    seq_lens = torch.tensor(case.start, dtype=torch.int32) + 1
    upper = seq_lens + torch.randint(0, 4, (bs,), generator=gen, dtype=torch.int32)  # before rejection
    return CommonAttentionMetadata(
        query_start_loc=torch.arange(bs + 1, dtype=torch.int32), query_start_loc_cpu=torch.arange(bs + 1),
        seq_lens=seq_lens, num_reqs=bs, num_actual_tokens=bs, max_query_len=1, max_seq_len=int(seq_lens.max()),
        block_table_tensor=torch.randperm(bs * width, generator=gen).to(torch.int32).view(bs, width) + 1,
        slot_mapping=torch.zeros(bs, dtype=torch.int64),
        _seq_lens_cpu=seq_lens.clone() if case.cpu_shadows else None,
        _num_computed_tokens_cpu=seq_lens.clone() - 1 if case.cpu_shadows else None,
        seq_lens_cpu_upper_bound=upper)


def first_positions(proposer, case: Case) -> torch.Tensor:
    """The first pass's sampled positions: a gathered copy, as propose takes them (mrope_positions[:, idx])."""
    start = torch.tensor(case.start)
    return start.expand(3, -1).clone() if case.mrope else start.clone()


def vllm_pass(proposer, tokens, positions, hidden, cad, bs, ibs):
    """vLLM 0.28.0's lines of the loop, verbatim in effect: the cast, the metadata update, the two copies."""
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    input_ids = tokens.int()
    positions = SpecDecodeBaseProposer._update_positions_dependent_metadata(
        proposer, positions, cad, bs, ibs, proposer.block_size)
    proposer.input_ids[:bs] = input_ids
    proposer.hidden_states[:bs] = hidden
    return positions


def fused_pass(proposer, tokens, positions, hidden, cad, bs, ibs):
    return mtp_draft_inputs.advance_draft_inputs(proposer, tokens, positions, hidden, cad, bs, ibs)


def run(case: Case, step, seed: int = 0):
    """PASSES chained passes of ``step``; the proposer, the metadata and each pass's returned positions."""
    bs = len(case.start)
    ibs = case.input_batch_size or bs
    proposer = make_proposer(case.mrope, case.max_model_len, seed)
    cad = make_metadata(case, seed)
    positions = first_positions(proposer, case)
    gen = torch.Generator().manual_seed(seed + 1)
    hidden = torch.randn(bs, HIDDEN, generator=gen).to(torch.bfloat16)  # the first pass's sampled rows
    returned = []
    for _ in range(PASSES):
        tokens = torch.randint(0, 1000, (bs,), generator=gen)  # int64, as the draft samplers return them
        positions = step(proposer, tokens, positions, hidden, cad, bs, ibs)
        returned.append(positions)
        # the next forward's output rows: a view into a wider output buffer, as propose slices it
        hidden = torch.randn(ibs, HIDDEN, generator=gen).to(torch.bfloat16)[:bs]
    return proposer, cad, returned


def differences(case: Case, fused_step) -> set[str]:
    ours, our_cad, our_positions = run(case, fused_step)
    want, want_cad, want_positions = run(case, vllm_pass)
    names = {name for name in vars(want) if not same(getattr(want, name), getattr(ours, name))}
    names |= {f"cad.{f.name}" for f in dataclasses.fields(want_cad)
              if not same(getattr(want_cad, f.name), getattr(our_cad, f.name))}
    for index, (mine, theirs) in enumerate(zip(our_positions, want_positions, strict=True)):
        # the same values, and the same view of the proposer's own buffer
        buffer_mine = ours.mrope_positions if case.mrope else ours.positions
        buffer_theirs = want.mrope_positions if case.mrope else want.positions
        if not same(mine, theirs) or (mine.data_ptr() - buffer_mine.data_ptr(), mine.stride()) != (
                theirs.data_ptr() - buffer_theirs.data_ptr(), theirs.stride()):
            names.add(f"positions returned by pass {index + 1}")
    if our_cad.slot_mapping.data_ptr() != ours._slot_mapping_buffer.data_ptr():
        names.add("cad.slot_mapping is not a view of the slot buffer")
    return names


@pytest.mark.parametrize("case", CASES)
def test_the_fused_pass_equals_vllms_lines(case):
    assert differences(CASES[case], fused_pass) == set()


def test_the_cases_reach_the_clamp_and_the_padding():
    """The designed inputs exercise what could go wrong: a clamped row (slot PADDING_SLOT_ID, seq_len 1),
    padding slots, stale entries beyond the batch that must survive."""
    case = CASES["a row reaches max_model_len"]
    proposer, cad, _ = run(case, vllm_pass)
    fresh = make_proposer(case.mrope, case.max_model_len, 0)
    assert proposer._slot_mapping_buffer[:4].tolist().count(-1) >= 2  # the clamped row and the padding row
    assert 1 <= int(cad.seq_lens.min()) < 4
    assert torch.equal(proposer.mrope_positions[:, 4:], fresh.mrope_positions[:, 4:])
    assert torch.equal(proposer.hidden_states[3:], fresh.hidden_states[3:])


POSITION_BUFFER = mtp_draft_inputs.position_buffer


def _one_position_row(proposer):
    buffer, _ = POSITION_BUFFER(proposer)
    return buffer, 1


@pytest.mark.parametrize(("broken", "caught"), [
    ("first M-RoPE row only", {"mrope_positions"}),
    ("no padding slots", {"_slot_mapping_buffer"}),
])
def test_a_broken_fused_pass_is_caught(broken, caught, monkeypatch):
    if broken == "first M-RoPE row only":
        monkeypatch.setattr(mtp_draft_inputs, "position_buffer", _one_position_row)
        step = fused_pass
        case = CASES["batch 4, rows accepting different counts"]
    else:
        def step(proposer, tokens, positions, hidden, cad, bs, ibs):
            return fused_pass(proposer, tokens, positions, hidden, cad, bs, bs)
        case = CASES["batch 3, padded to 8"]
    assert caught <= differences(case, step)


def test_one_pass_dispatches_no_copy_ops(monkeypatch):
    """vLLM's pass: the cast and three copies besides its kernel; ours: none besides its kernel (views and the host
    shadows' in-place adds only)."""
    from vllm.v1.spec_decode import utils

    monkeypatch.setattr(utils, "eagle_step_slot_mapping_metadata_kernel", NoLaunch())
    monkeypatch.setattr(mtp_draft_inputs, "advance_kernel", NoLaunch())
    case = CASES["batch 4, rows accepting different counts"]
    counts = {}
    for name, step in (("vllm", vllm_pass), ("fused", fused_pass)):
        proposer = make_proposer(True, 64, 0)
        cad = make_metadata(case, 0)
        positions, hidden = first_positions(proposer, case), torch.zeros(4, HIDDEN, dtype=torch.bfloat16)
        tokens = torch.arange(4)
        with CountOps() as mode:
            step(proposer, tokens, positions, hidden, cad, 4, 4)
        counts[name] = launches(mode.ops)
    assert counts["vllm"] == ["aten._to_copy.default", "aten.copy_.default", "aten.copy_.default",
                              "aten.copy_.default"]
    assert counts["fused"] == []


def test_proposers_that_change_the_ids_or_positions_keep_vllms_path():
    base = make_proposer(True, 64, 0)
    assert mtp_draft_inputs.fused_supported(base)
    for change in ({"use_heterogeneous_vocab": True}, {"supports_mm_inputs": True},
                   {"constant_draft_positions": True}, {"uses_xdrope_dim": 2, "draft_uses_xdrope_dim": 2}):
        assert not mtp_draft_inputs.fused_supported(SimpleNamespace(**{**vars(base), **change}))
    # XD-RoPE on the target only: the drafter's positions are 1-D, which the kernel handles
    assert mtp_draft_inputs.fused_supported(SimpleNamespace(**{**vars(base), "uses_xdrope_dim": 2}))


def test_hidden_states_of_another_dtype_are_refused():
    case = CASES["batch 1"]
    proposer, cad = make_proposer(True, 64, 0), make_metadata(case, 0)
    with pytest.raises(ValueError, match="width and dtype"):
        fused_pass(proposer, torch.zeros(1, dtype=torch.long), first_positions(proposer, case),
                   torch.zeros(1, HIDDEN), cad, 1, 1)


def test_the_patched_loop_routes_through_the_hook():
    patched = Path(os.environ["QS_PATCHED_VLLM"]) / "v1" / "spec_decode" / "llm_base_proposer.py"
    pristine = Path(os.environ["QS_PRISTINE_VLLM"]) / "v1" / "spec_decode" / "llm_base_proposer.py"
    text, before = patched.read_text(), pristine.read_text()
    assert "mtp_draft_inputs" not in before
    assert "fused_inputs = fused_supported(self)" in text
    assert text.count("not fused_inputs") == 2
    assert SHARED_GATHER + "            # one tensor out of the forward (MTP): its sampled rows are gathered\n" \
        "            hidden_states = sample_hidden_states\n" in text
    # vLLM's own lines stay for the proposers that keep its path
    assert "self._update_positions_dependent_metadata(" in text and "self.input_ids[:batch_size] = input_ids" in text


# --- the whole patched propose() against vLLM 0.28.0's own, on a stub drafter -----------------------------------

PROPOSE_CASES = {
    # name: (accepted per row, k, first seq_len, mrope, max_model_len)
    "k=4, batch 1, all accepted": ([5], 4, 40, True, 128),
    "k=4, batch 1, one accepted": ([1], 4, 40, True, 128),
    "k=4, batch 3 (padded to 4), rows accepting fewer": ([5, 2, 1], 4, 30, True, 128),
    "k=4, batch 4, a row reaching max_model_len": ([3, 1, 2, 5], 4, 100, True, 128),
    "k=3, batch 2, 1-D positions": ([2, 4], 3, 20, False, 128),
    "k=2, batch 5 (padded to 8)": ([3, 1, 2, 3, 2], 2, 12, True, 64),
}


class TupleDrafter(StubDrafter):
    """A drafter whose forward returns (hidden states for the logits, hidden states to feed back), as DeepSeek's
    MTP does: the first pass gathers the sampled rows of both."""

    def __call__(self, *args, **kwargs):
        out = super().__call__(*args, **kwargs)
        return out, (out.float() * 0.5 + 0.25).to(out.dtype)


def run_propose(propose, case, monkeypatch, module, tuple_outputs=False):
    accepted, k, start, mrope, max_model_len = case
    proposer, builder = stub_proposer(mrope, k, max_model_len)
    if tuple_outputs:
        proposer.model = TupleDrafter()
        proposer.draft_model_config = SimpleNamespace(hf_config=SimpleNamespace(architectures=["DeepSeekMTPModel"]))
    args = verify_batch(accepted, k, start, max_model_len, seed=11)
    if not mrope:
        args["target_positions"] = args["target_positions"][0].clone()
    monkeypatch.setattr(module, "set_forward_context", lambda *a, **kw: contextlib.nullcontext())
    drafts = propose(proposer, num_speculative_tokens=k, mm_embed_inputs=None, slot_mappings=None, **args)
    buffers = {name: getattr(proposer, name).clone() for name in
               ("input_ids", "hidden_states", "_slot_mapping_buffer", "mrope_positions" if mrope else "positions")}
    return drafts, proposer.model.calls, builder.builds, buffers, args["common_attn_metadata"]


@pytest.mark.parametrize("tuple_outputs", [False, True], ids=["MTP", "a drafter returning two hidden states"])
@pytest.mark.parametrize("case", PROPOSE_CASES)
def test_the_patched_propose_equals_vllms(case, tuple_outputs, monkeypatch):
    """Draft ids, every forward's inputs, every pass's attention metadata and the buffers afterwards: the same."""
    from vllm.v1.spec_decode import llm_base_proposer as patched

    pristine = pristine_proposer_module()
    want = run_propose(pristine.SpecDecodeBaseProposer.propose, PROPOSE_CASES[case], monkeypatch, pristine,
                       tuple_outputs)
    got = run_propose(patched.SpecDecodeBaseProposer.propose, PROPOSE_CASES[case], monkeypatch, patched,
                      tuple_outputs)
    (want_drafts, want_calls, want_builds, want_buffers, want_cad) = want
    (drafts, calls, builds, buffers, cad) = got
    k = PROPOSE_CASES[case][1]
    assert drafts.shape == (len(PROPOSE_CASES[case][0]), k) and torch.equal(drafts, want_drafts)
    assert len(calls) == len(want_calls) == k
    for mine, theirs in zip(calls, want_calls, strict=True):
        assert mine.keys() == theirs.keys() and all(same(mine[n], theirs[n]) for n in mine)
    assert len(builds) == len(want_builds) == k
    for mine, theirs in zip(builds, want_builds, strict=True):
        assert mine.keys() == theirs.keys() and all(same(mine[n], theirs[n]) for n in mine)
    assert buffers.keys() == want_buffers.keys() and all(same(buffers[n], want_buffers[n]) for n in buffers)
    assert {f.name for f in dataclasses.fields(cad) if not same(getattr(cad, f.name), getattr(want_cad, f.name))} \
        == set()


def test_the_propose_comparison_sees_a_broken_pass(monkeypatch):
    """The same comparison with the fused pass writing the first M-RoPE row only: the draft forwards' positions
    differ, so does what they return."""
    from vllm.v1.spec_decode import llm_base_proposer as patched

    case = PROPOSE_CASES["k=4, batch 3 (padded to 4), rows accepting fewer"]
    pristine = pristine_proposer_module()
    want_calls = run_propose(pristine.SpecDecodeBaseProposer.propose, case, monkeypatch, pristine)[1]
    monkeypatch.setattr(mtp_draft_inputs, "position_buffer", _one_position_row)
    calls = run_propose(patched.SpecDecodeBaseProposer.propose, case, monkeypatch, patched)[1]
    assert same(calls[0]["positions"], want_calls[0]["positions"])  # the first forward is not the loop's
    assert not same(calls[1]["positions"], want_calls[1]["positions"])
    assert not same(calls[2]["hidden_states"], want_calls[2]["hidden_states"])


SHARED_GATHER = "        if hidden_states is last_hidden_states:\n"


def patched_module_with(old: str, new: str):
    """The patched llm_base_proposer.py with one line changed, loaded beside the patched one."""
    import types

    path = Path(os.environ["QS_PATCHED_VLLM"]) / "v1" / "spec_decode" / "llm_base_proposer.py"
    source = path.read_text()
    assert source.count(old) == 1
    module = types.ModuleType("mutated_llm_base_proposer")
    exec(compile(source.replace(old, new), str(path), "exec"), module.__dict__)
    return module


def test_the_first_pass_gathers_once_only_when_it_is_the_same_tensor(monkeypatch):
    """A propose() reusing the sampled rows whatever the forward returned is caught on a drafter returning two
    hidden states: the first chained forward reads the logits' rows instead of the ones to feed back."""
    case = PROPOSE_CASES["k=4, batch 3 (padded to 4), rows accepting fewer"]
    pristine = pristine_proposer_module()
    want_calls = run_propose(pristine.SpecDecodeBaseProposer.propose, case, monkeypatch, pristine, True)[1]
    broken = patched_module_with(SHARED_GATHER, "        if True:\n")
    calls = run_propose(broken.SpecDecodeBaseProposer.propose, case, monkeypatch, broken, True)[1]
    assert same(calls[0]["hidden_states"], want_calls[0]["hidden_states"])
    assert not same(calls[1]["hidden_states"], want_calls[1]["hidden_states"])


def test_a_k4_step_dispatches_13_fewer_ops(monkeypatch):
    """k=4, batch 1: vLLM's propose dispatches 4 ops a chained pass that the fused pass does not (the cast and
    three copies), 12 a step, and the first pass gathers MTP's sampled rows twice (one gather more); the kernels are
    no aten ops (their launches are stubbed here)."""
    from vllm.v1.spec_decode import llm_base_proposer as patched
    from vllm.v1.spec_decode import utils

    pristine = pristine_proposer_module()
    monkeypatch.setattr(utils, "eagle_step_slot_mapping_metadata_kernel", NoLaunch())
    monkeypatch.setattr(mtp_draft_inputs, "advance_kernel", NoLaunch())
    builder = SimpleNamespace(build_for_drafting=lambda **kwargs: SimpleNamespace())  # records (clones) nothing
    quiet_group = SimpleNamespace(get_metadata_builder=lambda: builder, layer_names=["mtp.attn"])
    counts = {}
    for name, module in (("vllm", pristine), ("fused", patched)):
        accepted, k, start, mrope, max_model_len = PROPOSE_CASES["k=4, batch 1, all accepted"]
        proposer, _ = stub_proposer(mrope, k, max_model_len)
        proposer.model = CountedDrafter()
        proposer.draft_attn_groups = [quiet_group]
        args = verify_batch(accepted, k, start, max_model_len, seed=11)
        monkeypatch.setattr(module, "set_forward_context", lambda *a, **kw: contextlib.nullcontext())
        with CountPropose(proposer.model) as mode:
            module.SpecDecodeBaseProposer.propose(proposer, num_speculative_tokens=k, mm_embed_inputs=None,
                                                  slot_mappings=None, **args)
        counts[name] = launches(mode.ops)
    removed = collections.Counter(counts["vllm"]) - collections.Counter(counts["fused"])
    assert removed == {"aten._to_copy.default": 3, "aten.copy_.default": 9, "aten.index.Tensor": 1}
    assert not collections.Counter(counts["fused"]) - collections.Counter(counts["vllm"])
    # what stays of propose's own: the first pass's three copies and index_put, the slot copy and padding fill,
    # two gathers, the seq_lens update, the four greedy argmaxes, the stack, two host-tensor ops
    assert len(counts["vllm"]) == 29 and len(counts["fused"]) == 16
