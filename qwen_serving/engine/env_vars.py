"""Every VLLM_* variable our patches read, declared once: name, default, parser and why.

patches/env-vars.patch, first in the series, calls `register` on vllm/envs.py's `environment_variables`,
so `vllm.envs.NAME` reads these like vLLM's own variables, `compile_factors()` keys the torch.compile
cache on them and `validate_environ` knows them; the same patch annotates them in envs.py's
TYPE_CHECKING block (tests/test_engine_env_vars.py checks that block against this table). A patch that
reads a new variable declares it here and nowhere else in envs.py.

Standard library only: vllm/envs.py imports this module while vLLM itself is being imported.
"""

from __future__ import annotations

import os
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass


def flag(raw: str) -> bool:
    """0/1, read as vLLM reads its own flags (``bool(int(...))``)."""
    return bool(int(raw))


def text(raw: str) -> str:
    return raw


def _number(raw: str, cast: Callable[[str], float], kind: str, ok: Callable[[float], bool], rule: str):
    try:
        value = cast(raw)
    except ValueError:
        raise ValueError(f"not {kind}") from None
    if not ok(value):
        raise ValueError(rule)
    return value


def count(raw: str) -> int:
    """A whole number >= 1 (a length, a number of tokens)."""
    return _number(raw, int, "an integer", lambda v: v >= 1, "must be >= 1")


def whole(raw: str) -> int:
    """A whole number >= 0 (a count of steps that may be none)."""
    return _number(raw, int, "an integer", lambda v: v >= 0, "must be >= 0")


def gib(raw: str) -> float:
    """A size in GiB, above 0 (0.125 is 128 MiB)."""
    return _number(raw, float, "a number", lambda v: 0 < v < float("inf"), "must be a number of GiB above 0")


def one_of(*choices: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        if raw not in choices:
            raise ValueError(f"valid options: {', '.join(choices)}")
        return raw

    return parse


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: str  # the text read when the variable is unset
    parse: Callable[[str], object]
    annotation: str  # its type in envs.py's TYPE_CHECKING block
    why: str

    def read(self) -> object:
        raw = os.environ.get(self.name, self.default)
        try:
            return self.parse(raw)
        except ValueError as exc:
            raise ValueError(f"{self.name}={raw!r} is not valid: {exc}") from None


DECLARED = (
    EnvVar("VLLM_SMALL_TOPK_SAMPLER", "1", flag, "bool",
           "sampler-small-topk.patch: top-k/top-p masks without the full-vocabulary sort when every row's "
           "top-k is <= 64, and MTP drafts sampled from the target's support; 0 keeps vLLM's path"),
    EnvVar("VLLM_SPEC_DECODE_ATTN", "0", flag, "bool",
           "spec-decode-attn.patch: speculative-decode verify batches on the split-KV Triton kernel "
           "(engine.attn_routing)"),
    EnvVar("VLLM_PREFILL_INT8_ATTN", "0", flag, "bool",
           "prefill-int8-attn.patch: a single request's prefill chunk on a head_dim 256 layer with int8 "
           "Q.K^T (engine.attn_routing)"),
    EnvVar("VLLM_MARLIN_INT8_INCLUDE_RE", "mlp", text, "str",
           "marlin-int8-layer-select.patch: with VLLM_MARLIN_INPUT_DTYPE=int8, the regex searched in a "
           "layer's name to pick the layers that take int8 activations (never lm_head, embed, mtp)"),
    EnvVar("VLLM_MTP_DRAFT_VOCAB", "1", one_of("0", "1"), 'Literal["0", "1"]',
           "qwen3_5-mtp-draft-vocab.patch: MTP drafts over the checkpoint's reduced draft head when it has "
           "one; 0 drafts over the full lm_head"),
    EnvVar("VLLM_V2_CUDAGRAPH_MEM_MIB", "0", text, "str",
           "hybrid-kv-groups-v2-cudagraph.patch: MiB the V2 model runner reserves for its CUDA graphs (it "
           "does not profile them; 0 lets them land on top of --gpu-memory-utilization)"),
    EnvVar("VLLM_DFLASH2_LOOKUP", "0", flag, "bool",
           "dflash2-lookup.patch: fuse the continuation of the request's own history into DFlash2's drafts "
           "(engine.spec_dflash2_lookup); 0 keeps the drafter's block"),
    EnvVar("VLLM_DFLASH2_LOOKUP_NMIN", "6", count, "int",
           "dflash2-lookup.patch: shortest suffix of the history the lookup may match"),
    EnvVar("VLLM_DFLASH2_LOOKUP_NMAX", "12", count, "int",
           "dflash2-lookup.patch: longest suffix the lookup tries (<= 64)"),
    EnvVar("VLLM_DFLASH2_LOOKUP_NSTRONG", "8", count, "int",
           "dflash2-lookup.patch: a match this long replaces the drafter's tokens on its own"),
    EnvVar("VLLM_DFLASH2_LOOKUP_AGREE", "2", count, "int",
           "dflash2-lookup.patch: a shorter match is taken only where the drafter's first AGREE tokens equal it"),
    EnvVar("VLLM_DFLASH2_LOOKUP_STICKY", "3", whole, "int",
           "dflash2-verify-block.patch: steps the long verify block is held after its flags drop, with one "
           "request in flight (engine.spec_verify_block)"),
    EnvVar("VLLM_VISION_OFFLOAD", "0", flag, "bool",
           "vision-offload.patch: the vision tower's weights in host RAM, each module copied to the GPU for its "
           "own forward (engine.vision_offload); 0 keeps the tower on the GPU"),
    EnvVar("VLLM_VISION_OFFLOAD_GIB", "0.125", gib, "float",
           "vision-offload.patch: the most GiB of the vision tower on the GPU at once (modules that fit stay there)"),
)
BY_NAME = {var.name: var for var in DECLARED}


def register(environment_variables: MutableMapping[str, Callable[[], object]]) -> None:
    """Add every declared variable to vLLM's table; refuses a name vLLM already defines."""
    clash = sorted(set(BY_NAME) & set(environment_variables))
    if clash:
        raise RuntimeError(f"vLLM already defines {', '.join(clash)}; rename ours in {__name__}")
    environment_variables.update({var.name: var.read for var in DECLARED})
