"""The memory model against vLLM 0.28.0's own classes, and against the spec's reference RTX 3090 figures.

The model follows vLLM 0.28.0 with this repo's patch series: k extra conv rows in every GDN state
when speculating (qwen3_5.py passes num_spec to the state shape, so the block is 448 tokens at k=7,
not 400), the hybrid-kv-groups patch's group size (8 for 16 attention + 48 GDN + 5 drafter
window layers) and the hybrid-kv-padded-window-pages patch's window block. Where a figure misses by
more than 2%, the test says why.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from qwen_serving import memory, model
from qwen_serving.memory import CacheShape, GiB
from tests.helpers.engine_trees import load
from tests.helpers.kv_specs import served_kv_specs

KV_MEM = 5_583_457_484  # the spec's pinned 5.2 GiB pool
DFLASH = CacheShape(spec="dflash2", spec_tokens=7)
MTP = CacheShape(spec="mtp", spec_tokens=4)


def within(value: float, target: float, rel: float) -> bool:
    return abs(value - target) <= rel * target


# ---- the model against vLLM's own code ----
@pytest.mark.parametrize("kv_dtype", ["auto", "fp8", "int8_per_token_head", "int4_per_token_head"])
def test_kv_bytes_per_token_match_vllm_specs(kv_dtype):
    from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend
    from vllm.v1.kv_cache_interface import FullAttentionSpec, get_kv_quant_mode

    dtype = {"auto": torch.bfloat16, "fp8": torch.float8_e4m3fn}.get(kv_dtype, torch.int8)
    spec = FullAttentionSpec(block_size=1, num_kv_heads=model.KV_HEADS, head_size=model.HEAD_DIM, dtype=dtype,
                             kv_quant_mode=get_kv_quant_mode(kv_dtype))
    spec = TritonAttentionBackend.customize_spec(spec)
    assert memory.kv_bytes_per_token_layer(kv_dtype) == spec.page_size_bytes


@pytest.mark.parametrize("k", [0, 4, 7, 15])
def test_gdn_state_matches_vllm_state_shape(k):
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator
    from vllm.v1.kv_cache_interface import MambaSpec

    shapes = MambaStateShapeCalculator.gated_delta_net_state_shape(
        1, model.GDN_K_HEADS, model.GDN_V_HEADS, model.GDN_HEAD_DIM, model.GDN_HEAD_DIM, model.CONV_KERNEL, k)
    spec = MambaSpec(block_size=1, shapes=shapes, dtypes=(torch.bfloat16, torch.float16))
    assert memory.gdn_state_bytes_per_layer("float16", k) == spec.page_size_bytes


def test_groups_match_the_vllm_under_test():
    """vLLM's own grouping of the 16/48/5 layers equals the model's: patched or pristine, whichever runs."""
    import inspect

    from vllm.v1.core import kv_cache_utils
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    patched = "choose_group_size" in inspect.getsource(kv_cache_utils._get_kv_cache_groups_uniform_page_size)
    shape = CacheShape(spec="dflash2", spec_tokens=7, kv_group_fix=patched)
    bs, page = shape.block_size, shape.page_bytes
    full = FullAttentionSpec(block_size=bs, num_kv_heads=model.KV_HEADS, head_size=model.HEAD_DIM, dtype=torch.bfloat16)
    assert full.page_size_bytes == page
    window = SlidingWindowSpec(block_size=bs, num_kv_heads=model.DRAFTER_KV_HEADS, head_size=model.DRAFTER_HEAD_DIM,
                               dtype=torch.bfloat16, sliding_window=model.DRAFTER_WINDOW)
    assert window.page_size_bytes == page  # the drafter's pages line up with the target's
    gdn = MambaSpec(block_size=bs, shapes=model.gdn_state_shapes(7), dtypes=(torch.bfloat16, torch.float16),
                    page_size_padded=page)
    layers = {**{f"a.{i}": full for i in range(model.ATTN_LAYERS)}, **{f"g.{i}": gdn for i in range(model.GDN_LAYERS)},
              **{f"w.{i}": window for i in range(model.DRAFTER_LAYERS)}}
    groups = kv_cache_utils._get_kv_cache_groups_uniform_page_size(layers)
    by_kind = {"attention": FullAttentionSpec, "gdn": MambaSpec, "window": SlidingWindowSpec}
    assert {k: sum(type(g.kv_cache_spec) is t for g in groups) for k, t in by_kind.items()} == shape.groups
    assert max(len(g.layer_names) for g in groups) == shape.group_size


KV_MEM_HUGE = 5_261_334_937  # knobs.KV_MEM_PINNED_HUGE: the spec's pinned CTX=huge pool


def vllm_config(max_model_len: int, prefix_cache: bool = True) -> SimpleNamespace:
    """What vLLM 0.28.0's grouping and capacity code reads of the config, as the single-user plan sets it."""
    return SimpleNamespace(
        model_config=SimpleNamespace(max_model_len=max_model_len),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1),
        cache_config=SimpleNamespace(mamba_cache_mode="align" if prefix_cache else "none",
                                     num_gpu_blocks_override=None),
        scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=False),
        max_in_flight_tokens=memory.PREFILL_CHUNK,  # --no-async-scheduling: one chunk in flight
        kv_transfer_config=None)


