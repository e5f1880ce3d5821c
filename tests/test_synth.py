"""The synthetic checkpoint generator: format, int4 contents, vLLM acceptance, tokenizer, chat template."""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from qwen_serving import model
from qwen_serving.checkpoint import synth
from qwen_serving.checkpoint.int4 import dequantize_int4_groups, negative_scale_share, unpack_int4
from qwen_serving.checkpoint.synth_tokenizer import ADDED_TOKENS, special_token_ids, tokenizer_size

REPO = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")


def _generate(out: Path, seed: int, *extra: str) -> Path:
    assert synth.main(["--size", "tiny", "--out", str(out), "--seed", str(seed), *extra]) == 0
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return _generate(tmp_path_factory.mktemp("synth") / "tiny", seed=0)


@pytest.fixture(scope="module")
def tensors(tiny) -> dict[str, torch.Tensor]:
    return dict(synth.iter_checkpoint(tiny))


@pytest.fixture(scope="module")
def config(tiny) -> dict:
    return json.loads((tiny / "config.json").read_text())


@pytest.fixture(scope="module")
def tiny_plan() -> list:
    return synth.checkpoint_plan(synth.TINY, 4)


def _digests(path: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


# ---------------------------------------------------------------- files and index


def test_tiny_is_small_sharded_and_complete(tiny):
    names = sorted(p.name for p in tiny.iterdir())
    shards = [n for n in names if n.endswith(".safetensors")]
    assert len(shards) >= 2
    assert all(re.fullmatch(rf"model-\d{{5}}-of-{len(shards):05d}\.safetensors", n) for n in shards)
    for required in (
        "config.json",
        "generation_config.json",
        "model.safetensors.index.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ):
        assert required in names
    assert sum((tiny / n).stat().st_size for n in shards) < 16e6
    assert not [p for p in tiny.parent.iterdir() if p.name.startswith(".")], "a temp dir was left behind"


def test_index_covers_every_tensor_exactly(tiny, tensors, tiny_plan):
    from safetensors import safe_open

    index = json.loads((tiny / "model.safetensors.index.json").read_text())
    weight_map = index["weight_map"]
    planned = {name for entry in tiny_plan for name, _, _ in entry.tensors()}
    assert set(weight_map) == set(tensors) == planned
    for shard in set(weight_map.values()):
        with safe_open(str(tiny / shard), framework="pt") as f:
            assert {n for n, s in weight_map.items() if s == shard} == set(f.keys())
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())


def test_tensors_have_the_planned_shapes_and_dtypes(tensors, tiny_plan):
    for entry in tiny_plan:
        for name, shape, dtype in entry.tensors():
            assert tuple(tensors[name].shape) == shape, name
            assert tensors[name].dtype == dtype, name
    assert tensors["model.language_model.embed_tokens.weight"].dtype == torch.bfloat16
    assert tensors["lm_head.weight"].dtype == torch.bfloat16
    mtp = [n for n in tensors if n.startswith("mtp.")]
    assert mtp and all(tensors[n].dtype == torch.bfloat16 for n in mtp)
    assert any(n.startswith(synth.VISUAL) for n in tensors)  # the tower too (test_the_tower_is_written_...)


# ---------------------------------------------------------------- int4 contents


def _int4_linears(plan) -> list[synth.Int4Linear]:
    return [e for e in plan if isinstance(e, synth.Int4Linear)]


def test_int4_unpack_reproduces_the_source_weights_exactly(tensors, tiny_plan):
    linears = _int4_linears(tiny_plan)
    assert len(linears) == 3 * 6 + 7  # per GDN layer: qkv, z, out + MLP; attention layer: q, k, v, o + MLP
    for linear in linears:
        packed = tensors[f"{linear.module}.weight_packed"]
        scales = tensors[f"{linear.module}.weight_scale"]
        assert tensors[f"{linear.module}.weight_shape"].tolist() == [linear.out_features, linear.in_features]
        stored = dequantize_int4_groups(unpack_int4(packed, linear.in_features), scales)
        codes, positive_scales, _ = synth.intended_int4(0, linear, CPU)
        assert torch.equal(stored, dequantize_int4_groups(codes, positive_scales)), linear.module


def test_compressed_tensors_reads_the_same_weights(tensors, tiny_plan):
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    scheme = QuantizationScheme(
        targets=["Linear"],
        weights=QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=128),
    )
    for linear in _int4_linears(tiny_plan)[:3]:
        state = {k: tensors[f"{linear.module}.{k}"] for k in ("weight_packed", "weight_scale", "weight_shape")}
        library = PackedQuantizationCompressor.decompress(state, scheme)["weight"]
        codes, positive_scales, _ = synth.intended_int4(0, linear, CPU)
        assert torch.equal(library, dequantize_int4_groups(codes, positive_scales).half()), linear.module


