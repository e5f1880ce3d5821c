"""patches/vllm-55600-v2-mamba-state-seed.patch: the V2 runner's running mamba-state column on a prefix-cache hit,
seeded in mamba blocks, through vLLM's own MambaHybridModelState.add_request in both trees."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from qwen_serving.engine.gdn_state_seed import running_state_column
from tests.helpers.engine_trees import load
from tests.helpers.kv_specs import ATTENTION_BLOCK, qwen38_kv_specs


def test_running_state_column_counts_mamba_blocks():
    config = SimpleNamespace(block_size=1088, mamba_block_size=2176)
    assert [running_state_column(n, config) for n in (0, 1, 2176, 2177, 4352, 4353)] == [-1, 0, 0, 1, 1, 2]
    assert running_state_column(4352, SimpleNamespace(block_size=1088, mamba_block_size=None)) == 3  # upstream's


def _smallest_group_block(with_drafter: bool) -> int:
    """cache_config.block_size as vLLM's engine core sets it (the smallest block of the KV groups it formed)."""
    utils = load("pristine", "v1/core/kv_cache_utils.py")
    groups = utils._get_kv_cache_groups_uniform_page_size(qwen38_kv_specs(with_drafter))
    return min(g.kv_cache_spec.block_size for g in groups)


def _seeded_column(tree: str, monkeypatch, block_size: int, mamba_block_size: int, computed: int) -> int:
    from vllm.config import CacheConfig

    states = load(tree, "v1/worker/gpu/model_states/mamba_hybrid.py")
    # the parent's bookkeeping (rope positions) is not what is tested
    monkeypatch.setattr(states.DefaultModelState, "add_request", lambda self, index, data: None)
    state = object.__new__(states.MambaHybridModelState)
    state.cache_config = CacheConfig(mamba_cache_mode="align")
    state.cache_config.block_size, state.cache_config.mamba_block_size = block_size, mamba_block_size
    state._align_mode = True
    state.num_accepted_tokens_gpu = torch.zeros(2, dtype=torch.int32)
    state._mamba_state_idx_gpu = torch.zeros(2, dtype=torch.int32)
    state.add_request(1, SimpleNamespace(num_computed_tokens=computed))
    assert state.num_accepted_tokens_gpu.tolist() == [0, 1]
    return int(state._mamba_state_idx_gpu[1])


def test_a_drafter_group_with_smaller_blocks_shifts_stocks_column(monkeypatch):
    smallest = _smallest_group_block(with_drafter=True)
    assert smallest == ATTENTION_BLOCK // 2 and _smallest_group_block(with_drafter=False) == ATTENTION_BLOCK
    computed = 2 * ATTENTION_BLOCK  # a hit on two cached blocks: the state after token 4,352 is in column 1
    assert _seeded_column("pristine", monkeypatch, smallest, ATTENTION_BLOCK, computed) == 3
    assert _seeded_column("patched", monkeypatch, smallest, ATTENTION_BLOCK, computed) == 1


@pytest.mark.parametrize("computed", [0, 1, 2176, 9000])
def test_equal_block_sizes_seed_as_upstream(monkeypatch, computed):
    stock = _seeded_column("pristine", monkeypatch, ATTENTION_BLOCK, ATTENTION_BLOCK, computed)
    assert _seeded_column("patched", monkeypatch, ATTENTION_BLOCK, ATTENTION_BLOCK, computed) == stock