@pytest.mark.parametrize("prefix_cache", [True, False])
@pytest.mark.parametrize("spec_tokens", [7, 15])
@pytest.mark.parametrize("kv_dtype", ["auto", "int8_per_token_head", "int4_per_token_head"])
def test_dflash2_pool_is_vllms_own_computation(kv_dtype, spec_tokens, prefix_cache):
    """vLLM's own unification, grouping and capacity code on the served layers' specs (the tree under test) gives
    the model's window block, blocks, bytes a max-length request needs, pool tokens and longest context, at the
    CTX=fast, CTX=long and CTX=huge lengths and pins."""
    import inspect

    from vllm.v1.core import kv_cache_utils
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    shape = CacheShape(
        kv_dtype=kv_dtype, spec="dflash2", spec_tokens=spec_tokens, prefix_cache=prefix_cache,
        kv_group_fix="choose_group_size" in inspect.getsource(kv_cache_utils._get_kv_cache_groups_uniform_page_size),
        window_page_fix="padded_block_size" in inspect.getsource(kv_cache_utils.unify_kv_cache_spec_page_size))
    for max_len, kv_mem in ((65_536, KV_MEM), (131_072, KV_MEM), (245_760, KV_MEM_HUGE)):
        config = vllm_config(max_len, prefix_cache)
        groups = kv_cache_utils.get_kv_cache_groups(config, served_kv_specs(kv_dtype, spec_tokens, prefix_cache,
                                                                            max_len))
        window = [g.kv_cache_spec.block_size for g in groups if isinstance(g.kv_cache_spec, SlidingWindowSpec)]
        assert window == [shape.window_block_size]
        kv_config = kv_cache_utils.get_kv_cache_config_from_groups(config, groups, kv_mem)
        assert kv_config.num_blocks == shape.num_blocks(kv_mem)
        needed = kv_cache_utils._max_memory_usage_bytes_from_groups(config, groups)
        assert needed == shape.blocks_per_request(max_len) * shape.block_bytes
        assert shape.fits(kv_mem, max_len) == (needed <= kv_mem)
        assert kv_cache_utils.get_kv_cache_capacity(config, kv_config)[0] == shape.pool_tokens(kv_mem, max_len)
        longest = kv_cache_utils._estimate_max_model_len_from_groups(config, groups, kv_mem)
        # vLLM searches up to max_len; the model counts the window's whole admission cap, which a request holds
        # once it is longer than the window and a prefill chunk
        if model.DRAFTER_WINDOW + memory.PREFILL_CHUNK < longest < max_len:
            assert shape.longest_context(kv_mem) == longest // 1024 * 1024