def test_about_half_the_group_scales_are_negative(tensors, tiny_plan):
    all_scales = []
    for linear in _int4_linears(tiny_plan):
        scales = tensors[f"{linear.module}.weight_scale"]
        assert 0.4 <= negative_scale_share(scales) <= 0.6, linear.module
        codes = unpack_int4(tensors[f"{linear.module}.weight_packed"], linear.in_features)
        per_group = codes.view(linear.out_features, -1, 128)
        negative = (scales < 0).unsqueeze(-1).expand_as(per_group)
        for sign in (negative, ~negative):  # both kinds of group use the full code range, -8 too
            assert (int(per_group[sign].min()), int(per_group[sign].max())) == (-8, 7), linear.module
        all_scales.append(scales.flatten())
    assert 0.45 <= negative_scale_share(torch.cat(all_scales)) <= 0.55


def test_weights_have_no_common_offset(tensors, tiny_plan):
    # Uniform codes on [-8, 7] average -0.5: under positive scales only, every row would share a -scale/2
    # offset, a rank-one part that a deep residual stack amplifies (docs/scripted-model.md, the full-size run)
    for linear in _int4_linears(tiny_plan):
        weight = dequantize_int4_groups(
            unpack_int4(tensors[f"{linear.module}.weight_packed"], linear.in_features),
            tensors[f"{linear.module}.weight_scale"],
        )
        offset = float(weight.mean()) / float(weight.std())  # -0.055 with that offset, below 0.015 without
        assert abs(offset) < 0.025, linear.module


def test_weight_magnitudes_are_sane(tensors, tiny_plan):
    for linear in _int4_linears(tiny_plan):
        weight = dequantize_int4_groups(
            unpack_int4(tensors[f"{linear.module}.weight_packed"], linear.in_features),
            tensors[f"{linear.module}.weight_scale"],
        )
        assert float(weight.std()) * math.sqrt(linear.in_features) == pytest.approx(1.0, rel=0.25), linear.module
    lm = "model.language_model.layers."
    assert abs(float(tensors[f"{lm}0.input_layernorm.weight"].float().mean())) < 0.02  # (1 + w) norms
    assert float(tensors[f"{lm}0.linear_attn.norm.weight"].float().mean()) == pytest.approx(1.0, abs=0.02)
    a_log = tensors[f"{lm}0.linear_attn.A_log"]
    assert a_log.dtype == torch.float32 and bool(((a_log >= 0) & (a_log <= math.log(16))).all())
    dt = torch.nn.functional.softplus(tensors[f"{lm}0.linear_attn.dt_bias"].float())
    assert bool(((dt > 0.9e-3) & (dt < 0.11)).all())


# ---------------------------------------------------------------- config and vLLM


