"""qwen_serving.engine.gdn_spec_rows.spec_rows (gdn-spec-rows-no-sync.patch): the rows a host boolean mask picks,
as vLLM's mask indexing gives them, without indexing on the prefix path; and the patched GDN builder calls it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from qwen_serving.engine.gdn_spec_rows import spec_rows
from tests.helpers.aten_ops import RecordOps

MASKS = {
    "all speculating": [True] * 4,
    "padded at the back": [True, True, True, False, False],
    "one request, padded": [True] + [False] * 7,
    "none": [False, False],
    "scattered": [True, False, True, False],
    "speculating behind": [False, True, True],
}


@pytest.mark.parametrize("name", MASKS)
@pytest.mark.parametrize("shape", [(8, 5), (8,)])
def test_the_rows_are_the_mask_indexings(name, shape):
    mask = torch.tensor(MASKS[name])
    gen = torch.Generator().manual_seed(len(name))
    tensor = torch.randint(0, 1000, (len(mask), *shape[1:]), generator=gen, dtype=torch.int32)
    source = tensor[:, :3] if tensor.dim() == 2 else tensor  # the builder passes a column slice, a view
    rows = spec_rows(source, mask, int(mask.sum()))
    assert torch.equal(rows, source[mask]) and rows.dtype == source.dtype and rows.is_contiguous()
    if rows.numel():
        rows.view(-1)[0] += 1  # a new tensor, as mask indexing gives: the block table is never written
        assert not torch.equal(rows, source[mask])


@pytest.mark.parametrize("name", MASKS)
def test_no_indexing_where_the_speculating_rows_come_first(name):
    mask = torch.tensor(MASKS[name])
    tensor = torch.arange(len(mask) * 3).reshape(len(mask), 3)
    with RecordOps() as recorded:
        spec_rows(tensor, mask, int(mask.sum()))
    first = int(mask.sum())
    prefix = bool(mask[:first].all())
    indexed = any(op.startswith("index") for op in recorded.ops)
    assert indexed is not prefix, recorded.ops  # the prefix path slices; the rest is vLLM's mask indexing


def test_a_mask_not_on_the_host_or_not_boolean_is_refused():
    with pytest.raises(TypeError, match="boolean mask on the host"):
        spec_rows(torch.zeros(3), torch.tensor([1, 0, 0]), 1)
    with pytest.raises(TypeError, match="boolean mask on the host"):
        spec_rows(torch.zeros(3, device="meta"), torch.tensor([True, False, False], device="meta"), 1)


def test_the_patched_builder_selects_through_it():
    patched = Path(os.environ["QS_PATCHED_VLLM"]) / "v1" / "attention" / "backends" / "gdn_attn.py"
    pristine = Path(os.environ["QS_PRISTINE_VLLM"]) / "v1" / "attention" / "backends" / "gdn_attn.py"
    text, before = patched.read_text(), pristine.read_text()
    assert before.count("spec_sequence_masks_cpu, : self.num_spec + 1") == 2
    assert text.count("spec_sequence_masks_cpu, : self.num_spec + 1") == 1  # the mixed batch's stays vLLM's
    assert "num_accepted_tokens[spec_sequence_masks_cpu]" in before
    assert "num_accepted_tokens[spec_sequence_masks_cpu]" not in text
    assert text.count("spec_rows(") == 2