def test_the_failed_dflash2_huge_boot_is_reproduced():
    """H200, 2026-12-03, SPEC=dflash2 CTX=huge died at boot: "8.02 GiB KV cache is needed ... the estimated maximum
    model length is 47488" for 245,760 tokens in the 4.90 GiB pin, after "attention block size to 1696 tokens",
    "Padding mamba page size by 0.75%" and "Add 3 padding layers, may waste at most 60.00%". The tree that ran
    grouped by the hybrid-kv-groups patch (the tree under test's grouping) after upstream's page unification (the
    pristine tree's): the drafter's 16-token window pages padded to the 1,790,976-byte shared page, 257 of them
    a request."""
    from vllm.utils.mem_utils import format_gib
    from vllm.v1.core import kv_cache_utils

    pristine = load("pristine", "v1/core/kv_cache_utils.py")
    specs = served_kv_specs("int4_per_token_head", 7)
    full, gdn = specs["model.layers.0.self_attn"], specs["model.layers.16.linear_attn"]
    state = memory.gdn_state_bytes_per_layer("float16", 7)
    assert full.block_size == 1696 and f"{100 * (gdn.page_size_bytes - state) / state:.2f}" == "0.75"
    groups = kv_cache_utils._get_kv_cache_groups_uniform_page_size(pristine.unify_kv_cache_spec_page_size(specs))
    assert [len(g.layer_names) for g in groups][-1] == 5 and max(len(g.layer_names) for g in groups) == 8
    config = vllm_config(245_760)
    needed = kv_cache_utils._max_memory_usage_bytes_from_groups(config, groups)
    assert (needed, format_gib(needed), format_gib(KV_MEM_HUGE)) == (8_611_012_608, "8.02", "4.9")
    assert kv_cache_utils._estimate_max_model_len_from_groups(config, groups, KV_MEM_HUGE) == 47_488
    visit = CacheShape(kv_dtype="int4_per_token_head", spec="dflash2", spec_tokens=7, prefix_cache=True,
                       window_page_fix=False)
    assert (visit.window_block_size, visit.window_blocks, visit.block_bytes) == (16, 257, 8 * 1_790_976)
    assert visit.blocks_per_request(245_760) * visit.block_bytes == needed
    assert not visit.fits(KV_MEM_HUGE, 245_760) and visit.fits(KV_MEM_HUGE, 47_488)
    assert not visit.fits(KV_MEM_HUGE, 47_489)
    # the fix: window pages of 848 tokens (half the attention block), 6 a request; 5,014,732,800 bytes at 245,760
    fixed = CacheShape(kv_dtype="int4_per_token_head", spec="dflash2", spec_tokens=7, prefix_cache=True)
    assert (fixed.window_block_size, fixed.window_blocks) == (848, 6)
    assert fixed.blocks_per_request(245_760) * fixed.block_bytes == 5_014_732_800
    assert fixed.pool_tokens(KV_MEM_HUGE, 245_760) == 257_696


def test_group_fix_stops_padding_the_context_layers():
    before = CacheShape(spec="dflash2", spec_tokens=7, kv_group_fix=False)
    after = CacheShape(spec="dflash2", spec_tokens=7)
    assert (before.group_size, before.groups) == (5, {"attention": 4, "gdn": 10, "window": 1})
    assert (after.group_size, after.groups) == (8, {"attention": 2, "gdn": 6, "window": 1})
    assert CacheShape(spec="mtp", spec_tokens=4).groups == {"attention": 1, "gdn": 3}  # 17 = 16 + the MTP layer


def test_block_size_follows_vllm_hybrid_alignment():
    # smallest multiple of 16 tokens whose bf16 page (4 KiB/token/layer) holds a GDN state
    assert CacheShape(spec="off").block_size == 400  # 1,634,304 B of state -> 25 x 16 tokens
    assert DFLASH.block_size == 448  # 7 more conv rows: 1,777,664 B -> 28 x 16
    assert CacheShape(spec="dflash2", spec_tokens=7, conv_spec_rows=False).block_size == 400
    assert CacheShape(kv_dtype="fp8").block_size == 800


# ---- the spec's reference RTX 3090 figures ----
def test_dflash2_pool_at_5_2_gib():
    """Spec: 69,758 tokens at KV_MEM 5.2 GiB, 64k max-model-len (CTX=fast, k=7)."""
    assert within(DFLASH.pool_tokens(KV_MEM, 65536), 69_758, 0.02)  # 70,548: +1.1%