def test_config_has_the_qwen3_5_w4a16_layout(config):
    text = config["text_config"]
    assert config["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    assert config["model_type"] == "qwen3_5" and text["model_type"] == "qwen3_5_text"
    assert text["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert text["mtp_num_hidden_layers"] == 1 and text["tie_word_embeddings"] is False
    assert text["vocab_size"] == 4096 >= tokenizer_size()
    ids = special_token_ids()
    assert config["image_token_id"] == ids["<|image_pad|>"]
    assert text["eos_token_id"] == ids["<|im_end|>"]
    assert "vision_config" in config
    qc = config["quantization_config"]
    assert (qc["quant_method"], qc["format"]) == ("compressed-tensors", "pack-quantized")
    weights = qc["config_groups"]["group_0"]["weights"]
    assert (weights["num_bits"], weights["group_size"], weights["symmetric"], weights["strategy"]) == (
        4,
        128,
        True,
        "group",
    )


def test_compressed_tensors_validates_the_quantization_config(config):
    from compressed_tensors import QuantizationConfig

    parsed = QuantizationConfig.model_validate(config["quantization_config"])
    assert parsed.config_groups["group_0"].weights.group_size == 128


def test_ignore_list_names_every_unquantized_linear(config, tensors, tiny_plan):
    ignore = set(config["quantization_config"]["ignore"])
    quantized = {e.module for e in _int4_linears(tiny_plan)}
    assert not quantized & ignore
    bf16_linears = {
        n.removesuffix(".weight")
        for n, t in tensors.items()
        if n.endswith("_proj.weight") or n.endswith("fc.weight") or n == "lm_head.weight"
    }
    assert bf16_linears <= ignore
    assert {"lm_head", "model.language_model.embed_tokens", "mtp.fc"} <= ignore
    gdn_small = {f"model.language_model.layers.{i}.linear_attn.in_proj_{x}" for i in range(3) for x in "ab"}
    assert gdn_small <= ignore
    depth = config["vision_config"]["depth"]
    assert len([n for n in ignore if n.startswith("model.visual.")]) == 4 * depth + 2


def test_vllm_engine_config_accepts_tiny_with_mtp(tiny):
    from vllm.engine.arg_utils import EngineArgs

    vllm_config = EngineArgs(
        model=str(tiny),
        language_model_only=True,
        max_model_len=4096,
        max_num_seqs=8,
        enforce_eager=True,
        speculative_config={"method": "mtp", "num_speculative_tokens": 4},
    ).create_engine_config()
    model = vllm_config.model_config
    assert model.architectures == ["Qwen3_5ForConditionalGeneration"]
    assert model.quantization == "compressed-tensors"
    assert model.dtype == torch.bfloat16
    assert model.get_vocab_size() == 4096
    assert model.hf_text_config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert vllm_config.cache_config.mamba_ssm_cache_dtype == "float32"  # from text_config.mamba_ssm_dtype
    spec = vllm_config.speculative_config
    assert spec.method == "mtp" and spec.num_speculative_tokens == 4
    assert spec.draft_model_config.hf_config.architectures == ["Qwen3_5MTP"]


# Builds vLLM's Qwen3_5ForConditionalGeneration and Qwen3_5MTP on the CPU and feeds them (1) the tiny
# checkpoint and (2) the full 64-layer plan as stride-0 tensors on the meta device: vLLM's own
# name mapping must consume every tensor, its weight loaders must accept every shape, and its
# loader's completeness check must find every parameter filled. Runs in a subprocess because it
# stubs vLLM's missing compiled ops and initialises torch.distributed.
_LOAD_CHECK = textwrap.dedent(
    """
    import json, sys, tempfile
    from pathlib import Path
    from qwen_serving.engine import cpu_compat
    cpu_compat.install()
    import torch
    cpu_compat.inspect_models_in_process()
    from qwen_serving.checkpoint import synth
    from tests.helpers.vllm_cpu_models import engine_config, load_models, start_cpu_world

    tiny = Path(sys.argv[1])
    tiny_config = engine_config(tiny, num_speculative_tokens=4, max_model_len=4096)
    start_cpu_world(tiny_config)
    stored = dict(synth.iter_checkpoint(tiny))
    counts = load_models(tiny_config, stored.items)
    target = counts["Qwen3_5ForConditionalGeneration"][1]
    gdn = target.language_model.model.layers[0].linear_attn
    hf = "model.language_model.layers.0.linear_attn."
    qkvz = torch.cat([stored[hf + "in_proj_qkv.weight_packed"], stored[hf + "in_proj_z.weight_packed"]])
    ba = torch.cat([stored[hf + "in_proj_b.weight"], stored[hf + "in_proj_a.weight"]])
    values_ok = torch.equal(gdn.in_proj_qkvz.weight_packed.data, qkvz) and torch.equal(gdn.in_proj_ba.weight.data, ba)
    result = {"tiny": {k: v[0] for k, v in counts.items()}, "tiny_values": values_ok,
              "tiny_ba_quant": type(gdn.in_proj_ba.quant_method).__name__,
              "tiny_qkvz_quant": type(gdn.in_proj_qkvz.quant_method).__name__}

    full_dir = Path(tempfile.mkdtemp())
    synth.write_config_files(full_dir, "full", synth.FULL_LAYERS)
    plan = synth.checkpoint_plan(synth.SIZES["full"], synth.FULL_LAYERS)
    def planned():
        for entry in plan:
            for name, shape, dtype in entry.tensors():
                yield name, torch.zeros((), dtype=dtype).expand(shape)
    counts = load_models(engine_config(full_dir, num_speculative_tokens=4, max_model_len=4096), planned, "meta")
    result["full"] = {k: v[0] for k, v in counts.items()}
    print("RESULT " + json.dumps(result))
    """
)


def test_vllm_loads_every_tensor_of_tiny_and_of_the_full_plan(tiny):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(
        [sys.executable, "-c", _LOAD_CHECK, str(tiny)], env=env, capture_output=True, text=True, timeout=600
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-6000:]
    result = json.loads(lines[0].removeprefix("RESULT "))
    assert result["tiny"]["Qwen3_5ForConditionalGeneration"] > 50
    assert result["tiny"]["Qwen3_5MTP"] == 14  # embed, lm_head, fc, 3 norms, one bf16 decoder layer (8)
    assert result["tiny_values"], "fused GDN projections do not hold the checkpoint's values"
    assert result["tiny_qkvz_quant"] == "CompressedTensorsLinearMethod"
    assert result["tiny_ba_quant"] == "UnquantizedLinearMethod"
    assert result["full"]["Qwen3_5MTP"] == 14
    assert result["full"]["Qwen3_5ForConditionalGeneration"] > 1000


# ---------------------------------------------------------------- full-size plan


def test_full_plan_has_the_real_shapes_and_size():
    plan = synth.checkpoint_plan(synth.REAL, synth.FULL_LAYERS)
    synth.check_marlin_shapes(plan)
    shapes = {name: shape for entry in plan for name, shape, _ in entry.tensors()}
    lm = "model.language_model.layers."
    assert shapes[f"{lm}3.self_attn.q_proj.weight_packed"] == (2 * 24 * 256, 5120 // 8)  # gated q
    assert shapes[f"{lm}3.self_attn.k_proj.weight_packed"] == (4 * 256, 5120 // 8)
    assert shapes[f"{lm}3.self_attn.o_proj.weight_scale"] == (5120, 24 * 256 // 128)
    assert shapes[f"{lm}0.linear_attn.in_proj_qkv.weight_packed"] == (2 * 16 * 128 + 48 * 128, 5120 // 8)
    assert shapes[f"{lm}0.linear_attn.in_proj_z.weight_packed"] == (48 * 128, 5120 // 8)
    assert shapes[f"{lm}0.linear_attn.in_proj_a.weight"] == (48, 5120)
    assert shapes[f"{lm}0.linear_attn.conv1d.weight"] == (10240, 1, 4)
    assert shapes[f"{lm}0.mlp.down_proj.weight_packed"] == (5120, 17408 // 8)
    assert shapes["lm_head.weight"] == shapes["model.language_model.embed_tokens.weight"] == (248320, 5120)
    kinds = synth.layer_types(synth.FULL_LAYERS)
    assert kinds.count("linear_attention") == 48 and kinds.count("full_attention") == 16
    total = sum(synth.entry_bytes(e) for e in plan)
    assert 19.0e9 < total < 20.0e9  # ~18.5 GB of text model + the 0.92 GB tower
    visual = {name.removeprefix(synth.VISUAL): shape for name, shape in shapes.items() if name.startswith(synth.VISUAL)}
    assert visual == model.vision_tensor_shapes()
    assert visual["patch_embed.proj.weight"] == (1152, 3, 2, 16, 16)
    assert visual["blocks.26.attn.qkv.weight"] == (3 * 1152, 1152)
    assert visual["merger.linear_fc1.weight"] == (4 * 1152, 4 * 1152)
    assert visual["merger.linear_fc2.weight"] == (5120, 4 * 1152)
    tower = sum(synth.entry_bytes(e) for e in plan if e.tensors()[0][0].startswith(synth.VISUAL))
    assert tower == model.vision_tower_bytes()
    mtp = sum(synth.entry_bytes(e) for e in plan if e.tensors()[0][0].startswith("mtp."))
    assert 0.8e9 < mtp < 0.9e9
    shards = synth.shard_plan(plan, synth.MAX_SHARD_BYTES["full"])
    assert all(sum(synth.entry_bytes(e) for e in shard) <= 5e9 for shard in shards)


def test_the_tower_is_written_in_bf16_with_the_configs_shapes(tiny, tensors, config):
    visual = {name.removeprefix(synth.VISUAL): t for name, t in tensors.items() if name.startswith(synth.VISUAL)}
    assert {name: tuple(t.shape) for name, t in visual.items()} == model.vision_tensor_shapes(config["vision_config"])
    assert {t.dtype for t in visual.values()} == {torch.bfloat16}
    assert "deepstack_visual_indexes" not in config["vision_config"]  # Qwen3.5: the merger's rows only
    assert float(visual["blocks.0.norm1.weight"].float().mean()) == pytest.approx(1.0, abs=0.02)  # LayerNorm: w
    pre = json.loads((tiny / "preprocessor_config.json").read_text())
    vision = config["vision_config"]
    assert (pre["patch_size"], pre["merge_size"], pre["temporal_patch_size"]) == (
        vision["patch_size"], vision["spatial_merge_size"], vision["temporal_patch_size"])


def test_a_scripted_checkpoint_carries_the_same_tower(tiny, tensors, tmp_path):
    scripted = _generate(tmp_path / "scripted", 0, "--behaviour", "scripted")
    stored = dict(synth.iter_checkpoint(scripted))
    visual = [name for name in tensors if name.startswith(synth.VISUAL)]
    assert visual and all(torch.equal(stored[name], tensors[name]) for name in visual)
    assert (scripted / "preprocessor_config.json").read_bytes() == (tiny / "preprocessor_config.json").read_bytes()


def test_plan_refuses_shapes_marlin_cannot_run():
    with pytest.raises(ValueError, match="Marlin"):
        synth.check_marlin_shapes([synth.Int4Linear("x.q_proj", 96, 256)])


# ---------------------------------------------------------------- tokenizer and chat template


@pytest.fixture(scope="module")
def tokenizer(tiny):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny))


def test_tokenizer_loads_and_matches_the_trained_one(tiny, tokenizer):
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(tiny / "tokenizer.json"))
    assert len(tokenizer) == tokenizer_size()
    text = "Hello café 日本語 <think>\nplan</think>\n<tool_call>\n<function=f>\n</function>\n</tool_call><|im_end|>"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids == raw.encode(text).ids
    assert tokenizer.decode(ids) == text
    for content, token_id in special_token_ids().items():
        assert tokenizer.convert_tokens_to_ids(content) == token_id
        assert tokenizer.encode(content, add_special_tokens=False) == [token_id]
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    # the parsers must see markup tags in decoded text; turn markers are dropped
    kept = tokenizer.decode(tokenizer.encode("<think>x</think><|im_end|>"), skip_special_tokens=True)
    assert kept == "<think>x</think>"
    assert {c for c, special in ADDED_TOKENS if not special} >= {"<think>", "</think>", "<tool_call>", "</tool_call>"}


def test_generation_config(tiny):
    gen = json.loads((tiny / "generation_config.json").read_text())
    ids = special_token_ids()
    assert gen["eos_token_id"] == [ids["<|im_end|>"], ids["<|endoftext|>"]]
    assert gen["pad_token_id"] == ids["<|endoftext|>"]


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


def test_chat_template_thinking_on_and_off(tokenizer):
    messages = [{"role": "user", "content": "Hi"}]
    on = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert on == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"
    off = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert off == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def test_chat_template_with_tools_calls_and_responses(tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "Use the tool.",
            "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "content": '{"temp": 21}'},
        {"role": "tool", "content": '{"sky": "clear"}'},
    ]
    text = tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    tool_json = json.dumps(TOOLS[0]["function"])
    expected = (
        "<|im_start|>system\nBe brief.\n\n# Tools\n\nThese functions are available to you:\n\n"
        f"<tools>\n{tool_json}\n</tools>\n\n"
        "To call a function, answer with exactly this and nothing after it:\n\n"
        "<tool_call>\n<function=FUNCTION_NAME>\n<parameter=PARAMETER_NAME>\nVALUE\n</parameter>\n</function>\n"
        "</tool_call>\n\nGive one <parameter> block per argument; several calls may follow one another.<|im_end|>\n"
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nUse the tool.\n</think>\n\n"
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"
        "<|im_end|>\n"
        '<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response>\n'
        '<tool_response>\n{"sky": "clear"}\n</tool_response><|im_end|>\n'
        "<|im_start|>assistant\n<think>\n"
    )
    assert text == expected
    # tools without a system message still get a system turn
    bare = tokenizer.apply_chat_template(messages[1:2], tools=TOOLS, tokenize=False, add_generation_prompt=False)
    assert bare.startswith("<|im_start|>system\n# Tools\n") and bare.endswith(
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
    )


def test_rendered_tool_call_parses_back_with_vllms_qwen3_coder_parser(tokenizer):
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.tool_parsers import ToolParserManager

    tools = [
        {
            **TOOLS[0],
            "function": {
                **TOOLS[0]["function"],
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                },
            },
        }
    ]
    call = {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}
    rendered = tokenizer.apply_chat_template(
        [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": call}]},
        ],
        tools=tools,
        tokenize=False,
    )
    assistant_text = rendered.split("<|im_start|>assistant\n")[1].removesuffix("<|im_end|>\n")
    request = ChatCompletionRequest(model="synthetic", messages=[{"role": "user", "content": "Weather?"}], tools=tools)
    parser = ToolParserManager.get_tool_parser("qwen3_coder")(tokenizer, request.tools)
    parsed = parser.extract_tool_calls(assistant_text, request)
    assert parsed.tools_called and len(parsed.tool_calls) == 1
    assert parsed.tool_calls[0].function.name == "get_weather"
    assert json.loads(parsed.tool_calls[0].function.arguments) == call["arguments"]


def test_chat_template_drops_reasoning_before_the_last_query(tokenizer):
    messages = [
        {"role": "user", "content": "One?"},
        {"role": "assistant", "content": "<think>\nold thoughts\n</think>\n\nFirst."},
        {"role": "user", "content": "Two?"},
        {"role": "assistant", "content": "Second.", "reasoning_content": "new thoughts"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert "old thoughts" not in text and "<|im_start|>assistant\nFirst.<|im_end|>" in text
    assert "<|im_start|>assistant\n<think>\nnew thoughts\n</think>\n\nSecond.<|im_end|>\n" in text


def test_chat_template_rejects_unknown_roles(tokenizer):
    with pytest.raises(Exception, match="unknown role"):
        tokenizer.apply_chat_template([{"role": "robot", "content": "x"}], tokenize=False)


# ---------------------------------------------------------------- determinism and CLI


def test_same_seed_gives_identical_bytes(tiny, tmp_path):
    again = _generate(tmp_path / "again", seed=0)
    assert _digests(again) == _digests(tiny)
    other = _digests(_generate(tmp_path / "other", seed=1))
    first = _digests(tiny)
    assert other["tokenizer.json"] == first["tokenizer.json"] and other["config.json"] == first["config.json"]
    assert other["model-00001-of-00005.safetensors"] != first["model-00001-of-00005.safetensors"]


def test_cli_refuses_bad_input_and_keeps_existing_output(tmp_path, capsys):
    existing = tmp_path / "ckpt"
    existing.mkdir()
    (existing / "keep.txt").write_text("mine")
    for argv, message in (
        (["--size", "tiny", "--out", str(existing), "--seed", "0"], "exists"),
        (["--size", "tiny", "--layers", "6", "--out", str(tmp_path / "a"), "--seed", "0"], "multiple of 4"),
        (["--size", "full", "--layers", "4", "--out", str(tmp_path / "b"), "--seed", "0"], "64 layers"),
        (["--size", "tiny", "--out", str(tmp_path / "c"), "--seed", "-1"], "seed"),
    ):
        with pytest.raises(SystemExit) as exc:
            synth.main(argv)
        assert exc.value.code == 2
        assert message in capsys.readouterr().err
    assert (existing / "keep.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_force_replaces_an_existing_checkpoint(tiny, tmp_path):
    target = tmp_path / "ckpt"
    target.mkdir()
    (target / "stale.txt").write_text("old")
    _generate(target, 0, "--force")
    assert _digests(target) == _digests(tiny)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
