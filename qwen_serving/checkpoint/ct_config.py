"""Edit a checkpoint's compressed-tensors `quantization_config` and check what it resolves to.

vLLM 0.28.0 matches a layer to a config group by its *vLLM* module name, after mapping checkpoint
prefixes (the Qwen3.5 VL wrapper loads `lm_head` as `language_model.lm_head` and
`model.language_model.embed_tokens` as `language_model.model.embed_tokens`; the MTP drafter names
its own layers `mtp.*` and `lm_head`). Layer-path targets are mapped, regex targets are not, so
the groups written here use anchored regexes that hold under every naming. An `ignore` entry that
covers a module we quantize must stop covering it without un-ignoring anything else: exact entries
are dropped, regex entries get a negative lookahead for our modules.
"""

from __future__ import annotations

import copy
import re

from qwen_serving.checkpoint import int8

GROUP_PREFIX = "qs_"


def module_regex(checkpoint_module: str) -> str:
    """Anchored regex target for one module, whatever prefix the engine puts in front of it."""
    if checkpoint_module.endswith("embed_tokens"):
        return r"re:(.*\.)?embed_tokens$"
    if checkpoint_module == "lm_head":
        return r"re:(.*\.)?lm_head$"
    if checkpoint_module.endswith("draft_lm_head"):
        return r"re:(.*\.)?draft_lm_head$"
    return "re:(.*\\.)?" + re.escape(checkpoint_module) + "$"


def engine_names(checkpoint_module: str) -> list[str]:
    """Names the engine may use for this module (main model, VL wrapper, MTP drafter)."""
    names = {checkpoint_module}
    if checkpoint_module == "lm_head":
        names.add("language_model.lm_head")
    if checkpoint_module.endswith("embed_tokens"):
        names |= {"model.embed_tokens", "language_model.model.embed_tokens", "mtp.embed_tokens", "embed_tokens"}
    if checkpoint_module.startswith("model.language_model."):
        names.add("language_model.model." + checkpoint_module[len("model.language_model.") :])
    return sorted(names)


# vLLM fuses these checkpoint projections into one layer; a fused layer is matched by its own name
FUSED = {
    "q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
    "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj",
    "in_proj_qkv": "in_proj_qkvz", "in_proj_z": "in_proj_qkvz",
    "in_proj_b": "in_proj_ba", "in_proj_a": "in_proj_ba",
}


def with_fused(modules: list[str]) -> list[str]:
    """The modules plus the engine's fused layer names built from them."""
    out = set(modules)
    for m in modules:
        head, _, last = m.rpartition(".")
        if last in FUSED:
            out.add(f"{head}.{FUSED[last]}" if head else FUSED[last])
    return sorted(out)


def _matches(name: str, target: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return name == target


def base_config(existing: dict | None) -> dict:
    if existing is None:
        return {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "quantization_status": "compressed",
            "config_groups": {},
            "ignore": [],
        }
    method = existing.get("quant_method")
    if method != "compressed-tensors":
        raise ValueError(
            f"quantization_config.quant_method is {method!r}: only compressed-tensors checkpoints "
            "(or unquantized ones) can take the int8 embedding/lm_head groups"
        )
    return copy.deepcopy(existing)


def add_group(existing: dict | None, group: str, checkpoint_modules: list[str], weights_args: dict | None = None) -> dict:
    """A new quantization_config with one group (first, so it wins) targeting exactly these modules."""
    config = base_config(existing)
    targets = sorted({module_regex(m) for m in checkpoint_modules})
    groups = {GROUP_PREFIX + group: {
        "targets": targets,
        "weights": dict(weights_args or int8.WEIGHTS_ARGS),
        "input_activations": None,
        "output_activations": None,
        "format": "pack-quantized",
    }}
    for name, value in (config.get("config_groups") or {}).items():
        if name != GROUP_PREFIX + group:
            groups[name] = value
    config["config_groups"] = groups
    config["ignore"] = _unignore(config.get("ignore") or [], checkpoint_modules)
    return config


def _unignore(ignore: list[str], modules: list[str]) -> list[str]:
    names = [n for m in modules for n in engine_names(m)]
    guard = "|".join(f"(?:{module_regex(m)[3:]})" for m in sorted(set(modules)))
    kept: list[str] = []
    for entry in ignore:
        if not any(_matches(n, entry) for n in names):
            kept.append(entry)
        elif entry.startswith("re:"):
            kept.append(f"re:(?!{guard})(?:{entry[3:]})")
        # an exact name of a module we now quantize: dropped
    return kept


def resolve(config: dict | None, name: str, class_name: str) -> dict | None:
    """The weights args the engine would pick for module `name` of `class_name`, or None.

    Mirrors vLLM 0.28.0 compressed_tensors get_scheme_dict (ignore first; then exact/regex name
    match over all targets in group order; then the class-name substring match), without fused
    layers. tests/test_quant_format.py checks it against vLLM's own functions.
    """
    if not config:
        return None
    if any(_matches(name, entry) for entry in config.get("ignore") or []):
        return None
    scheme: dict[str, dict] = {}
    for group in (config.get("config_groups") or {}).values():
        for target in group.get("targets", []):
            scheme[target] = group
    for target, group in scheme.items():
        if _matches(name, target):
            return group.get("weights")
    for target, group in scheme.items():
        if not target.startswith("re:") and target.lower() in class_name.lower():
            return group.get("weights")
    return None


def describes(weights: dict | None, num_bits: int, group_size: int) -> bool:
    return bool(
        weights
        and weights.get("num_bits") == num_bits
        and weights.get("type", "int") == "int"
        and weights.get("strategy") == "group"
        and weights.get("group_size") == group_size
        and weights.get("symmetric", True)
    )


def engine_class(checkpoint_module: str) -> str:
    if checkpoint_module.endswith("embed_tokens"):
        return "VocabParallelEmbedding"
    if checkpoint_module.endswith("lm_head"):
        return "ParallelLMHead"
    return "Linear"


def check_edit(old: dict | None, new: dict, modules: list[str], quantized: list[str], bits: int, group: int) -> None:
    """Raise unless `quantized` now resolve to the new format and nothing else changed resolution."""
    ours = set(with_fused(quantized))
    for module in ours:
        for name in engine_names(module):
            if not describes(resolve(new, name, engine_class(module)), bits, group):
                raise RuntimeError(f"quantization_config edit failed: {name} does not resolve to int{bits} g{group}")
    for module in with_fused(modules):
        if module in ours:
            continue
        for name in engine_names(module):
            cls = engine_class(module)
            if resolve(old, name, cls) != resolve(new, name, cls):
                raise RuntimeError(f"quantization_config edit would change how {name} is loaded")
