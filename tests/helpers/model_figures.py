"""What the 27B's dimensions feed: the memory model's figures and the synthetic generator's outputs.

`python -m tests.helpers.model_figures > tests/fixtures/model-figures.json` wrote the fixture before
the dimensions moved into qwen_serving/model.py; tests/test_model.py computes the same figures now and
compares, so the move changed no pool size, weight size or synthetic checkpoint. The fixture predates the
drafter's window block (hybrid-kv-padded-window-pages.patch, 2026-12-03), which the model then took as the
attention block for every cache: DFlash2's per-token-head shapes differ from it in the figures that count window
blocks, and the test says which.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import sys

KV_MEM = 5_583_457_484  # the spec's pinned 5.2 GiB pool (tests/test_memory.py)
FREE_VRAM = int(23.6 * (1 << 30))  # a headless 24 GiB card
KV_DTYPES = ("auto", "fp8", "int8_per_token_head", "int4_per_token_head")
STATE_DTYPES = ("float32", "bfloat16", "float16")
# CacheShape keywords besides the dtypes: every spec mode and each switch that changes the layout
SHAPES: tuple[dict[str, object], ...] = (
    {},
    {"prefix_cache": True},
    {"spec": "mtp", "spec_tokens": 4},
    {"spec": "mtp", "spec_tokens": 4, "prefix_cache": True, "max_num_batched_tokens": 8192},
    {"spec": "mtp", "spec_tokens": 2, "conv_spec_rows": False},
    {"spec": "dflash2", "spec_tokens": 7},
    {"spec": "dflash2", "spec_tokens": 7, "kv_group_fix": False},
    {"spec": "dflash2", "spec_tokens": 15, "prefix_cache": True},
    {"spec": "dflash2", "spec_tokens": 7, "async_scheduling": True},
)


def memory_figures() -> dict[str, object]:
    from qwen_serving import memory

    shapes = []
    for extra, kv, state in itertools.product(SHAPES, KV_DTYPES, STATE_DTYPES):
        shape = memory.CacheShape(kv_dtype=kv, state_dtype=state, **extra)  # type: ignore[arg-type]
        fits = shape.fits(KV_MEM, 65_536)
        shapes.append({
            "shape": {"kv_dtype": kv, "state_dtype": state, **extra},
            "block_size": shape.block_size, "page_bytes": shape.page_bytes, "groups": shape.groups,
            "resident_blocks": shape.resident_blocks(), "blocks_per_request": shape.blocks_per_request(65_536),
            "pool_tokens": shape.pool_tokens(KV_MEM, 65_536) if fits else None,
            "longest_context": shape.longest_context(KV_MEM), "residents": shape.residents(KV_MEM, 128),
            "context_bytes_per_token": shape.context_bytes_per_token(),
        })
    weights = {f"{spec} fast={fast} vision={vision}": memory.weights_bytes(spec, fast, vision)
               for spec, fast, vision in itertools.product(("off", "mtp", "dflash2"), (True, False), (True, False))}
    states = {f"{dtype} k={k}": memory.gdn_state_bytes(dtype, k) for dtype in STATE_DTYPES for k in (0, 4, 7, 15)}
    return {
        "kv_bytes_per_token_layer": {kv: memory.kv_bytes_per_token_layer(kv) for kv in KV_DTYPES},
        "gdn_state_bytes": states,
        "body_params": memory.body_params(), "mtp_params": memory.mtp_params(),
        "weights_bytes": weights,
        "auto_kv_mem": memory.auto_kv_mem(FREE_VRAM, memory.weights_bytes("dflash2")),
        "cache_shapes": shapes,
    }


def _digest(obj: object) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def synth_figures() -> dict[str, dict[str, str]]:
    """Per size and depth: digests of config.json and of the tensor plan (names, shapes, dtypes in order)."""
    from qwen_serving.checkpoint import synth
    from qwen_serving.checkpoint.synth_tokenizer import special_token_ids

    ids = special_token_ids()
    out = {}
    for size, layers in (("tiny", 4), ("tiny", 8), ("shape", 4), ("full", synth.FULL_LAYERS)):
        dims = synth.SIZES[size]
        # the text tensors: the vision tower joined the plan after the fixture (issue #23; tests/test_synth.py)
        plan = [(name, list(shape), str(dtype)) for entry in synth.checkpoint_plan(dims, layers)
                for name, shape, dtype in entry.tensors() if not name.startswith(synth.VISUAL)]
        out[f"{size} {layers}"] = {"config": _digest(synth.model_config(dims, layers, ids)), "plan": _digest(plan)}
    return out


def figures() -> dict[str, object]:
    return {"memory": memory_figures(), "synth": synth_figures()}


if __name__ == "__main__":
    json.dump(figures(), sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")