def test_bytes_per_token_after_and_before_the_group_fix():
    """Spec: 78 KB of pool per token after the KV-group fix, 105 before; MTP ~75."""
    after = DFLASH.bytes_per_token(KV_MEM, 65536) / 1024
    assert within(after, 78, 0.02)  # 77.3
    assert within(MTP.bytes_per_token(KV_MEM, 65536) / 1024, 75, 0.02)  # 75.1
    # Before the fix: 92.9 KiB at 64k, not 105. Miss, explained: the spec's 105 was read from a pool
    # whose KV_MEM and length (40k) it does not state. What the model can check is the mechanism the
    # spec names: 16 attention layers padded to 20 cost 25% more per token of context.
    before = CacheShape(spec="dflash2", spec_tokens=7, kv_group_fix=False)
    assert before.context_bytes_per_token() / DFLASH.context_bytes_per_token() == pytest.approx(1.25)
    assert before.bytes_per_token(KV_MEM, 65536) / 1024 > after * 1.15


def test_state_page_per_resident():
    """Spec: 0.88 GiB per DFlash2 resident at k=7, 0.44 at MTP k=4, 1.66 at DFLASH_TOKENS=15.

    A resident holds (1+k) state pages in each GDN group (2+k with prefix caching, align mode) plus
    the drafter's window blocks. The spec's 0.88 and 1.66 match the prefix-caching figures within
    2% (0.889, 1.641); without prefix caching they are 0.807 and 1.553. MTP: 0.420 GiB (-4.5%): the
    spec gives 0.44 as half of the DFlash2 fit; the derivation has no window and 17-layer groups.
    """
    pc = CacheShape(spec="dflash2", spec_tokens=7, prefix_cache=True)
    assert within(pc.resident_bytes() / GiB, 0.88, 0.02)
    assert within(DFLASH.resident_bytes() / GiB, 0.88, 0.09)
    assert within(CacheShape(spec="dflash2", spec_tokens=15, prefix_cache=True).resident_bytes() / GiB, 1.66, 0.02)
    assert within(MTP.resident_bytes() / GiB, 0.44, 0.05)
    # "doubles the state page": (1+k) slots go from 8 to 16
    assert CacheShape(spec="dflash2", spec_tokens=15).state_blocks_per_group == 2 * DFLASH.state_blocks_per_group


def test_dflash2_residents_by_prompt_length():
    """Spec: seven / five / two DFlash2 residents at 128 / 4k / 16k-token prompts (5.2 GiB pool).

    Exact at steady decode with 256-token answers. (The spec also says "six resident, the seventh
    preempted" elsewhere; the model says seven.) DFLASH_TOKENS=15: spec "three residents with an
    empty context, two with 4k-token prompts", also exact.
    """
    assert [DFLASH.residents(KV_MEM, p) for p in (128, 4096, 16384)] == [7, 5, 2]
    d15 = CacheShape(spec="dflash2", spec_tokens=15)
    assert [d15.residents(KV_MEM, p, answer=0) for p in (0, 4096)] == [3, 2]


def test_mtp_residents_in_its_own_pool():
    """Spec: eight MTP requests fit, four of them at 16k, in MTP's pool (86,727 tokens at PC=0)."""
    kv_mem = round(86_727 / 65536 * MTP.blocks_per_request(65536)) * MTP.block_bytes
    assert within(MTP.pool_tokens(kv_mem, 65536), 86_727, 0.01)
    assert MTP.residents(kv_mem, 128) >= 8
    assert MTP.residents(kv_mem, 16384) == 4


def test_dflash_tokens_15_halves_the_seats_and_takes_8k_of_context():
    """Spec: 64k at DFLASH_TOKENS=7, 56k (57,344) at 15, both in 5.2 GiB with prefix caching."""
    assert CacheShape(spec="dflash2", spec_tokens=7, prefix_cache=True).fits(KV_MEM, 65536)
    d15 = CacheShape(spec="dflash2", spec_tokens=15, prefix_cache=True)
    assert not d15.fits(KV_MEM, 65536)
    assert d15.fits(KV_MEM, 57344) and d15.longest_context(KV_MEM) == 57344


