"""Hybrid KV-group sizing (16 attention + 48 GDN layers + the DFlash2 drafter's 5 sliding-window
layers) before and after patches/hybrid-kv-groups-v2-cudagraph.patch, the V2 CUDA-graph reserve, and the
drafter's padded window pages before and after patches/hybrid-kv-padded-window-pages.patch."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from qwen_serving.engine.kv_groups import (
    choose_group_size,
    cudagraph_reserve_bytes,
    padded_block_size,
    upstream_group_size,
)
from tests.helpers.engine_trees import load
from tests.helpers.kv_specs import qwen38_kv_specs, served_kv_specs

KV_MEMORY = 5 << 30
MAX_MODEL_LEN = 65536


@pytest.mark.parametrize(
    ("buckets", "bounded", "size"),
    [
        ([16, 48, 5], [False, False, True], 8),  # Qwen3.8 + DFlash2 drafter: upstream says 5
        ([16, 48], [False, False], 16),  # Qwen3.8 alone (MTP): upstream's choice
        ([13, 12], [False, True], 13),  # gpt-oss-20b + eagle: upstream's choice
        ([10, 50], [False, True], 10),  # Gemma-3-like 5:1 sliding:full
        ([30, 10], [False, True], 10),  # a window bucket that divides evenly stays the group size
        ([6, 5], [False, True], 6),
    ],
)
def test_choose_group_size(buckets, bounded, size):
    assert choose_group_size(buckets, bounded) == size


def test_choose_group_size_rejects_mismatched_flags():
    with pytest.raises(ValueError, match="one window flag"):
        choose_group_size([16, 48], [False])


def _pool(tree: str, with_drafter: bool = True) -> dict:
    utils = load(tree, "v1/core/kv_cache_utils.py")
    config = SimpleNamespace(
        model_config=SimpleNamespace(max_model_len=MAX_MODEL_LEN),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1),
        cache_config=SimpleNamespace(mamba_cache_mode="align", num_gpu_blocks_override=None),
        max_in_flight_tokens=2048,
        kv_transfer_config=None,
    )
    groups = utils._get_kv_cache_groups_uniform_page_size(qwen38_kv_specs(with_drafter))
    group_size = max(len(g.layer_names) for g in groups)
    kv_config = utils.get_kv_cache_config_from_groups(config, groups, KV_MEMORY)
    tokens, _ = utils.get_kv_cache_capacity(config, kv_config)
    # pages one max-length request holds, with and without the padding slots of each group
    blocks = [-(-g.kv_cache_spec.max_memory_usage_bytes(config) // g.kv_cache_spec.page_size_bytes) for g in groups]
    padded = sum(group_size * b for b in blocks)
    real = sum(len(g.layer_names) * b for g, b in zip(groups, blocks, strict=True))
    by_type: dict[str, list[int]] = {}
    for g in groups:
        by_type.setdefault(type(g.kv_cache_spec).__name__, []).append(len(g.layer_names))
    return {"group_size": group_size, "by_type": by_type, "tokens": tokens,
            "kb_per_token": KV_MEMORY / tokens / 1024, "padding": padded / real - 1}


def test_drafter_windows_pad_the_attention_layers_upstream():
    pool = _pool("pristine")
    assert pool["group_size"] == 5
    assert pool["by_type"]["FullAttentionSpec"] == [4, 4, 4, 4]  # 16 layers in 20 slots: 25% more per token
    assert pool["by_type"]["MambaSpec"] == [5] * 8 + [4] * 2
    assert pool["by_type"]["SlidingWindowSpec"] == [5]


def test_drafter_windows_padded_instead():
    before, after, mtp = _pool("pristine"), _pool("patched"), _pool("patched", with_drafter=False)
    print(f"\n16 attn + 48 GDN + 5 SW, {KV_MEMORY >> 30} GiB pool, {MAX_MODEL_LEN} max len: "
          f"{before['kb_per_token']:.1f} -> {after['kb_per_token']:.1f} KB/token "
          f"({before['tokens']} -> {after['tokens']} tokens), padding {before['padding']:.1%} -> "
          f"{after['padding']:.1%}; no drafter {mtp['kb_per_token']:.1f} KB/token")
    assert after["group_size"] == 8
    assert after["by_type"] == {"FullAttentionSpec": [8, 8], "MambaSpec": [8] * 6, "SlidingWindowSpec": [5]}
    assert after["padding"] < before["padding"] / 2
    assert after["tokens"] > before["tokens"] * 1.15
    # the target alone is grouped exactly as upstream groups it
    assert mtp["by_type"] == _pool("pristine", with_drafter=False)["by_type"]


def test_upstream_rule_matches_pristine():
    utils = load("pristine", "v1/core/kv_cache_utils.py")
    specs = qwen38_kv_specs(with_drafter=True)
    groups = utils._get_kv_cache_groups_uniform_page_size(specs)
    assert max(len(g.layer_names) for g in groups) == upstream_group_size([16, 48, 5])


@pytest.mark.parametrize(
    ("page", "shared_page", "shared_blocks", "block"),
    [
        (16 * 1088, 1696 * 1056, [1696], 848),  # int4 k=7: 1,646 tokens fit, 848 is the largest divisor of 1696
        (16 * 2112, 864 * 2080, [864], 432),  # int8 k=7
        (16 * 1088, 1840 * 1056, [1840], 368),  # int4 k=15
        (16 * 2112, 944 * 2080, [944], 16),  # int8 k=15: 944 = 16 x 59 and 944 tokens do not fit
        (16 * 1088, 1696 * 1056, [1696, 848], 848),  # every shared block must be divisible
        (16 * 1088, 1696 * 1056, [], 16),  # no attention layer at the shared page: upstream's padding
    ],
)
def test_padded_block_size(page, shared_page, shared_blocks, block):
    assert padded_block_size(16, page, shared_page, shared_blocks) == block


@pytest.mark.parametrize("kv_dtype", ["int8_per_token_head", "int4_per_token_head"])
def test_padded_window_pages_hold_what_fits(kv_dtype):
    """Upstream pads each 16-token window page to the shared page; patched, the page holds the largest block that
    divides the attention block and fits. bf16 pages divide the shared one and are scaled alike in both trees."""
    specs = served_kv_specs(kv_dtype, 7)
    attention = specs["model.layers.0.self_attn"]
    trees = {tree: load(tree, "v1/core/kv_cache_utils.py").unify_kv_cache_spec_page_size(specs)
             for tree in ("pristine", "patched")}
    window = {tree: unified["draft.layers.0.self_attn"] for tree, unified in trees.items()}
    assert {tree: spec.page_size_bytes for tree, spec in window.items()} == dict.fromkeys(trees,
                                                                                        attention.page_size_bytes)
    assert window["pristine"].block_size == 16
    assert attention.block_size % window["patched"].block_size == 0
    assert window["patched"].block_size == {"int8_per_token_head": 432, "int4_per_token_head": 848}[kv_dtype]
    assert window["patched"].unpadded_page_size_bytes <= attention.page_size_bytes
    for tree in trees:
        assert trees[tree]["model.layers.16.linear_attn"] == specs["model.layers.16.linear_attn"]
    for scaled in ("auto", "fp8"):  # bf16 and fp8: the drafter's page divides the shared one
        served = served_kv_specs(scaled, 7)
        unified = {tree: load(tree, "v1/core/kv_cache_utils.py").unify_kv_cache_spec_page_size(served)
                   for tree in ("pristine", "patched")}
        assert unified["pristine"] == unified["patched"]
        window_block = unified["patched"]["draft.layers.0.self_attn"].block_size
        assert window_block == served["model.layers.0.self_attn"].block_size


@pytest.mark.parametrize(("raw", "mib"), [("0", 0), ("", 0), ("1200", 1200), (" 1.5 ", 1.5)])
def test_cudagraph_reserve(raw, mib):
    assert cudagraph_reserve_bytes(raw) == int(mib * (1 << 20))


@pytest.mark.parametrize("raw", ["-1", "lots", "nan"])
def test_cudagraph_reserve_rejects(raw):
    with pytest.raises(ValueError, match="VLLM_V2_CUDAGRAPH_MEM_MIB"):
        cudagraph_reserve_bytes(raw)


def test_v2_runner_reports_the_reserve(monkeypatch):
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    assert GPUModelRunner.profile_cudagraph_memory(None) == 0
    monkeypatch.setenv("VLLM_V2_CUDAGRAPH_MEM_MIB", "1200")
    assert GPUModelRunner.profile_cudagraph_memory(None) == 1200 << 20
