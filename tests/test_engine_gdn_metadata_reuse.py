"""qwen_serving.engine.gdn_metadata_reuse (gdn-metadata-reuse.patch): another GDN KV-cache group's metadata from
the step's first GDN build equals that group's own build(), field for field, with the CUDA-graph fields in its own
builder's persistent buffers.

Real GDNAttentionMetadataBuilder instances of the patched tree, one per group as the runner makes them, on CPU; the
two groups' block tables hold disjoint block ids, so a state index left as group 1's shows.
"""

from __future__ import annotations

import dataclasses
import os
from copy import copy
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from qwen_serving.engine import gdn_metadata_reuse
from tests.helpers.gdn_builder import builder_config

BLOCK = 4  # tokens per block in align mode: a few blocks per request at these lengths
MAX_LEN = 64
MAX_NUM_SEQS = 8
BT_FIELDS = {"spec_state_indices_tensor", "non_spec_state_indices_tensor", "prefill_state_indices"}


def make_config(num_spec: int, full_graphs: bool, mode: str, ubatching: bool = False) -> SimpleNamespace:
    return builder_config(num_spec, full_graphs, mode, MAX_NUM_SEQS, ubatching)


def make_builder(config: SimpleNamespace, num_spec: int, mode: str):
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder
    from vllm.v1.kv_cache_interface import MambaSpec

    spec = MambaSpec(block_size=BLOCK if mode == "align" else MAX_LEN, shapes=((2, 3), (2, 4)),
                     dtypes=(torch.float32, torch.float32), mamba_cache_mode=mode, num_speculative_blocks=num_spec)
    return GDNAttentionMetadataBuilder(spec, ["layer"], config, torch.device("cpu"))


@dataclasses.dataclass
class Batch:
    """One step's batch; rows at the back with query length 0 are CUDA-graph padding."""

    query_lens: list[int]
    seq_lens: list[int]
    drafts: list[int] | None = None  # num_decode_draft_tokens per row (-1: not speculating)
    accepted: list[int] | None = None  # num_accepted_tokens per row


def block_table(batch: Batch, num_spec: int, mode: str, first_id: int) -> torch.Tensor:
    """Distinct block ids per row and group (from ``first_id``), NULL (0) on padding rows, as the runner has it."""
    width = (MAX_LEN // BLOCK + num_spec) if mode == "align" else 1 + num_spec
    table = torch.arange(first_id, first_id + len(batch.query_lens) * width, dtype=torch.int32).view(-1, width)
    table[[q == 0 for q in batch.query_lens]] = 0
    return table


def common(batch: Batch, table: torch.Tensor):
    from vllm.v1.attention.backend import CommonAttentionMetadata

    qsl = torch.zeros(len(batch.query_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(batch.query_lens), 0)
    num_tokens = int(qsl[-1])
    return CommonAttentionMetadata(
        query_start_loc=qsl.clone(), query_start_loc_cpu=qsl, seq_lens=torch.tensor(batch.seq_lens, dtype=torch.int32),
        num_reqs=len(batch.query_lens), num_actual_tokens=num_tokens, max_query_len=max(batch.query_lens),
        max_seq_len=max(batch.seq_lens), block_table_tensor=table, slot_mapping=torch.arange(num_tokens))


def spec_args(batch: Batch) -> dict:
    if batch.drafts is None:
        return {}
    return {"num_accepted_tokens": torch.tensor(batch.accepted, dtype=torch.int32),
            "num_decode_draft_tokens_cpu": torch.tensor(batch.drafts, dtype=torch.int32)}


def spec_batch(k: int, accepted: list[int], drafts: list[int] | None = None, pad: int = 0) -> Batch:
    drafts = drafts or [k] * len(accepted)
    seq = [13 + 7 * i + d + 1 for i, d in enumerate(drafts)]
    return Batch([d + 1 for d in drafts] + [0] * pad, seq + [0] * pad, drafts + [-1] * pad, accepted + [1] * pad)


CASES = {
    # name: (num_spec, batch)
    "plain decode": (0, Batch([1, 1, 1], [5, 17, 30])),
    "plain decode, padded": (0, Batch([1, 1, 1, 0, 0], [5, 17, 30, 0, 0])),
    "decode without drafts on a speculative engine": (4, Batch([1, 1], [9, 22], [-1, -1], [1, 1])),
    "spec k=1": (1, spec_batch(1, [2, 1, 2])),
    "spec k=4, rows accepting fewer": (4, spec_batch(4, [5, 1, 3, 2])),
    "spec k=4, one row with fewer drafts": (4, spec_batch(4, [5, 2, 1], drafts=[4, 2, 4])),
    "spec k=4, CUDA-graph padded": (4, spec_batch(4, [3, 5], pad=3)),
    "spec k=1, CUDA-graph padded": (1, spec_batch(1, [1, 2, 2], pad=2)),
    "mixed prefill + decode": (0, Batch([1, 1, 6, 9], [8, 21, 6, 30])),
    "prefill only": (0, Batch([7, 12], [7, 25])),
    "mixed prefill + spec decode": (4, Batch([5, 5, 1, 8], [20, 31, 12, 8], [4, 4, -1, -1], [2, 5, 1, 1])),
}


def snapshot(metadata) -> dict:
    """Every field's value, tensors copied (a later write into a shared buffer must not change the expectation)."""
    def value(v):
        if isinstance(v, torch.Tensor):
            return v.clone()
        if isinstance(v, dict):
            return {key: value(inner) for key, inner in v.items()}
        return v
    return {f.name: value(getattr(metadata, f.name)) for f in dataclasses.fields(metadata)}


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a, b))
    if isinstance(a, dict) or isinstance(b, dict):
        return isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys() and all(
            same(a[key], b[key]) for key in a)
    return type(a) is type(b) and a == b


