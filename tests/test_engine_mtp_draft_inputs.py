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
from torch.utils._python_dispatch import TorchDispatchMode

from qwen_serving.engine import mtp_draft_inputs

HIDDEN = 40  # not a power of two: the row copy's mask matters
MAX_TOKENS = 48
BLOCK = 4
PASSES = 3  # k = 4: the passes after the first


def make_proposer(mrope: bool, max_model_len: int, seed: int) -> SimpleNamespace:
    """The attributes propose's loop and _update_positions_dependent_metadata read, with stale buffers."""
    gen = torch.Generator().manual_seed(seed)
    proposer = SimpleNamespace(
        uses_mrope=mrope, uses_xdrope_dim=0, draft_uses_xdrope_dim=0, max_model_len=max_model_len,
        block_size=BLOCK, use_heterogeneous_vocab=False, supports_mm_inputs=False, constant_draft_positions=False,
        input_ids=torch.randint(0, 1000, (MAX_TOKENS,), generator=gen, dtype=torch.int32),
        hidden_states=torch.randn(MAX_TOKENS, HIDDEN, generator=gen).to(torch.bfloat16),
        _slot_mapping_buffer=torch.randint(0, 1000, (MAX_TOKENS,), generator=gen),
    )
    if mrope:
        proposer.mrope_positions = torch.randint(0, 1000, (3, MAX_TOKENS + 1), generator=gen)
    else:
        proposer.positions = torch.randint(0, 1000, (MAX_TOKENS,), generator=gen)
    return proposer


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


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a, b))
    return type(a) is type(b) and a == b


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


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _launches(ops: list[str]) -> list[str]:
    """The aten ops that launch work on a GPU (views and host-tensor arithmetic aside)."""
    return [op for op in ops if not any(v in op for v in ("slice", "select", "view", "alias", "detach", "expand",
                                                          "add_"))]


