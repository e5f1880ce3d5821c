"""A stand-in for vLLM 0.28.0's V1 drafter around ``SpecDecodeBaseProposer.propose``, to run the patched propose()
against the file vLLM ships, on CPU: a proposer with the buffers and attributes propose reads (stale entries beyond
the batch included), a drafter that records every forward's inputs, a metadata builder that records every build,
the arguments of a padded verify step, aten-op counting, and a drafter with a draft head and the sampling metadata
it reads (tests/test_engine_mtp_draft_inputs.py, tests/test_engine_mtp_draft_probs.py,
tests/test_engine_mtp_seeded_drafts.py).
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import torch
from torch.utils._python_dispatch import TorchDispatchMode

HIDDEN = 40  # not a power of two: the row copy's mask matters
MAX_TOKENS = 48
BLOCK = 4
VOCAB = 300
CAPTURE_SIZES = (1, 2, 4, 8, 16, 32, 48)  # the drafter's CUDA-graph sizes: a batch of 3 runs padded to 4


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


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a, b))
    return type(a) is type(b) and a == b


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def launches(ops: list[str]) -> list[str]:
    """The aten ops that launch work on a GPU (views and host-tensor arithmetic aside)."""
    return [op for op in ops if not any(v in op for v in ("slice", "select", "view", "alias", "detach", "expand",
                                                          "add_"))]


class NoLaunch:
    """A Triton kernel that launches nothing: the interpreter's own host copies would count as aten ops."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


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


DRAFT_IDS = sorted(torch.randperm(VOCAB, generator=torch.Generator().manual_seed(5))[:120].tolist())


class DraftHeadDrafter(CountedDrafter):
    """The stand-in drafter with a draft head (a real ``DraftVocab``, 120 of the 300 ids), its ``sample_draft``
    routed as Qwen3_5MTP's is (None without a head: vLLM's drafter sampling over ``compute_logits``). The head's GEMM
    counts as the drafter's, like its forward."""

    def __init__(self, with_head: bool = True):
        super().__init__()
        from vllm.config import VllmConfig, set_current_vllm_config

        from qwen_serving.engine.mtp_draft_vocab import DraftVocab

        with set_current_vllm_config(VllmConfig()):  # LogitsProcessor is a CustomOp
            self.draft_vocab = DraftVocab(DRAFT_IDS, VOCAB) if with_head else None
        weight = 0.15 * torch.randn(len(DRAFT_IDS), HIDDEN, generator=torch.Generator().manual_seed(8))
        self.draft_head = SimpleNamespace(tp_size=1, quant_method=SimpleNamespace(apply=self.head_gemm), weight=weight)

    def head_gemm(self, layer, hidden_states, bias=None):
        self.busy = True
        try:
            return hidden_states.float() @ layer.weight.t()
        finally:
            self.busy = False

    def sample_draft(self, hidden_states, sampling_metadata, step_probs=None):
        if self.draft_vocab is None:
            return None
        return self.draft_vocab.sample(self.draft_head, hidden_states, sampling_metadata, step_probs)


def sampling(temperature: list[float], top_k: list[int] | None, top_p: list[float] | None,
             generators: dict[int, torch.Generator] | None = None):
    """The per-request sampling metadata the drafter reads (vLLM: top_k / top_p None when no request uses them;
    ``generators``: batch row -> the seeded request's generator)."""
    from qwen_serving.engine.kernels.draft_sample import SAMPLING_EPS

    t = torch.tensor(temperature, dtype=torch.float32)
    return SimpleNamespace(
        all_greedy=bool((t < SAMPLING_EPS).all()), all_random=bool((t >= SAMPLING_EPS).all()),
        temperature=t, top_k=None if top_k is None else torch.tensor(top_k),
        top_p=None if top_p is None else torch.tensor(top_p, dtype=torch.float32),
        top_k_max=None if top_k is None else max(top_k), generators={} if generators is None else generators)