def test_prefix_cache_costs_one_state_page_per_group():
    """Align mode keeps one more state page per GDN group: 2+k instead of 1+k."""
    pc = CacheShape(spec="dflash2", spec_tokens=7, prefix_cache=True)
    assert pc.resident_blocks() - DFLASH.resident_blocks() == pc.groups["gdn"] == 6
    # spec: DFlash2 pool 69,758 -> 68,605 with PREFIX_CACHE=1 (-1.65%); the model: -1.6%
    drop = 1 - pc.pool_tokens(KV_MEM, 65536) / DFLASH.pool_tokens(KV_MEM, 65536)
    assert within(drop, 1 - 68_605 / 69_758, 0.15)


# ---- KVarN (CTX=huge / KV=kvarn) ----


def test_kvarn_bytes_per_token_are_the_kernel_layouts():
    """memory.py (standard library) and engine/kernels/kvarn.py (the record the kernels write) agree."""
    from qwen_serving.engine.kernels.kvarn import KvarnLayout

    assert memory.kvarn_record_bytes() == KvarnLayout().record_bytes == 26_880
    assert memory.kv_bytes_per_token_layer("kvarn") == KvarnLayout().bytes_per_token(model.KV_HEADS) == 840
    assert memory.kv_bytes_per_token_layer("kvarn", kv_heads=2) == 420  # TP=2
    # a fifth of bf16's 4 KiB, 80% of vLLM's int4 per-token-head
    assert memory.kv_bytes_per_token_layer("auto") / 840 == pytest.approx(4.876, abs=1e-3)
    assert 840 / memory.kv_bytes_per_token_layer("int4_per_token_head") == pytest.approx(0.795, abs=1e-3)


def test_kvarn_blocks_are_whole_tiles():
    """A block must hold whole 128-token tiles: the GDN state sets how many (13.2 and 15.1 tiles' worth at k=3
    and k=7 -> 16 and 17 tiles)."""
    mtp = CacheShape(kv_dtype="kvarn", spec="mtp", spec_tokens=3)
    dflash = CacheShape(kv_dtype="kvarn", spec="dflash2", spec_tokens=7, prefix_cache=True)
    assert (mtp.block_size, dflash.block_size) == (2048, 2176)
    assert CacheShape(kv_dtype="fp8").block_alignment == 16
    for shape in (mtp, dflash):
        state = memory.gdn_state_bytes_per_layer("float16", shape.spec_tokens)
        assert shape.page_bytes >= state > shape.page_bytes - 128 * 840


def test_kvarn_staging_pool_sits_beside_kv_mem():
    """Two 16-bit tiles per request, the tiles of one prefill chunk and 8 spare (at least 8); a slot is a 128-token
    bf16 tile of K and V (512 KiB per layer) in the target's attention layers and the MTP layer. It does not
    shrink the paged pool: that is KV_MEM exactly."""
    assert memory.kvarn_staging_slots(2, 2048) == 28 and memory.kvarn_staging_slots(16, 8192) == 104
    slot = 128 * model.KV_HEADS * model.HEAD_DIM * 4
    mtp = CacheShape(kv_dtype="kvarn", spec="mtp", spec_tokens=3, max_num_seqs=2)
    assert mtp.staging_bytes() == 28 * slot * (model.ATTN_LAYERS + model.MTP_LAYERS) == 238 * memory.MiB
    dflash = CacheShape(kv_dtype="kvarn", spec="dflash2", spec_tokens=7, max_num_seqs=2)
    assert dflash.staging_bytes() == 28 * slot * model.ATTN_LAYERS  # the drafter's layers stay bf16
    assert CacheShape(kv_dtype="fp8").staging_bytes() == 0
    tp2 = CacheShape(kv_dtype="kvarn", spec="mtp", spec_tokens=3, max_num_seqs=2, tp=2)
    assert tp2.staging_bytes() * 2 == mtp.staging_bytes()
    assert mtp.num_blocks(KV_MEM_HUGE) == KV_MEM_HUGE // mtp.block_bytes


def test_kvarn_drafter_window_blocks_are_one_tile():
    """The drafter's bf16 window layers get 128-token blocks (a whole tile that divides 2176 = 17 x 128): 33 of
    them per request (the 2,048-token window plus a 2,048-token prefill chunk) instead of 3 at 2176."""
    dflash = CacheShape(kv_dtype="kvarn", spec="dflash2", spec_tokens=7, prefix_cache=True, max_num_seqs=2)
    assert (dflash.window_block_size, dflash.window_blocks) == (128, 33)
    assert DFLASH.window_block_size == DFLASH.block_size  # bf16 caches: the window shares the attention block


