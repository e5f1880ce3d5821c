"""The int8 format written by qwen_serving.checkpoint is the one vLLM 0.28.0 reads.

Checked against the installed libraries' own code, not a restatement of it: compressed-tensors'
`pack_to_int32`, vLLM's dequant-gather embedding kernel (Triton, interpreted on CPU), and vLLM's
compressed-tensors config matching for the target model and the MTP drafter, on the
quantization_config the prepare steps actually write.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from qwen_serving.checkpoint import ct_config, int8
from qwen_serving.checkpoint.safetensors_io import bf16_to_f32

REPO = Path(__file__).resolve().parents[1]


def test_pack_matches_compressed_tensors():
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

    rng = np.random.default_rng(0)
    codes = rng.integers(-128, 128, size=(5, 256), dtype=np.int8)
    ours = int8.pack(codes)
    theirs = pack_to_int32(torch.from_numpy(codes), 8)
    assert ours.dtype == np.int32 and ours.shape == (5, 64)
    assert np.array_equal(ours, theirs.numpy())
    back = unpack_from_int32(torch.from_numpy(ours), 8, torch.Size([5, 256]))
    assert np.array_equal(back.numpy(), codes)
    assert np.array_equal(int8.unpack(ours), codes)


def test_vllm_embedding_kernel_reads_our_layout():
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_embedding import (
        _dequant_gather_triton,
    )

    rng = np.random.default_rng(1)
    weight = rng.normal(0, 0.02, size=(64, 256)).astype(np.float32)
    codes, scale_bits = int8.quantize_rows(weight, "BF16")
    packed = torch.from_numpy(int8.pack(codes))
    scale = torch.from_numpy(scale_bits.view(np.int16)).view(torch.bfloat16)
    ids = torch.tensor([3, 0, 63, 17, 3], dtype=torch.int32)
    out = _dequant_gather_triton(ids, packed, scale.float(), 256, 8)  # fp32 out: exact under the interpreter
    expected = int8.dequantize_rows(codes, scale_bits, "BF16")[ids.numpy()]
    assert np.array_equal(out.numpy(), expected)


def _prepared_config(tiny_source: Path, tmp_path: Path) -> tuple[dict, dict]:
    model = tmp_path / "m"
    subprocess.run(["cp", "-a", str(tiny_source), str(model)], check=True)
    for step in ("quant_lm_head", "quant_embed", "quant_mtp"):
        subprocess.run([sys.executable, str(REPO / "prepare" / f"{step}.py"), str(model)],
                       check=True, capture_output=True)
    before = json.loads((tiny_source / "config.json").read_text())["quantization_config"]
    after = json.loads((model / "config.json").read_text())["quantization_config"]
    return before, after


def _vllm_config(qc: dict, model_class):
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsConfig

    config = CompressedTensorsConfig.from_config(copy.deepcopy(qc))
    mapper = getattr(model_class, "hf_to_vllm_mapper", None)
    if mapper is not None:
        config.apply_vllm_mapper(mapper.get_unstacked_mapper())
    config.packed_modules_mapping = dict(model_class.packed_modules_mapping)
    return config


def _bits(config, name: str, cls) -> int | None:
    layer = torch.nn.Module.__new__(cls)  # only the class name takes part in matching
    scheme = config.get_scheme_dict(layer, layer_name=name)
    return scheme["weights"].num_bits if scheme and scheme.get("weights") is not None else None


def test_vllm_resolves_prepared_config(tiny_source, tmp_path):
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
    from vllm.model_executor.models.qwen3_5 import Qwen3_5ForConditionalGeneration
    from vllm.model_executor.models.qwen3_5_mtp import Qwen3_5MTP

    before, after = _prepared_config(tiny_source, tmp_path)
    target_before = _vllm_config(before, Qwen3_5ForConditionalGeneration)
    target = _vllm_config(after, Qwen3_5ForConditionalGeneration)
    drafter = _vllm_config(after, Qwen3_5MTP)

    # the target model, under vLLM's names for the VL wrapper
    assert _bits(target, "language_model.lm_head", ParallelLMHead) == 8
    assert _bits(target, "language_model.model.embed_tokens", VocabParallelEmbedding) == 8
    assert _bits(target_before, "language_model.lm_head", ParallelLMHead) is None
    # the MTP drafter: its own layer names, its lm_head and its copy of the embedding
    assert _bits(drafter, "lm_head", ParallelLMHead) == 8
    assert _bits(drafter, "mtp.embed_tokens", VocabParallelEmbedding) == 8
    for name in ("mtp.fc", "mtp.layers.0.self_attn.qkv_proj", "mtp.layers.0.self_attn.o_proj",
                 "mtp.layers.0.mlp.gate_up_proj", "mtp.layers.0.mlp.down_proj"):
        assert _bits(drafter, name, LinearBase) == 8, name
    # everything else loads as before: int4 linears stay int4, ignored GDN projections stay ignored
    for name in ("language_model.model.layers.3.self_attn.qkv_proj", "language_model.model.layers.0.mlp.down_proj",
                 "language_model.model.layers.0.linear_attn.in_proj_qkvz"):
        assert _bits(target, name, LinearBase) == _bits(target_before, name, LinearBase) == 4, name
    assert _bits(target, "language_model.model.layers.0.linear_attn.in_proj_ba", LinearBase) is None
    # the scheme vLLM builds for the int8 lm_head: weight-only int8 g128 (Marlin uint8b128 on sm86)
    scheme = target._get_scheme_from_parts(
        weight_quant=target.get_scheme_dict(torch.nn.Module.__new__(ParallelLMHead), "language_model.lm_head")["weights"],
        input_quant=None,
        format="pack-quantized",
        layer_name="language_model.lm_head",
    )
    assert type(scheme).__name__ == "CompressedTensorsWNA16" and scheme.num_bits == 8 and scheme.group_size == 128


def test_own_resolver_agrees_with_vllm(tiny_source, tmp_path):
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
    from vllm.model_executor.models.qwen3_5_mtp import Qwen3_5MTP

    _, after = _prepared_config(tiny_source, tmp_path)
    drafter = _vllm_config(after, Qwen3_5MTP)  # no name mapping: checkpoint-style names compare directly
    classes = {"Linear": LinearBase, "ParallelLMHead": ParallelLMHead, "VocabParallelEmbedding": VocabParallelEmbedding}
    index = json.loads((tmp_path / "m" / "model.safetensors.index.json").read_text())["weight_map"]
    modules = sorted({t.rsplit(".", 1)[0] for t in index if t.endswith((".weight", ".weight_packed"))})
    assert len(modules) > 20
    for module in modules:
        for name in ct_config.engine_names(module):
            cls = ct_config.engine_class(module)
            ours = ct_config.resolve(after, name, cls)
            assert (ours["num_bits"] if ours else None) == _bits(drafter, name, classes[cls]), name


def test_unignore_keeps_other_modules_ignored():
    qc = ct_config.base_config(None)
    qc["ignore"] = ["lm_head", "re:.*mtp.*", "re:.*visual.*"]
    new = ct_config.add_group(qc, "int8_mtp", ct_config.with_fused(["mtp.fc", "mtp.layers.0.self_attn.q_proj"]))
    assert "lm_head" in new["ignore"] and "re:.*visual.*" in new["ignore"]
    for name in ("mtp.fc", "mtp.layers.0.self_attn.q_proj", "mtp.layers.0.self_attn.qkv_proj"):
        assert ct_config.describes(ct_config.resolve(new, name, "Linear"), 8, 128), name
    # an MTP module we did not quantize stays behind the rewritten regex
    assert ct_config.resolve(new, "mtp.layers.0.mlp.down_proj", "Linear") is None
    assert ct_config.resolve(new, "model.visual.blocks.0.attn.qkv", "Linear") is None


def test_codes_use_the_rounded_scale():
    rng = np.random.default_rng(2)
    weight = rng.normal(0, 0.05, size=(8, 256)).astype(np.float32)
    codes, scale_bits = int8.quantize_rows(weight, "BF16")
    scale = np.repeat(bf16_to_f32(scale_bits), 128, axis=1)  # the bf16 scale the engine holds
    assert np.array_equal(codes, np.clip(np.rint(weight / scale), -128, 127).astype(np.int8))
    assert np.abs(codes).max() == 127
    assert np.max(np.abs(int8.dequantize_rows(codes, scale_bits, "BF16") - weight) / scale) <= 0.5 + 1e-6


@pytest.fixture(scope="session")
def tiny_source(tmp_path_factory):
    from tests.helpers.tiny_checkpoint import make_tiny

    return make_tiny(tmp_path_factory)
