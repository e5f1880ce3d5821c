"""qwen_serving/model.py, the 27B's facts written once, against what they must agree with: the public
export's config.json, the synthetic checkpoints written from model.py, vLLM 0.28.0's own state-shape and
dtype tables, the spec, and the memory model's and synth's outputs from before the facts moved here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qwen_serving import memory, model
from qwen_serving.checkpoint import synth
from qwen_serving.checkpoint.synth_tokenizer import special_token_ids
from tests.helpers import model_figures

FIXTURE = Path(__file__).with_name("fixtures") / "model-figures.json"

# text_config of dbirks/Qwen3.8-27B-W4A16-AutoRound (docs/synthetic.md, "config.json"), and model.py's
# figure for each name
EXPORT_TEXT_CONFIG = {
    "hidden_size": (5120, model.HIDDEN),
    "intermediate_size": (17408, model.INTERMEDIATE),
    "vocab_size": (248_320, model.VOCAB),
    "max_position_embeddings": (262_144, model.MAX_POSITIONS),
    "dtype": ("bfloat16", model.DTYPE),
    "mamba_ssm_dtype": ("float32", model.CHECKPOINT_SSM_DTYPE),
    "num_attention_heads": (24, model.Q_HEADS),
    "num_key_value_heads": (4, model.KV_HEADS),
    "head_dim": (256, model.HEAD_DIM),
    "linear_num_key_heads": (16, model.GDN_K_HEADS),
    "linear_num_value_heads": (48, model.GDN_V_HEADS),
    "linear_key_head_dim": (128, model.GDN_HEAD_DIM),
    "linear_value_head_dim": (128, model.GDN_HEAD_DIM),
    "linear_conv_kernel_dim": (4, model.CONV_KERNEL),
    "num_hidden_layers": (64, model.LAYERS),
    "full_attention_interval": (4, model.FULL_ATTENTION_INTERVAL),
    "mtp_num_hidden_layers": (1, model.MTP_LAYERS),
}


@pytest.mark.parametrize("name", EXPORT_TEXT_CONFIG)
def test_model_has_the_exports_figures(name):
    export, ours = EXPORT_TEXT_CONFIG[name]
    assert ours == export


def test_layer_pattern():
    """Spec: 48 of the 64 layers are Gated DeltaNet, 16 full attention; the MTP module adds one attention layer."""
    kinds = model.layer_types()
    assert (model.GDN_LAYERS, model.ATTN_LAYERS) == (48, 16)
    assert [i for i, kind in enumerate(kinds) if kind == "full_attention"] == list(range(3, 64, 4))
    assert set(kinds) == {"full_attention", "linear_attention"}
    assert model.layer_types(8) == kinds[:8]  # the `shape` checkpoint's fewer layers keep the pattern
    assert memory.CacheShape(spec="mtp", spec_tokens=4).buckets == {"attention": 17, "gdn": 48}
    # the drafter's pages line up with the target's only if a token's K and V take the same bytes
    assert model.DRAFTER_KV_HEADS * model.DRAFTER_HEAD_DIM == model.KV_HEADS * model.HEAD_DIM


@pytest.mark.parametrize("spec_tokens", [0, 4, 7, 15])
def test_gdn_state_shapes_are_vllms(spec_tokens):
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator, is_conv_state_dim_first

    conv, ssm = MambaStateShapeCalculator.gated_delta_net_state_shape(
        1, model.GDN_K_HEADS, model.GDN_V_HEADS, model.GDN_HEAD_DIM, model.GDN_HEAD_DIM, model.CONV_KERNEL, spec_tokens)
    ours_conv, ours_ssm = model.gdn_state_shapes(spec_tokens)
    assert conv == (ours_conv[::-1] if is_conv_state_dim_first() else ours_conv)
    assert ssm == ours_ssm
    assert model.CONV_DIM == 10_240  # q and k (16 heads of 128 each) and v (48 heads of 128)


def test_gdn_state_size_is_the_specs():
    """Spec: the config's fp32 state is ~150 MB per request, allocated up front; float16 halves it."""
    fp32 = memory.gdn_state_bytes(model.CHECKPOINT_SSM_DTYPE)
    assert abs(fp32 / 1e6 - 150) < 0.05 * 150
    assert abs(memory.gdn_state_bytes("float16") / fp32 - 0.5) < 0.01


def test_dtype_bytes_are_vllms():
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE

    assert {name: STR_DTYPE_TO_TORCH_DTYPE[name].itemsize for name in model.DTYPE_BYTES} == model.DTYPE_BYTES


@pytest.mark.parametrize(("size", "layers"), [("full", synth.FULL_LAYERS), ("shape", 8)])
def test_synthetic_real_size_configs_are_model_py(size, layers):
    config = synth.model_config(synth.SIZES[size], layers, special_token_ids())
    text = config["text_config"]
    want = {name: ours for name, (_, ours) in EXPORT_TEXT_CONFIG.items()} | {"num_hidden_layers": layers}
    assert {name: text[name] for name in want} == want
    assert text["layer_types"] == model.layer_types(layers)
    assert config["dtype"] == model.DTYPE
    assert config["vision_config"] == model.VISION_CONFIG
    assert config["vision_config"]["out_hidden_size"] == model.HIDDEN  # the tower feeds the text model


def test_tiny_keeps_the_head_geometry_the_kernels_see():
    tiny = synth.TINY
    assert (tiny.head_dim, tiny.linear_head_dim, tiny.conv_kernel) == (model.HEAD_DIM, model.GDN_HEAD_DIM, model.CONV_KERNEL)
    assert tiny.linear_value_heads // tiny.linear_key_heads == model.GDN_V_HEADS // model.GDN_K_HEADS


def test_memory_and_synth_figures_unchanged_by_the_move():
    """Every figure tests/helpers/model_figures.py renders, against its rendering before model.py existed. Where the
    drafter's window pages are padded (DFlash2 with an int8 or int4 per-token-head cache, whose window block the
    fixture took as the attention block), only the figures that count window blocks moved."""
    recorded = json.loads(FIXTURE.read_text())
    now = json.loads(json.dumps(model_figures.figures(), sort_keys=True))
    assert now["synth"] == recorded["synth"]
    window_counted = {"resident_blocks", "blocks_per_request", "pool_tokens", "longest_context", "residents"}
    moved = 0
    for before, after in zip(recorded["memory"].pop("cache_shapes"), now["memory"].pop("cache_shapes"), strict=True):
        shape = before["shape"]
        if shape.get("spec") == "dflash2" and shape["kv_dtype"].endswith("per_token_head"):
            moved += after != before
            before, after = ({k: v for k, v in fig.items() if k not in window_counted} for fig in (before, after))
        assert after == before, shape
    assert moved
    assert now["memory"] == recorded["memory"]


def test_the_towers_dimensions_give_the_specs_weight_figure():
    """The spec's 0.858 GiB of BF16 tower weights, which memory.py counts with VISION=1, from the dimensions."""
    assert model.vision_tower_bytes() == 921_460_192
    assert abs(model.vision_tower_bytes() / memory.VISION_TOWER_BYTES - 1) < 5e-4
    assert model.vision_tower_bytes(synth.TINY.vision) < 2e6  # the CI checkpoint's tower stays small