def differing(expected: dict, metadata) -> set[str]:
    return {name for name, value in expected.items() if not same(value, getattr(metadata, name))}


def buffers(builder) -> dict[str, torch.Tensor]:
    return {name: value for name, value in vars(builder).items() if isinstance(value, torch.Tensor)}


def storage(t: torch.Tensor | None) -> int | None:
    return t.untyped_storage().data_ptr() if isinstance(t, torch.Tensor) else None


def buffer_fields(metadata, builder) -> dict[str, tuple[int, tuple, tuple]]:
    """The tensor fields that are views of one of ``builder``'s persistent buffers: (address, shape, stride)."""
    owned = {storage(b) for b in buffers(builder).values()}
    return {f.name: (v.data_ptr(), tuple(v.shape), v.stride()) for f in dataclasses.fields(metadata)
            if isinstance(v := getattr(metadata, f.name), torch.Tensor) and storage(v) in owned}


def run_case(num_spec: int, batch: Batch, full_graphs: bool, mode: str):
    """Group 2's build() as it was returned, its buffer fields, the reuse's result, group 1's build (as returned
    and the object), both builders."""
    config = make_config(num_spec, full_graphs, mode)
    first, second = make_builder(config, num_spec, mode), make_builder(config, num_spec, mode)
    base = common(batch, block_table(batch, num_spec, mode, first_id=1))
    cm1, cm2 = copy(base), copy(base)  # the runner's per-group shallow copies
    cm2.block_table_tensor = block_table(batch, num_spec, mode, first_id=1000)

    own = second.build(0, cm2, **spec_args(batch))
    expected, expected_buffers = snapshot(own), buffer_fields(own, second)
    for buffer in buffers(second).values():  # a field the reuse forgot to write would keep this
        buffer.fill_(-7 if buffer.dtype != torch.bool else True)
    cached = first.build(0, cm1, **spec_args(batch))
    group1 = snapshot(cached)
    reused = second.update_block_table(cached, cm2.block_table_tensor, cm2.slot_mapping)
    return SimpleNamespace(expected=expected, expected_buffers=expected_buffers, reused=reused, group1=group1,
                           cached=cached, first=first, second=second)


@pytest.mark.parametrize("mode", ["none", "align"])
@pytest.mark.parametrize("full_graphs", [True, False], ids=["full-graphs", "piecewise"])
@pytest.mark.parametrize("case", CASES)
def test_the_reuse_is_group_2s_own_build(case, full_graphs, mode):
    num_spec, batch = CASES[case]
    run = run_case(num_spec, batch, full_graphs, mode)
    assert differing(run.expected, run.reused) == set()
    # the persistent-buffer fields are views of group 2's buffers, where its build() put them
    assert buffer_fields(run.reused, run.second) == run.expected_buffers
    assert buffer_fields(run.reused, run.first) == {}
    assert bool(run.expected_buffers) is (full_graphs and "pre" not in case)  # the graph paths ran where due
    # group 1's own metadata is untouched by the reuse
    assert differing(run.group1, run.cached) == set()


@pytest.mark.parametrize("mode", ["none", "align"])
@pytest.mark.parametrize("case", CASES)
def test_group_1s_metadata_differs_from_group_2s_in_the_state_indices_only(case, mode):
    """What the reuse must redo: handing group 2 group 1's build as it is would be wrong exactly here."""
    num_spec, batch = CASES[case]
    run = run_case(num_spec, batch, True, mode)
    present = {name for name in BT_FIELDS if run.expected[name] is not None}
    assert present, "every batch has state indices"
    assert differing(run.expected, run.cached) == present


