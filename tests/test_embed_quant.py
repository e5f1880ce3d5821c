"""patches/qwen3_5-embed-quant.patch: int8 group-128 embed_tokens in qwen3_5 and its MTP drafter.

Builds a tiny Qwen3.5 (one GDN layer, one attention layer, one MTP layer) through vLLM's own
`initialize_model`, with a compressed-tensors config shaped like the prepared checkpoint (W4A16 on
every Linear, int8 g128 on embed_tokens), loads packed int8 tensors under their checkpoint names and
checks the dequant-gather (vLLM's Triton kernel, interpreted on CPU) against plain torch in fp32.
Runs against the patched vLLM copy that tests/run.sh puts first on PYTHONPATH.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from qwen_serving.checkpoint import ct_config

HIDDEN = 256
VOCAB = 1000  # not a multiple of 64: the padded rows of the embedding are exercised too
PADDED_VOCAB = 1024  # vLLM pads the vocab dimension to a multiple of 64
GROUP = 128
CKPT_EMBED = "model.language_model.embed_tokens"  # the tensor name in a Qwen3.5 checkpoint
TOKEN_IDS = torch.tensor([[0, 999, 17, 17], [512, 3, 998, 1]])

W4A16 = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": GROUP, "dynamic": False}
INT8_G128 = {**W4A16, "num_bits": 8}
# The target the prepare step writes (qwen_serving/checkpoint/ct_config.py): the MTP drafter names its copy
# "mtp.embed_tokens", the VL target model "language_model.model.embed_tokens"; one pattern covers both.
EMBED_GROUP = {"targets": [r"re:(.*\.)?embed_tokens$"], "weights": INT8_G128, "format": "pack-quantized"}
LINEAR_GROUP = {"targets": ["Linear"], "weights": W4A16, "format": "pack-quantized"}


def quant_config(groups: dict, ignore: list[str]) -> dict:
    return {**ct_config.base_config(None), "config_groups": groups, "ignore": ignore}


# Outside the W4A16 group: lm_head and the vision tower (bf16 here), and the GDN a/b projections,
# whose 8 output rows in this tiny model no CPU W4A16 kernel accepts.
IGNORE = ["lm_head", "re:.*visual.*", r"re:.*linear_attn\.in_proj_[ab]$"]
QUANTIZED = quant_config({"qs_embed": EMBED_GROUP, "group_0": LINEAR_GROUP}, IGNORE)
UNQUANTIZED_EMBED = {
    "embed-not-targeted": quant_config({"group_0": LINEAR_GROUP}, IGNORE),
    "embed-ignored": quant_config({"group_0": LINEAR_GROUP, "group_1": EMBED_GROUP}, [*IGNORE, "re:.*embed_tokens$"]),
}


def pack_int8_rows(q: torch.Tensor) -> torch.Tensor:
    """int8 [rows, cols] -> int32 [rows, cols // 4]: offset-binary bytes, column 4j+i in byte i of word j."""
    u = (q.to(torch.int32) + 128) & 0xFF
    packed = torch.zeros(q.shape[0], q.shape[1] // 4, dtype=torch.int32)
    for i in range(4):
        packed |= u[:, i::4] << (8 * i)
    return packed


def build_target_and_drafter(tmp_path: Path, quantization_config: dict):
    """The serving path: target model first (its hf_to_vllm_mapper rewrites the shared quant config's
    names), then the MTP drafter from the proposer's own draft config, as the V1 runner does."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.transformers_utils.configs.qwen3_5 import Qwen3_5Config
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    cfg = Qwen3_5Config(
        text_config=dict(
            num_hidden_layers=2,
            layer_types=["linear_attention", "full_attention"],
            hidden_size=HIDDEN,
            intermediate_size=512,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=64,
            linear_value_head_dim=64,
            vocab_size=VOCAB,
            tie_word_embeddings=False,
            mtp_num_hidden_layers=1,
            max_position_embeddings=1024,
        ),
        vision_config=dict(depth=1, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=HIDDEN),
    )
    cfg.architectures = ["Qwen3_5ForConditionalGeneration"]
    cfg.quantization_config = quantization_config
    cfg.save_pretrained(tmp_path)
    vllm_config = EngineArgs(
        model=str(tmp_path),
        skip_tokenizer_init=True,
        dtype="float32",  # the kernel writes in the scale dtype: fp32 makes the comparison exact
        max_model_len=1024,
        max_num_seqs=2,
        language_model_only=True,
        enforce_eager=True,
        speculative_config={"method": "mtp", "num_speculative_tokens": 1},
    ).create_engine_config()
    target = initialize_model(vllm_config=vllm_config)
    spec = vllm_config.speculative_config
    draft_config = SpecDecodeBaseProposer._create_draft_vllm_config(
        SimpleNamespace(speculative_config=spec, vllm_config=vllm_config)
    )
    drafter = initialize_model(vllm_config=draft_config, model_config=spec.draft_model_config)
    return target, drafter


def share_embeddings(target, drafter) -> None:
    """What the V1 proposer does after loading the drafter (llm_base_proposer._maybe_share_embeddings)."""
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    SpecDecodeBaseProposer._maybe_share_embeddings(SimpleNamespace(model=drafter), target.get_language_model())


def test_int8_embed_tokens_in_target_and_mtp(vllm_world, tmp_path):
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_embedding import (
        CompressedTensorsEmbeddingWNA16Int,
    )

    target, drafter = build_target_and_drafter(tmp_path, QUANTIZED)
    target_embed = target.language_model.model.embed_tokens
    drafter_embed = drafter.model.embed_tokens
    for embed in (target_embed, drafter_embed):
        assert isinstance(embed.quant_method, CompressedTensorsEmbeddingWNA16Int)
        assert (embed.quant_method.num_bits, embed.quant_method.group_size) == (8, GROUP)
        assert embed.weight_packed.shape == (PADDED_VOCAB, HIDDEN // 4) and embed.weight_packed.dtype == torch.int32
        assert embed.weight_scale.shape == (PADDED_VOCAB, HIDDEN // GROUP)
        assert not hasattr(embed, "weight")
    # the W4A16 Linear group still owns the linears (the embed group did not shadow it)
    mlp_scheme = target.language_model.model.layers[0].mlp.down_proj.scheme
    assert type(mlp_scheme).__name__ == "CompressedTensorsWNA16" and mlp_scheme.num_bits == 4

    gen = torch.Generator().manual_seed(0)
    q = torch.randint(-128, 128, (VOCAB, HIDDEN), generator=gen, dtype=torch.int8)
    scale = (torch.rand(VOCAB, HIDDEN // GROUP, generator=gen) * 0.02 + 1e-3).to(torch.bfloat16)
    packed = pack_int8_rows(q)
    assert torch.equal(packed, pack_to_int32(q, 8)), "test packing differs from the compressed-tensors format"
    checkpoint = [
        (f"{CKPT_EMBED}.weight_packed", packed),
        (f"{CKPT_EMBED}.weight_scale", scale),
        (f"{CKPT_EMBED}.weight_shape", torch.tensor([VOCAB, HIDDEN])),
    ]
    assert target.load_weights(checkpoint) >= {
        f"language_model.model.embed_tokens.{n}" for n in ("weight_packed", "weight_scale")
    }
    assert drafter.load_weights(checkpoint) >= {f"model.embed_tokens.{n}" for n in ("weight_packed", "weight_scale")}

    rows = TOKEN_IDS.reshape(-1)
    expected = (q[rows].float() * scale[rows].float().repeat_interleave(GROUP, dim=1)).reshape(*TOKEN_IDS.shape, HIDDEN)
    for model in (target, drafter):
        out = model.embed_input_ids(TOKEN_IDS)
        assert out.dtype == torch.float32
        assert torch.equal(out, expected)

    # The proposer swaps in the target's embedding without reading `.weight` (absent when quantized).
    share_embeddings(target, drafter)
    assert drafter.model.embed_tokens is target_embed
    assert torch.equal(drafter.embed_input_ids(TOKEN_IDS), expected)


@pytest.mark.parametrize("config_name", list(UNQUANTIZED_EMBED))
def test_unquantized_embed_tokens_unchanged(vllm_world, tmp_path, config_name):
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    target, drafter = build_target_and_drafter(tmp_path, UNQUANTIZED_EMBED[config_name])
    for embed in (target.language_model.model.embed_tokens, drafter.model.embed_tokens):
        assert type(embed.quant_method) is UnquantizedEmbeddingMethod
        assert embed.weight.shape == (PADDED_VOCAB, HIDDEN) and not hasattr(embed, "weight_packed")

    weight = torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    checkpoint = [(f"{CKPT_EMBED}.weight", weight)]
    assert "language_model.model.embed_tokens.weight" in target.load_weights(checkpoint)
    assert "model.embed_tokens.weight" in drafter.load_weights(checkpoint)
    expected = weight[TOKEN_IDS].float()
    for model in (target, drafter):
        assert torch.equal(model.embed_input_ids(TOKEN_IDS), expected)
    share_embeddings(target, drafter)
    assert drafter.model.embed_tokens is target.language_model.model.embed_tokens