def test_kvarn_dflash2_pool_at_the_pinned_huge_budget():
    """Spec, SPEC=dflash2 CTX=huge PREFIX_CACHE=1 (two seats) on the pinned 4.90 GiB: 268,169 tokens of pool at
    245,760 max-model-len; above 7 drafts 245,760 does not boot, 221,184 does and 229,376 is 1% short.
    The model: 281,878 at k=7 (+5.1%: a miss the model does not explain; the block size, 2176, is the spec's
    own), and at k=15 the longest context is 225,280: between the spec's 221,184 and 229,376."""
    k7 = CacheShape(kv_dtype="kvarn", spec="dflash2", spec_tokens=7, prefix_cache=True, max_num_seqs=2)
    assert within(k7.pool_tokens(KV_MEM_HUGE, 245_760), 268_169, 0.06)
    assert k7.fits(KV_MEM_HUGE, 245_760) and k7.longest_context(KV_MEM_HUGE) >= 262_144
    k15 = CacheShape(kv_dtype="kvarn", spec="dflash2", spec_tokens=15, prefix_cache=True, max_num_seqs=2)
    assert k15.block_size == 2432 and not k15.fits(KV_MEM_HUGE, 245_760)
    assert 221_184 <= k15.longest_context(KV_MEM_HUGE) < 229_376


def test_weights_from_the_architecture():
    """Spec: lm_head and embed_tokens 2.5 GB each in bf16, MTP module 850 MB bf16, ~2.6 GB freed."""
    table = model.VOCAB * model.HIDDEN
    assert within(table * 2 / 1e9, 2.54, 0.01)
    assert within(memory.mtp_params() * 2 / 1e6, 850, 0.01)
    freed = 2 * (table * 2 - memory.int_bytes(table, 8))
    assert within(freed / 1e9, 2.6, 0.05)
    # download: int4 body + bf16 tables + bf16 MTP + vision ~ 19.5 GB
    download = memory.int_bytes(memory.body_params(), 4) + 2 * table * 2 + memory.mtp_params() * 2
    assert within((download + memory.VISION_TOWER_BYTES) / 1e9, 19.5, 0.02)


def test_auto_kv_mem_on_a_24_gib_card():
    """KV_MEM=auto on a headless 24 GiB card (~23.6 GiB free) lands near the spec's pinned 5.2 GiB."""
    pool = memory.auto_kv_mem(int(23.6 * GiB), memory.weights_bytes("dflash2"))
    assert 4.9 * GiB < pool < 5.6 * GiB
    assert pool % memory.MiB == 0
    assert memory.auto_kv_mem(int(12 * GiB), memory.weights_bytes("dflash2")) == 0


@pytest.mark.parametrize("env", [{"CTX": "huge", "KV_MEM": "5GiB"}, {"CTX": "huge", "SPEC": "dflash2", "PREFIX_CACHE": "1"}])
def test_plan_prints_the_huge_pool(tmp_path, env):
    """The plan of CTX=huge carries its pool: vLLM's int4 per-token-head cache, 1,056 B per token per layer."""
    from qwen_serving import knobs, plan

    drafter = tmp_path / knobs.DFLASH2_DRAFTER
    drafter.mkdir(parents=True)
    (drafter / "config.json").write_text("{}")
    p = plan.build("single", env, plan.Probe(repo=tmp_path))
    assert p.cache.kv_dtype == "int4_per_token_head" and p.cache.kv_bytes_per_token_layer == 1056
    derived = {d.name: d.value for d in p.derived}
    max_len, kv_mem = p.value("MAX_LEN"), p.kv_mem
    assert derived["pool"].startswith(f"{p.cache.pool_tokens(kv_mem, max_len):,} tokens at {max_len:,}")
    assert derived["longest context"] == f"{p.cache.longest_context(kv_mem):,} tokens"
    assert "KVarN staging pool" not in derived and p.cache.staging_bytes() == 0
    assert derived["block size"] == f"{p.cache.block_size} tokens" and p.cache.fits(kv_mem, max_len)