def test_full_graph_fields_are_written_into_group_2s_buffers():
    """With FULL CUDA graphs a speculative decode step returns 6 buffer views, a plain decode step 2."""
    buffered = run_case(*CASES["spec k=4, CUDA-graph padded"], True, "align").expected_buffers
    assert set(buffered) == {"spec_state_indices_tensor", "spec_sequence_masks", "spec_token_indx",
                             "non_spec_token_indx", "spec_query_start_loc", "num_accepted_tokens"}
    buffered = run_case(*CASES["plain decode, padded"], True, "align").expected_buffers
    assert set(buffered) == {"non_spec_state_indices_tensor", "non_spec_query_start_loc"}


def test_a_reuse_that_kept_group_1s_state_indices_is_caught():
    num_spec, batch = CASES["spec k=4, rows accepting fewer"]
    run = run_case(num_spec, batch, True, "align")
    stale = dataclasses.replace(run.reused, spec_state_indices_tensor=run.group1["spec_state_indices_tensor"])
    assert differing(run.expected, stale) == {"spec_state_indices_tensor"}


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


# aten ops of the group's build() and of the reuse, counted on CPU: 85 and 32 for the k=4 speculative step (its
# host counts, mask copy, token indices and buffer fills are gone; the gather, the row copy and 5 buffer copies
# stay), 20 and 16 for a plain decode step, whose build() is cheap already
@pytest.mark.parametrize(("case", "built_ops", "reused_ops"),
                         [("spec k=4, CUDA-graph padded", 85, 32), ("plain decode, padded", 20, 16)])
def test_the_reuse_dispatches_fewer_ops_than_a_build(case, built_ops, reused_ops):
    num_spec, batch = CASES[case]
    config = make_config(num_spec, True, "align")
    first, second = make_builder(config, num_spec, "align"), make_builder(config, num_spec, "align")
    cm = common(batch, block_table(batch, num_spec, "align", first_id=1))
    cm2 = copy(cm)
    cm2.block_table_tensor = block_table(batch, num_spec, "align", first_id=1000)
    cached = first.build(0, copy(cm), **spec_args(batch))
    with CountOps() as built:
        second.build(0, copy(cm2), **spec_args(batch))
    with CountOps() as reused:
        second.update_block_table(cached, cm2.block_table_tensor, cm2.slot_mapping)
    assert (built.count, reused.count) == (built_ops, reused_ops)


def test_metadata_without_a_build_record_is_refused():
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata

    builder = make_builder(make_config(4, True, "align"), 4, "align")
    with pytest.raises(ValueError, match="build record"):
        builder.update_block_table(GDNAttentionMetadata(0, 0, 1, 1, 0, 0, 1), torch.zeros(1, 17), torch.zeros(1))


def test_a_block_table_of_another_batch_is_refused():
    num_spec, batch = CASES["spec k=1"]
    config = make_config(num_spec, True, "none")
    builder = make_builder(config, num_spec, "none")
    cached = builder.build(0, common(batch, block_table(batch, num_spec, "none", 1)), **spec_args(batch))
    with pytest.raises(ValueError, match="block table of 2 rows for a batch of 3"):
        builder.update_block_table(cached, torch.zeros(2, 2, dtype=torch.int32), torch.zeros(1))


def test_the_runner_reuses_gdn_builds_except_under_micro_batching():
    assert make_builder(make_config(4, True, "align"), 4, "align").supports_update_block_table is True
    assert make_builder(make_config(0, False, "none"), 0, "none").supports_update_block_table is True
    micro = make_builder(make_config(0, True, "align", ubatching=True), 0, "align")
    assert micro.supports_update_block_table is False
    assert gdn_metadata_reuse.reuse_supported(make_config(0, True, "align", ubatching=True)) is False


def test_the_patched_builder_routes_through_the_hook():
    patched = Path(os.environ["QS_PATCHED_VLLM"]) / "v1" / "attention" / "backends" / "gdn_attn.py"
    pristine = Path(os.environ["QS_PRISTINE_VLLM"]) / "v1" / "attention" / "backends" / "gdn_attn.py"
    text, before = patched.read_text(), pristine.read_text()
    assert "update_block_table" not in before
    assert text.count("gdn_metadata_reuse import") == 3
    assert "remember_build(attn_metadata, m, spec_sequence_masks_cpu)" in text