class NoLaunch:
    """A Triton kernel that launches nothing: the interpreter's own host copies would count as aten ops."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


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
        counts[name] = _launches(mode.ops)
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
    # vLLM's own lines stay for the proposers that keep its path
    assert "self._update_positions_dependent_metadata(" in text and "self.input_ids[:batch_size] = input_ids" in text


# --- the whole patched propose() against vLLM 0.28.0's own, on a stub drafter -----------------------------------

VOCAB = 300
CAPTURE_SIZES = (1, 2, 4, 8, 16, 32, 48)  # the drafter's CUDA-graph sizes: a batch of 3 runs padded to 4


def pristine_proposer_module():
    """vLLM 0.28.0's llm_base_proposer.py as it ships, loaded beside the patched one."""
    import importlib.util

    path = Path(os.environ["QS_PRISTINE_VLLM"]) / "v1" / "spec_decode" / "llm_base_proposer.py"
    spec = importlib.util.spec_from_file_location("pristine_llm_base_proposer", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class StubDrafter:
    """The MTP drafter's interface to propose(): records what each forward reads, returns hidden states that
    depend on every input (ids, all position rows, hidden states), greedy logits from a fixed head."""

    def __init__(self):
        gen = torch.Generator().manual_seed(7)
        self.head = torch.randn(HIDDEN, VOCAB, generator=gen)
        self.calls: list[dict] = []

    def __call__(self, input_ids, positions, inputs_embeds, hidden_states):
        self.calls.append({"input_ids": input_ids.clone(), "positions": positions.clone(),
                           "hidden_states": hidden_states.clone()})
        rows = positions.float() if positions.dim() == 1 else positions.float().sum(0)
        out = hidden_states.float().roll(1, dims=1) + 0.01 * input_ids.float()[:, None] + 0.001 * rows[:, None]
        return out.to(hidden_states.dtype)

    def compute_logits(self, hidden_states):
        return hidden_states.float() @ self.head


class RecordingBuilder:
    """The drafter's attention-metadata builder: what each build_for_drafting saw."""

    def __init__(self):
        self.builds: list[dict] = []

    def build_for_drafting(self, common_attn_metadata, draft_index):
        cad = common_attn_metadata
        self.builds.append({"draft_index": draft_index, "seq_lens": cad.seq_lens.clone(),
                            "slot_mapping": cad.slot_mapping.clone(), "max_seq_len": cad.max_seq_len,
                            "num_actual_tokens": cad.num_actual_tokens, "max_query_len": cad.max_query_len,
                            "query_start_loc": cad.query_start_loc.clone(),
                            "upper": None if cad.seq_lens_cpu_upper_bound is None
                            else cad.seq_lens_cpu_upper_bound.clone()})
        return SimpleNamespace(draft_index=draft_index)


def stub_proposer(mrope: bool, k: int, max_model_len: int):
    import numpy as np
    from vllm.config import CUDAGraphMode
    from vllm.v1.spec_decode.eagle import EagleProposer

    proposer = object.__new__(EagleProposer)
    base = make_proposer(mrope, max_model_len, seed=3)
    builder = RecordingBuilder()

    def dispatch(num_tokens, valid_modes=None):
        return CUDAGraphMode.NONE, SimpleNamespace(num_tokens=min(s for s in CAPTURE_SIZES if s >= num_tokens))

    vars(proposer).update(vars(base))
    vars(proposer).update(
        vllm_config=SimpleNamespace(parallel_config=SimpleNamespace(data_parallel_size=1),
                                    model_config=SimpleNamespace(uses_mrope=mrope)),
        method="mtp", num_speculative_tokens=k, parallel_drafting=False, needs_extra_input_slots=False,
        pass_hidden_states_to_model=True, _share_mtp_indices=False, eplb_state=None, allowed_attn_types=None,
        _enable_probabilistic_draft_probs=False, use_local_argmax_reduction=False, vocab_mapping=None,
        _draft_attn_layer_names={"mtp.attn"}, model=StubDrafter(),
        draft_model_config=SimpleNamespace(hf_config=SimpleNamespace(architectures=["Qwen3_5MTP"])),
        cudagraph_dispatcher=SimpleNamespace(dispatch=dispatch),
        draft_attn_groups=[SimpleNamespace(get_metadata_builder=lambda: builder, layer_names=["mtp.attn"])],
        arange=torch.arange(MAX_TOKENS + 1, dtype=torch.int32),
        token_arange_np=np.arange(MAX_TOKENS + 1, dtype=np.int32),
        inputs_embeds=torch.zeros(MAX_TOKENS, HIDDEN, dtype=torch.bfloat16))
    if not mrope:
        proposer.mrope_positions = None
    return proposer, builder


def verify_batch(accepted: list[int], k: int, start: int, max_model_len: int, seed: int):
    """propose()'s arguments after a verify step of k drafts per row: padded drafter batch, rows accepting
    ``accepted[r]`` tokens (1..k+1), as prepare_inputs_padded hands them over."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    gen = torch.Generator().manual_seed(seed)
    bs, q = len(accepted), k + 1
    seq_lens = torch.tensor([start + 9 * r for r in range(bs)], dtype=torch.int32)  # after the verify tokens
    positions_1d = torch.cat([torch.arange(s - q, s) for s in seq_lens.tolist()])
    width = max_model_len // BLOCK
    cad = CommonAttentionMetadata(
        query_start_loc=torch.arange(0, bs * q + 1, q, dtype=torch.int32),
        query_start_loc_cpu=torch.arange(0, bs * q + 1, q, dtype=torch.int32),
        seq_lens=seq_lens, num_reqs=bs, num_actual_tokens=bs * q, max_query_len=q,
        max_seq_len=int(seq_lens.max()),
        block_table_tensor=(torch.randperm(bs * width, generator=gen).to(torch.int32) + 1).view(bs, width),
        slot_mapping=torch.randint(0, 5000, (bs * q,), generator=gen),
        seq_lens_cpu_upper_bound=seq_lens.clone())
    return dict(
        target_token_ids=torch.randint(0, VOCAB, (bs * q,), generator=gen, dtype=torch.int32),
        target_positions=positions_1d.expand(3, -1).clone(),
        target_hidden_states=torch.randn(bs * q, HIDDEN, generator=gen).to(torch.bfloat16),
        next_token_ids=torch.randint(0, VOCAB, (bs,), generator=gen, dtype=torch.int32),
        token_indices_to_sample=torch.tensor([r * q + a - 1 for r, a in enumerate(accepted)], dtype=torch.int32),
        common_attn_metadata=cad,
        sampling_metadata=SimpleNamespace(all_greedy=True),
        num_rejected_tokens_gpu=torch.tensor([q - a for a in accepted], dtype=torch.int32))


PROPOSE_CASES = {
    # name: (accepted per row, k, first seq_len, mrope, max_model_len)
    "k=4, batch 1, all accepted": ([5], 4, 40, True, 128),
    "k=4, batch 1, one accepted": ([1], 4, 40, True, 128),
    "k=4, batch 3 (padded to 4), rows accepting fewer": ([5, 2, 1], 4, 30, True, 128),
    "k=4, batch 4, a row reaching max_model_len": ([3, 1, 2, 5], 4, 100, True, 128),
    "k=3, batch 2, 1-D positions": ([2, 4], 3, 20, False, 128),
    "k=2, batch 5 (padded to 8)": ([3, 1, 2, 3, 2], 2, 12, True, 64),
}


def run_propose(propose, case, monkeypatch, module):
    accepted, k, start, mrope, max_model_len = case
    proposer, builder = stub_proposer(mrope, k, max_model_len)
    args = verify_batch(accepted, k, start, max_model_len, seed=11)
    if not mrope:
        args["target_positions"] = args["target_positions"][0].clone()
    monkeypatch.setattr(module, "set_forward_context", lambda *a, **kw: contextlib.nullcontext())
    drafts = propose(proposer, num_speculative_tokens=k, mm_embed_inputs=None, slot_mappings=None, **args)
    buffers = {name: getattr(proposer, name).clone() for name in
               ("input_ids", "hidden_states", "_slot_mapping_buffer", "mrope_positions" if mrope else "positions")}
    return drafts, proposer.model.calls, builder.builds, buffers, args["common_attn_metadata"]


@pytest.mark.parametrize("case", PROPOSE_CASES)
def test_the_patched_propose_equals_vllms(case, monkeypatch):
    """Draft ids, every forward's inputs, every pass's attention metadata and the buffers afterwards: the same."""
    from vllm.v1.spec_decode import llm_base_proposer as patched

    pristine = pristine_proposer_module()
    want = run_propose(pristine.SpecDecodeBaseProposer.propose, PROPOSE_CASES[case], monkeypatch, pristine)
    got = run_propose(patched.SpecDecodeBaseProposer.propose, PROPOSE_CASES[case], monkeypatch, patched)
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


class CountPropose(TorchDispatchMode):
    """propose()'s own GPU-launching aten ops: the stub drafter's are not vLLM's, the views launch nothing."""

    def __init__(self, drafter: StubDrafter):
        super().__init__()
        self.drafter, self.ops = drafter, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.drafter.busy:
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


class CountedDrafter(StubDrafter):
    busy = False

    def __call__(self, *args, **kwargs):
        self.busy = True
        try:
            return super().__call__(*args, **kwargs)
        finally:
            self.busy = False

    def compute_logits(self, hidden_states):
        self.busy = True
        try:
            return super().compute_logits(hidden_states)
        finally:
            self.busy = False


def test_a_k4_step_dispatches_12_fewer_ops(monkeypatch):
    """k=4, batch 1: vLLM's propose dispatches 4 ops a chained pass that the fused pass does not (the cast and
    three copies), 12 a step; the kernels are no aten ops (their launches are stubbed here)."""
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
        counts[name] = _launches(mode.ops)
    removed = collections.Counter(counts["vllm"]) - collections.Counter(counts["fused"])
    assert removed == {"aten._to_copy.default": 3, "aten.copy_.default": 9}
    assert not collections.Counter(counts["fused"]) - collections.Counter(counts["vllm"])
    # what stays of propose's own: the first pass's three copies and index_put, the slot copy and padding fill,
    # three gathers, the seq_lens update, the four greedy argmaxes, the stack, two host-tensor ops
    assert len(counts["vllm"]) == 29 and len(counts["fused"]) == 17
