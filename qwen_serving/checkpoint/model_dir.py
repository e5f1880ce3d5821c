"""A Hugging Face model directory as the prepare steps see it: config, shards, index, checks.

`ModelDir.open` refuses anything that is not a complete qwen3_5 safetensors checkpoint, with a
message that says what is wrong and what to run; nothing here writes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from qwen_serving.checkpoint.safetensors_io import SafetensorsError, SafetensorsFile

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
MANIFEST_NAME = "prepared.json"
QWEN35_MODEL_TYPES = ("qwen3_5", "qwen3_5_text")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")


class CheckpointError(ValueError):
    """Wrong or incomplete input: the message is meant for the user."""


def read_json(path: Path, what: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError as e:
        raise CheckpointError(f"{what} not found: {path}") from e
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{what} is unreadable ({path}): {e}") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{what} is not a JSON object: {path}")
    return data


def text_config(config: dict) -> dict:
    """The language model's config (Qwen3.5 nests it under text_config in the VL wrapper)."""
    return config.get("text_config") or config


def check_qwen35(config: dict, path: Path) -> None:
    model_type = config.get("model_type")
    inner = text_config(config).get("model_type")
    if model_type not in QWEN35_MODEL_TYPES and inner not in QWEN35_MODEL_TYPES:
        raise CheckpointError(
            f"{path} is not a qwen3_5 checkpoint (model_type={model_type!r}"
            + (f", text_config.model_type={inner!r}" if inner and inner != model_type else "")
            + "); these scripts only prepare Qwen3.5/3.8 checkpoints"
        )


@dataclass
class ModelDir:
    path: Path
    config: dict
    weight_map: dict[str, str]  # tensor name -> shard file name
    has_index: bool
    shards: dict[str, SafetensorsFile] = field(default_factory=dict)

    @classmethod
    def open(cls, path: str | Path, *, require_qwen35: bool = True) -> ModelDir:
        path = Path(path)
        if not path.exists():
            raise CheckpointError(f"model directory not found: {path}")
        if not path.is_dir():
            raise CheckpointError(f"not a directory: {path}")
        config = read_json(path / CONFIG_NAME, "config.json")
        if require_qwen35:
            check_qwen35(config, path)
        index_path = path / INDEX_NAME
        if index_path.exists():
            index = read_json(index_path, "the safetensors index")
            weight_map = index.get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise CheckpointError(f"{index_path} has no weight_map")
            has_index = True
        elif (path / SINGLE_NAME).exists():
            weight_map = dict.fromkeys(SafetensorsFile(path / SINGLE_NAME).tensors, SINGLE_NAME)
            has_index = False
        else:
            raise CheckpointError(f"{path} has neither {INDEX_NAME} nor {SINGLE_NAME}: incomplete download?")
        model = cls(path, config, dict(weight_map), has_index)
        model._open_shards()
        return model

    def _open_shards(self) -> None:
        problems: list[str] = []
        for name in sorted(set(self.weight_map.values())):
            shard_path = self.path / name
            if not shard_path.exists():
                problems.append(f"{name} is missing")
                continue
            try:
                shard = SafetensorsFile(shard_path)
                shard.check_complete()
            except SafetensorsError as e:
                problems.append(str(e))
                continue
            self.shards[name] = shard
        for name, shard in self.shards.items():
            listed = {t for t, s in self.weight_map.items() if s == name}
            present = set(shard.tensors)
            if listed - present:
                problems.append(f"{name} lacks {len(listed - present)} tensor(s) the index lists, e.g. {sorted(listed - present)[0]}")
            if present - listed:
                # vLLM reads every tensor of a listed shard: an unlisted one would be loaded anyway
                problems.append(f"{name} holds {len(present - listed)} tensor(s) the index does not list, e.g. {sorted(present - listed)[0]}")
        if problems:
            shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
            raise CheckpointError(f"{self.path} is not a complete checkpoint: {shown} (re-run prepare/download.py)")

    def info(self, tensor: str):
        return self.shards[self.weight_map[tensor]].tensors[tensor]

    def has(self, tensor: str) -> bool:
        return tensor in self.weight_map

    def module_tensors(self, module: str) -> list[str]:
        prefix = module + "."
        return sorted(t for t in self.weight_map if t.startswith(prefix) and "." not in t[len(prefix) :])

    @property
    def quantization_config(self) -> dict | None:
        return self.config.get("quantization_config")

    def manifest(self) -> dict:
        path = self.path / MANIFEST_NAME
        return read_json(path, "prepared.json") if path.exists() else {}

    def close(self) -> None:
        for shard in self.shards.values():
            shard.close()


def find_embed_tokens(model: ModelDir) -> str:
    """Module name of the main embedding table (VL wrapper or text-only naming)."""
    for module in ("model.language_model.embed_tokens", "model.embed_tokens"):
        if any(model.has(f"{module}.{s}") for s in ("weight", "weight_packed")):
            return module
    raise CheckpointError(f"{model.path}: no embed_tokens tensor (model.language_model.embed_tokens.weight)")


def tokenizer_present(path: Path) -> bool:
    return any((path / name).exists() for name in TOKENIZER_FILES)
