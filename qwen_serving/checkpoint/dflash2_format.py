"""The DFlash2 drafter's quantized layout as vLLM 0.28.0 loads it (no torch: prepare_status reads it too).

vLLM builds the drafter's fc and each layer's qkv_proj / o_proj / gate_up_proj / down_proj with the
drafter's own quant config (`get_draft_quant_config`); the conv kernel projections, the candidate
selector, the norms and the shared embedding / lm_head never get one. Two facts of 0.28.0 fix how the
compressed-tensors config must look:
- the drafter's layers are named `model.layers.{i + target layers}` in the engine (start_layer_id), and
  its quant config never receives the model's packed_modules_mapping (upstream vllm#53116), so a target
  naming a checkpoint module (`layers.0.self_attn.q_proj`) matches nothing; the group targets the
  class name `Linear` (every LinearBase class name contains it), as llmcompressor's own configs do;
- `_build_context_kv_buffers` slices `qkv_proj.weight` for the context-KV precompute, which a W4A16
  qkv_proj does not have (it holds weight_packed): stock 0.28.0 fails the load with AttributeError at the
  end of load_weights (upstream vllm#51581, open; reproduced here on the CPU).
  patches/dflash2-quantized-kv.patch projects the context through each layer's own quantized qkv_proj
  instead, so all 36 matrices are int4 by default (the spec's layout); `bf16_qkv` keeps q/k/v bf16
  (ignored by a regex that matches the fused name and, should the mapping be fixed, its parts), the
  21-matrix layout a vLLM without that patch loads.
"""

from __future__ import annotations

import json
from pathlib import Path

from qwen_serving.checkpoint import ct_config

ARCHITECTURE = "DFlash2DraftModel"
STEP = "dflash2_w4a16"
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
QKV = ("q_proj", "k_proj", "v_proj")
QKV_IGNORE = r"re:.*self_attn\.(qkv|q|k|v)_proj$"
GROUP_SIZE = 128
WEIGHTS = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": GROUP_SIZE,
           "dynamic": False, "actorder": None, "observer": "minmax"}
QKV_NOTE = ("q/k/v are int4: stock vLLM 0.28.0 cannot load that (its context-KV precompute reads qkv_proj.weight, "
            "upstream vllm#51581); the patched vLLM install.sh makes loads it (patches/dflash2-quantized-kv.patch; "
            "CPU-tested, not run on a GPU yet)")


def is_dflash2_drafter(model_dir: str | Path) -> bool:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return False
    return ARCHITECTURE in (json.loads(path.read_text()).get("architectures") or [])


def quantizable_modules(config: dict) -> list[str]:
    """The matrices vLLM builds with the drafter's quant config: fc and 7 per layer (36 at 5 layers)."""
    names = ["fc"]
    for i in range(int(config["num_hidden_layers"])):
        names += [f"layers.{i}.self_attn.{p}" for p in ATTENTION] + [f"layers.{i}.mlp.{p}" for p in MLP]
    return sorted(names)


def is_qkv(module: str) -> bool:
    return module.rsplit(".", 1)[-1] in QKV


def quant_config(bf16_qkv: bool = False) -> dict:
    """compressed-tensors W4A16 g128 for every drafter linear vLLM quantizes, q/k/v ignored if bf16_qkv."""
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": dict(WEIGHTS), "input_activations": None,
                                      "output_activations": None, "format": "pack-quantized"}},
        "ignore": ["lm_head"] + ([QKV_IGNORE] if bf16_qkv else []),
    }


def engine_name(module: str) -> str:
    """The layer vLLM builds for a checkpoint module (fused name; the layer index does not matter to the
    regexes written here)."""
    head, _, leaf = module.rpartition(".")
    fused = ct_config.FUSED.get(leaf, leaf)
    return f"model.{head}.{fused}" if head else f"model.{fused}"


def layout_problems(model) -> tuple[list[str], int]:
    """(what vLLM would load differently from the tensors, the number of int4 matrices) of a drafter ModelDir."""
    from qwen_serving.checkpoint.steps import packed_bits

    qc = model.quantization_config
    problems, int4 = [], 0
    for module in quantizable_modules(model.config):
        bits = packed_bits(model, module)
        if bits is None and not model.has(f"{module}.weight"):
            problems.append(f"{module}: neither .weight nor weight_packed")
            continue
        args = ct_config.resolve(qc, engine_name(module), "Linear")
        if bits == 4 and not ct_config.describes(args, 4, GROUP_SIZE):
            problems.append(f"{module} is int4 on disk but quantization_config gives {engine_name(module)} {args}")
        elif bits is None and args:
            problems.append(f"{module} is bf16 on disk but quantization_config quantizes {engine_name(module)}")
        elif bits not in (None, 4):
            problems.append(f"{module} is int{bits}: the W4A16 drafter holds int4 or bf16 matrices")
        int4 += bits == 4
    for i in range(int(model.config["num_hidden_layers"])):
        kinds = {packed_bits(model, f"layers.{i}.self_attn.{p}") for p in QKV}
        if len(kinds) > 1:
            problems.append(f"layers.{i}: q/k/v differ in format, but vLLM fuses them into one qkv_proj")
    return problems, int4


def qkv_int4(model) -> bool:
    from qwen_serving.checkpoint.steps import packed_bits

    return any(packed_bits(model, m) == 4 for m in quantizable_modules(model.config) if is_qkv(m))
