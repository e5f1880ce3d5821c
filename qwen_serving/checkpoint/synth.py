"""Synthetic Qwen3.8-27B checkpoints in the on-disk format of the public W4A16 AutoRound export.

    python -m qwen_serving.checkpoint.synth --size tiny|shape|full [--layers N] --out DIR --seed S [--device ...]

Random weights, real format: a `Qwen3_5ForConditionalGeneration` config (hybrid 3 Gated DeltaNet :
1 full-attention layers, a vision_config, one MTP layer), compressed-tensors `pack-quantized` int4
symmetric group-128 linears with about half of the group scales negative (codes negated with them,
so the dequantized weight is unchanged), bf16 embed_tokens / lm_head / MTP module / small GDN
projections, sharded safetensors + index, a tokenizer trained here, a Qwen-style chat template and
generation_config, and the BF16 vision tower under `model.visual.` (model.vision_tensor_shapes: every
size carries it, shrunk in `tiny`), which VISION=1 loads and VISION=0 (--language-model-only) skips.

Sizes: `tiny` (a few MB, CI; every quantized linear still fits Marlin's shape rules), `shape`
(every real matrix shape, --layers deep, default 4) and `full` (64 layers, ~19.4 GB; generate it
on the GPU machine, where it is written straight from CUDA). Every tensor draws from its own
generator seeded by (seed, tensor name): the same seed and device give byte-identical files
(CPU and CUDA generators differ, so `--device` is part of the recipe). docs/synthetic.md lists
the format assumptions and how each was checked.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from qwen_serving import model
from qwen_serving.checkpoint.int4 import GROUP_SIZE, negate_groups, pack_int4
from qwen_serving.checkpoint.synth_tokenizer import tokenizer_size, write_tokenizer
from qwen_serving.model import layer_types

LM = "model.language_model."
VISUAL = "model.visual."
CODE_RMS = 4.5  # rms of uniform int4 codes: a scale of 1/(CODE_RMS*sqrt(in)) gives weights of std ~1/sqrt(in)
EMBED_STD = 1.0
LOGIT_STD = 3.0  # lm_head std * sqrt(hidden): spread logits, so greedy picks are rarely near-ties
NORM_STD = 0.05
VISION_SMALL_STD = 0.02  # the tower's biases and position embeddings (vision_config initializer_range)
MARLIN_MIN_OUT, MARLIN_MIN_IN = 64, 128  # GPTQ_MARLIN_MIN_THREAD_N / _K in vLLM's marlin_utils.py


@dataclass(frozen=True)
class TextDims:
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    linear_key_heads: int
    linear_value_heads: int
    linear_head_dim: int
    conv_kernel: int
    vocab: int
    vision: dict


REAL = TextDims(
    hidden=model.HIDDEN,
    intermediate=model.INTERMEDIATE,
    heads=model.Q_HEADS,
    kv_heads=model.KV_HEADS,
    head_dim=model.HEAD_DIM,
    linear_key_heads=model.GDN_K_HEADS,
    linear_value_heads=model.GDN_V_HEADS,
    linear_head_dim=model.GDN_HEAD_DIM,
    conv_kernel=model.CONV_KERNEL,
    vocab=model.VOCAB,
    vision=model.VISION_CONFIG,
)
# Small, but the kernels see the real head geometry: attention head_dim 256 with a 6:1 GQA ratio,
# GDN heads of dim 128 with 3 value heads per key head (the fused GDN decode kernel needs 128).
TINY = TextDims(
    hidden=256,
    intermediate=512,
    heads=6,
    kv_heads=1,
    head_dim=256,
    linear_key_heads=2,
    linear_value_heads=6,
    linear_head_dim=128,
    conv_kernel=4,
    vocab=4096,
    vision={
        **model.VISION_CONFIG,
        "depth": 2,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_heads": 2,
        "out_hidden_size": 256,
        "num_position_embeddings": 256,
    },
)
SIZES = {"tiny": TINY, "shape": REAL, "full": REAL}
FULL_LAYERS = model.LAYERS
MAX_SHARD_BYTES = {"tiny": 3_000_000, "shape": 5_000_000_000, "full": 5_000_000_000}


# ---------------------------------------------------------------- tensor plan


@dataclass(frozen=True)
class Int4Linear:
    """A W4A16 linear: weight_packed / weight_scale / weight_shape under `module`."""

    module: str
    out_features: int
    in_features: int

    def tensors(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        out, inp = self.out_features, self.in_features
        return [
            (f"{self.module}.weight_packed", (out, inp // 8), torch.int32),
            (f"{self.module}.weight_scale", (out, inp // GROUP_SIZE), torch.float16),
            (f"{self.module}.weight_shape", (2,), torch.int64),
        ]


@dataclass(frozen=True)
class Dense:
    """An unquantized tensor; `init` picks the distribution (see _dense_values)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    init: str
    std: float = 0.0

    def tensors(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        return [(self.name, self.shape, self.dtype)]


Entry = Int4Linear | Dense


def _linear(module: str, out_features: int, in_features: int, quantized: bool) -> Entry:
    if quantized:
        return Int4Linear(module, out_features, in_features)
    return Dense(f"{module}.weight", (out_features, in_features), torch.bfloat16, "normal", in_features**-0.5)


def _norm(name: str, size: int, centre: str = "zero") -> Dense:
    # Qwen3.5's RMSNorms (vLLM: GemmaRMSNorm) scale by (1 + w); the GDN output norm by w.
    return Dense(name, (size,), torch.bfloat16, f"norm_{centre}", NORM_STD)


def _attention(prefix: str, d: TextDims, quantized: bool) -> list[Entry]:
    q_out = d.heads * d.head_dim * 2  # Qwen3.5's q_proj also emits the output gate
    return [
        _linear(f"{prefix}.self_attn.q_proj", q_out, d.hidden, quantized),
        _linear(f"{prefix}.self_attn.k_proj", d.kv_heads * d.head_dim, d.hidden, quantized),
        _linear(f"{prefix}.self_attn.v_proj", d.kv_heads * d.head_dim, d.hidden, quantized),
        _linear(f"{prefix}.self_attn.o_proj", d.hidden, d.heads * d.head_dim, quantized),
        _norm(f"{prefix}.self_attn.q_norm.weight", d.head_dim),
        _norm(f"{prefix}.self_attn.k_norm.weight", d.head_dim),
    ]


def _gated_deltanet(prefix: str, d: TextDims) -> list[Entry]:
    key_dim = d.linear_key_heads * d.linear_head_dim
    value_dim = d.linear_value_heads * d.linear_head_dim
    conv_dim = 2 * key_dim + value_dim
    p = f"{prefix}.linear_attn"
    return [
        _linear(f"{p}.in_proj_qkv", conv_dim, d.hidden, True),
        _linear(f"{p}.in_proj_z", value_dim, d.hidden, True),
        # out = value heads (48): below Marlin's 64-wide tile, kept bf16 and listed in `ignore`
        _linear(f"{p}.in_proj_b", d.linear_value_heads, d.hidden, False),
        _linear(f"{p}.in_proj_a", d.linear_value_heads, d.hidden, False),
        Dense(f"{p}.conv1d.weight", (conv_dim, 1, d.conv_kernel), torch.bfloat16, "conv", d.conv_kernel**-0.5),
        Dense(f"{p}.dt_bias", (d.linear_value_heads,), torch.bfloat16, "dt_bias"),
        Dense(f"{p}.A_log", (d.linear_value_heads,), torch.float32, "a_log"),
        _norm(f"{p}.norm.weight", d.linear_head_dim, centre="one"),
        _linear(f"{p}.out_proj", d.hidden, value_dim, True),
    ]


def _decoder_layer(prefix: str, kind: str, d: TextDims, quantized: bool) -> list[Entry]:
    mixer = _attention(prefix, d, quantized) if kind == "full_attention" else _gated_deltanet(prefix, d)
    return [
        _norm(f"{prefix}.input_layernorm.weight", d.hidden),
        *mixer,
        _norm(f"{prefix}.post_attention_layernorm.weight", d.hidden),
        _linear(f"{prefix}.mlp.gate_proj", d.intermediate, d.hidden, quantized),
        _linear(f"{prefix}.mlp.up_proj", d.intermediate, d.hidden, quantized),
        _linear(f"{prefix}.mlp.down_proj", d.hidden, d.intermediate, quantized),
    ]


def checkpoint_plan(d: TextDims, num_layers: int) -> list[Entry]:
    """Every tensor of the checkpoint, in write order (embed, layers, norm, lm_head, mtp)."""
    plan: list[Entry] = [Dense(f"{LM}embed_tokens.weight", (d.vocab, d.hidden), torch.bfloat16, "normal", EMBED_STD)]
    for i, kind in enumerate(layer_types(num_layers)):
        plan += _decoder_layer(f"{LM}layers.{i}", kind, d, quantized=True)
    plan.append(_norm(f"{LM}norm.weight", d.hidden))
    plan.append(Dense("lm_head.weight", (d.vocab, d.hidden), torch.bfloat16, "normal", LOGIT_STD / math.sqrt(d.hidden)))
    # the MTP module: fc over [embedding; hidden], one bf16 full-attention decoder layer, norms
    plan.append(Dense("mtp.fc.weight", (d.hidden, 2 * d.hidden), torch.bfloat16, "normal", (2 * d.hidden) ** -0.5))
    plan.append(_norm("mtp.pre_fc_norm_embedding.weight", d.hidden))
    plan.append(_norm("mtp.pre_fc_norm_hidden.weight", d.hidden))
    plan += _decoder_layer("mtp.layers.0", "full_attention", d, quantized=False)
    plan.append(_norm("mtp.norm.weight", d.hidden))
    plan += _vision_tower(d.vision)
    return plan


def _vision_tower(config: dict) -> list[Dense]:
    """The BF16 tower: LayerNorms about (1, 0), linears and the patch conv with std 1/sqrt(fan-in), small biases
    and position embeddings (random weights whose activations stay finite through every block)."""
    entries = []
    for name, shape in model.vision_tensor_shapes(config).items():
        if name.endswith(".bias"):
            entries.append(Dense(f"{VISUAL}{name}", shape, torch.bfloat16, "normal", VISION_SMALL_STD))
        elif ".norm" in name:
            entries.append(_norm(f"{VISUAL}{name}", shape[0], centre="one"))
        elif name == "pos_embed.weight":
            entries.append(Dense(f"{VISUAL}{name}", shape, torch.bfloat16, "normal", VISION_SMALL_STD))
        else:
            entries.append(Dense(f"{VISUAL}{name}", shape, torch.bfloat16, "normal", math.prod(shape[1:]) ** -0.5))
    return entries


def tensor_bytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def entry_bytes(entry: Entry) -> int:
    return sum(tensor_bytes(shape, dtype) for _, shape, dtype in entry.tensors())


def check_marlin_shapes(plan: list[Entry]) -> None:
    """Every int4 linear must fit Marlin (out % 64, in % 128), the kernel an RTX 3090 runs."""
    for entry in plan:
        if isinstance(entry, Int4Linear) and (entry.out_features % MARLIN_MIN_OUT or entry.in_features % MARLIN_MIN_IN):
            raise ValueError(f"{entry.module} [{entry.out_features}, {entry.in_features}] does not fit Marlin")


def shard_plan(plan: list[Entry], max_shard_bytes: int) -> list[list[Entry]]:
    """Greedy in write order; one entry (a linear's three tensors) never straddles two shards."""
    shards: list[list[Entry]] = [[]]
    filled = 0
    for entry in plan:
        size = entry_bytes(entry)
        if shards[-1] and filled + size > max_shard_bytes:
            shards.append([])
            filled = 0
        shards[-1].append(entry)
        filled += size
    return shards


# ---------------------------------------------------------------- values


def tensor_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"qwen-serving-synth/{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _generator(seed: int, name: str, device: torch.device) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(tensor_seed(seed, name))
    return gen


def intended_int4(
    seed: int, linear: Int4Linear, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The weight a linear is meant to hold, as (codes int8, positive scales fp16, flip mask).

    Weight = scale * code. Groups in `flip` (about half, like the negative scales of AutoRound's
    symmetric exports) are written with scale and codes negated. Every group writes codes uniform on
    [-8, 7] (AutoRound too leaves -8 under a negative scale: docs/synthetic.md), so a flipped group's
    own codes lie on [-7, 8]: its weights average +scale/2 where an unflipped group's average -scale/2.
    Without that balance every row would share a -scale/2 offset, a rank-one part that a 64-layer
    residual stack amplifies layer after layer until the hidden state forgets its input.
    """
    out, inp = linear.out_features, linear.in_features
    gen = _generator(seed, linear.module, device)
    groups = inp // GROUP_SIZE
    draw = torch.randint(0, 16, (out, inp), generator=gen, device=device, dtype=torch.int16)
    flip = torch.rand((out, groups), generator=gen, device=device) < 0.5
    jitter = torch.rand((out, groups), generator=gen, device=device) * 0.45 + 0.8
    scales = (jitter / (CODE_RMS * math.sqrt(inp))).to(torch.float16)
    flip_cols = flip.repeat_interleave(GROUP_SIZE, dim=1)
    codes = torch.where(flip_cols, 8 - draw, draw - 8).to(torch.int8)
    return codes, scales, flip


def _int4_values(seed: int, linear: Int4Linear, device: torch.device) -> dict[str, torch.Tensor]:
    codes, scales, flip = intended_int4(seed, linear, device)
    codes, scales = negate_groups(codes, scales, flip)
    return {
        f"{linear.module}.weight_packed": pack_int4(codes),
        f"{linear.module}.weight_scale": scales,
        f"{linear.module}.weight_shape": torch.tensor([linear.out_features, linear.in_features], dtype=torch.int64),
    }


def _dense_values(seed: int, dense: Dense, device: torch.device) -> torch.Tensor:
    gen = _generator(seed, dense.name, device)

    def uniform(low: float, high: float) -> torch.Tensor:
        return torch.rand(dense.shape, generator=gen, device=device) * (high - low) + low

    if dense.init == "normal":
        values = torch.randn(dense.shape, generator=gen, device=device, dtype=dense.dtype).mul_(dense.std)
    elif dense.init == "norm_zero":
        values = torch.randn(dense.shape, generator=gen, device=device) * dense.std
    elif dense.init == "norm_one":
        values = 1.0 + torch.randn(dense.shape, generator=gen, device=device) * dense.std
    elif dense.init == "conv":
        values = uniform(-dense.std, dense.std)
    elif dense.init == "a_log":
        values = torch.log(uniform(1.0, 16.0))  # decay rates A in [1, 16], as Qwen3-Next initialises them
    elif dense.init == "dt_bias":
        dt = torch.exp(uniform(math.log(1e-3), math.log(1e-1)))
        values = dt + torch.log(-torch.expm1(-dt))  # softplus(dt_bias) = dt
    else:
        raise ValueError(f"unknown init {dense.init!r} for {dense.name}")
    return values.to(dense.dtype)


def entry_values(seed: int, entry: Entry, device: torch.device) -> dict[str, torch.Tensor]:
    if isinstance(entry, Int4Linear):
        return _int4_values(seed, entry, device)
    return {entry.name: _dense_values(seed, entry, device)}


# ---------------------------------------------------------------- configs


def ignored_modules(d: TextDims, num_layers: int) -> list[str]:
    """compressed-tensors `ignore`: every linear-like module left unquantized, in module order."""
    names = [f"{LM}embed_tokens"]
    # the tower's linears (its patch embed is a Conv3d, outside the `Linear` target)
    names += [f"{VISUAL}{name.removesuffix('.weight')}" for name, shape in model.vision_tensor_shapes(d.vision).items()
              if name.endswith(".weight") and len(shape) == 2 and name != "pos_embed.weight"]
    for i, kind in enumerate(layer_types(num_layers)):
        if kind == "linear_attention":
            names += [f"{LM}layers.{i}.linear_attn.in_proj_b", f"{LM}layers.{i}.linear_attn.in_proj_a"]
    names.append("lm_head")
    names.append("mtp.fc")
    names += [f"mtp.layers.0.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
    names += [f"mtp.layers.0.mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")]
    return names


def quantization_config(d: TextDims, num_layers: int) -> dict:
    return {
        "config_groups": {
            "group_0": {
                "format": "pack-quantized",
                "input_activations": None,
                "output_activations": None,
                "targets": ["Linear"],
                "weights": {
                    "actorder": None,
                    "block_structure": None,
                    "dynamic": False,
                    "group_size": GROUP_SIZE,
                    "num_bits": 4,
                    "observer": "minmax",
                    "observer_kwargs": {},
                    "strategy": "group",
                    "symmetric": True,
                    "type": "int",
                },
            }
        },
        "format": "pack-quantized",
        "global_compression_ratio": None,
        "ignore": ignored_modules(d, num_layers),
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
    }


def model_config(d: TextDims, num_layers: int, ids: dict[str, int]) -> dict:
    text = {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_output_gate": True,
        "bos_token_id": ids["<|endoftext|>"],
        "dtype": model.DTYPE,
        "eos_token_id": ids["<|im_end|>"],
        "full_attention_interval": model.FULL_ATTENTION_INTERVAL,
        "head_dim": d.head_dim,
        "hidden_act": "silu",
        "hidden_size": d.hidden,
        "initializer_range": 0.02,
        "intermediate_size": d.intermediate,
        "layer_types": layer_types(num_layers),
        "linear_conv_kernel_dim": d.conv_kernel,
        "linear_key_head_dim": d.linear_head_dim,
        "linear_num_key_heads": d.linear_key_heads,
        "linear_num_value_heads": d.linear_value_heads,
        "linear_value_head_dim": d.linear_head_dim,
        "mamba_ssm_dtype": model.CHECKPOINT_SSM_DTYPE,
        "max_position_embeddings": model.MAX_POSITIONS,
        "model_type": "qwen3_5_text",
        "mtp_num_hidden_layers": model.MTP_LAYERS,
        "mtp_use_dedicated_embeddings": False,
        "num_attention_heads": d.heads,
        "num_hidden_layers": num_layers,
        "num_key_value_heads": d.kv_heads,
        "pad_token_id": None,
        "rms_norm_eps": 1e-06,
        "rope_parameters": {
            "mrope_interleaved": True,
            "mrope_section": [11, 11, 10],  # 64 rotary dims (head_dim 256 * 0.25) = 32 frequency pairs
            "partial_rotary_factor": 0.25,
            "rope_theta": 10000000,
            "rope_type": "default",
        },
        "tie_word_embeddings": False,
        "use_cache": True,
        "vocab_size": d.vocab,
    }
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "dtype": model.DTYPE,
        "image_token_id": ids["<|image_pad|>"],
        "model_type": "qwen3_5",
        "quantization_config": quantization_config(d, num_layers),
        "text_config": text,
        "tie_word_embeddings": False,
        "video_token_id": ids["<|video_pad|>"],
        "vision_config": d.vision,
        "vision_end_token_id": ids["<|vision_end|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
    }


def preprocessor_config(d: TextDims) -> dict:
    """preprocessor_config.json of the Qwen3-VL-style export: the image processor's patch grid follows the
    tower's; pixels are scaled to [-1, 1] (mean and std 0.5); `size` bounds an image's pixel count (VISION=1
    lowers longest_edge through --mm-processor-kwargs max_pixels)."""
    return {
        "image_mean": [0.5, 0.5, 0.5],
        "image_processor_type": "Qwen2VLImageProcessorFast",
        "image_std": [0.5, 0.5, 0.5],
        "merge_size": d.vision["spatial_merge_size"],
        "patch_size": d.vision["patch_size"],
        "processor_class": "Qwen3VLProcessor",
        "size": {"longest_edge": 16_777_216, "shortest_edge": 65_536},
        "temporal_patch_size": d.vision["temporal_patch_size"],
    }


def generation_config(ids: dict[str, int]) -> dict:
    return {
        "bos_token_id": ids["<|endoftext|>"],
        "do_sample": True,
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "pad_token_id": ids["<|endoftext|>"],
        "temperature": 0.6,
        "top_k": 20,
        "top_p": 0.95,
    }


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


# ---------------------------------------------------------------- writing


def resolve_device(size: str, device: str) -> torch.device:
    if device == "auto":
        # tiny stays on the CPU so its bytes do not depend on the machine that made it
        device = "cuda" if size != "tiny" and torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("synth: --device cuda, but torch sees no CUDA device")
    return torch.device(device)


def _shard_name(index: int, count: int) -> str:
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def _progress(total: int, label: str):
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, desc=label, file=sys.stderr, mininterval=1.0)


def write_config_files(out_dir: Path, size: str, num_layers: int) -> None:
    """Everything but the weights: config, generation_config, tokenizer files."""
    ids = write_tokenizer(out_dir)
    _write_json(out_dir / "config.json", model_config(SIZES[size], num_layers, ids))
    _write_json(out_dir / "generation_config.json", generation_config(ids))
    _write_json(out_dir / "preprocessor_config.json", preprocessor_config(SIZES[size]))


def write_checkpoint(
    out: Path, size: str, num_layers: int, seed: int, device: torch.device, scripted=None
) -> Path:
    """Write the checkpoint into a temp dir beside `out`, then rename it to `out` (must not exist).

    `scripted`: a scripted.Design, whose designed tensors replace the random ones (scripted.py)."""
    from safetensors.torch import save_file

    d = SIZES[size]
    plan = checkpoint_plan(d, num_layers)
    check_marlin_shapes(plan)
    if d.vocab < tokenizer_size():
        raise ValueError(f"vocab {d.vocab} is smaller than the tokenizer ({tokenizer_size()})")
    shards = shard_plan(plan, MAX_SHARD_BYTES[size])
    total = sum(entry_bytes(e) for e in plan)

    out.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(out.parent).free
    if free < total + (256 << 20):
        raise SystemExit(f"synth: {out.parent} has {free / 1e9:.1f} GB free, the checkpoint needs {total / 1e9:.1f} GB")
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    values = lambda entry, device: entry_values(seed, entry, device)  # noqa: E731
    meta: dict = {}
    if scripted is not None:
        from qwen_serving.checkpoint import scripted as scripted_module

        values = scripted_module.values_for(scripted, seed, values)
        meta = {"behaviour": "scripted", "mtp_agree": scripted.mtp_agree}
    try:
        write_config_files(tmp, size, num_layers)
        if scripted is not None:
            scripted_module.write_design_files(tmp, scripted)
        weight_map: dict[str, str] = {}
        with _progress(total, f"synth {size} ({num_layers} layers, {device.type})") as bar:
            for index, shard in enumerate(shards):
                name = _shard_name(index, len(shards))
                tensors: dict[str, torch.Tensor] = {}
                for entry in shard:
                    for tensor_name, value in values(entry, device).items():
                        tensors[tensor_name] = value.cpu().contiguous()
                        weight_map[tensor_name] = name
                    bar.update(entry_bytes(entry))
                save_file(tensors, str(tmp / name), metadata={"format": "pt"})
                os.chmod(tmp / name, 0o644)  # safetensors creates 0600 files; the rest of the dir is 0644
                del tensors
        index_doc = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        _write_json(tmp / "model.safetensors.index.json", index_doc)
        _write_json(tmp / "synth.json", {"device": device.type, "layers": num_layers, "seed": seed, "size": size, **meta})
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def iter_checkpoint(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of a sharded checkpoint, in index order."""
    from safetensors import safe_open

    weight_map = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    for shard in sorted(set(weight_map.values())):
        with safe_open(str(path / shard), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                yield name, f.get_tensor(name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m qwen_serving.checkpoint.synth",
        description="Write a random-weight Qwen3.8-27B checkpoint in the W4A16 AutoRound on-disk format.",
    )
    parser.add_argument("--size", choices=sorted(SIZES), required=True)
    parser.add_argument("--layers", type=int, help="decoder layers, a multiple of 4 (default 4; full is always 64)")
    parser.add_argument("--out", type=Path, required=True, help="checkpoint directory to create (must not exist)")
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="where tensors are drawn; auto = cpu for tiny, cuda (if present) for shape/full",
    )
    parser.add_argument("--force", action="store_true", help="replace --out if it exists")
    parser.add_argument("--behaviour", choices=("random", "scripted"), default="random",
                        help="scripted: a designed next-token distribution (docs/scripted-model.md)")
    parser.add_argument("--mtp-agree", type=float, default=1.0,
                        help="scripted: share of active tokens after which the MTP proposes the chain successor")
    parser.add_argument("--draft-coverage", type=float,
                        help="scripted: also write scripted-draft-ids.json covering this share of the active tokens")
    args = parser.parse_args(argv)

    layers = args.layers if args.layers is not None else (FULL_LAYERS if args.size == "full" else 4)
    if args.size == "full" and layers != FULL_LAYERS:
        parser.error(f"--size full has {FULL_LAYERS} layers; use --size shape --layers N for fewer")
    if layers < 4 or layers % 4:
        parser.error("--layers must be a positive multiple of 4 (3 Gated DeltaNet + 1 attention, repeating)")
    if args.seed < 0:
        parser.error("--seed must be >= 0")
    out = args.out.resolve()
    if out.exists() and not args.force:
        parser.error(f"{out} exists; pass --force to replace it")
    device = resolve_device(args.size, args.device)
    design = None
    if args.behaviour == "scripted":
        from qwen_serving.checkpoint import scripted

        try:
            design = scripted.make_design(args.size, args.seed, args.mtp_agree, args.draft_coverage)
        except ValueError as e:
            parser.error(str(e))
    elif args.mtp_agree != 1.0 or args.draft_coverage is not None:
        parser.error("--mtp-agree and --draft-coverage need --behaviour scripted")

    if out.exists():
        staged = out.parent / f".{out.name}.new-{os.getpid()}"
        write_checkpoint(staged, args.size, layers, args.seed, device, design)
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        out.rename(old)
        staged.rename(out)
        shutil.rmtree(old)
    else:
        write_checkpoint(out, args.size, layers, args.seed, device, design)
    print(f"synth: wrote {out} ({args.size}, {layers} layers, seed {args.seed}, {device.type}, {args.behaviour})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
