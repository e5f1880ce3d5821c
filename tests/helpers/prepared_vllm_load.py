"""Load a prepared (tiny) checkpoint with vLLM 0.28.0's own target and MTP drafter on the CPU, in a subprocess,
and report what the lm_head, embedding, MTP and draft head came up as (tests/test_prepare_vllm_load.py,
tests/test_drafter.py). The subprocess stubs vLLM's missing compiled ops and initialises torch.distributed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

_LOAD = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    from qwen_serving.engine import cpu_compat
    cpu_compat.install()
    import torch
    cpu_compat.inspect_models_in_process()
    from safetensors import safe_open
    import vllm.model_executor.layers.quantization.compressed_tensors.schemes.compressed_tensors_wNa16 as wna16
    from tests.helpers.vllm_cpu_models import engine_config, load_models, start_cpu_world
    # the CPU platform has no int8 weight-only kernel; pick Marlin, what a CUDA GPU runs (loading
    # only needs create_weights, and Marlin's repacking is not reached here)
    wna16.choose_mp_linear_kernel = lambda config: wna16.MarlinLinearKernel

    path = Path(sys.argv[1])
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    stored = {}
    for shard in sorted(set(index.values())):
        with safe_open(str(path / shard), framework="pt") as f:
            stored.update({name: f.get_tensor(name) for name in f.keys()})
    config = engine_config(path, num_speculative_tokens=2, max_model_len=512)
    start_cpu_world(config)
    result = {name: model for name, (_, model) in load_models(config, stored.items).items()}
    target, drafter = result["Qwen3_5ForConditionalGeneration"], result["Qwen3_5MTP"]
    lm = target.language_model
    mtp_qkv = drafter.model.layers[0].self_attn.qkv_proj
    packed = torch.cat([stored[f"mtp.layers.0.self_attn.{p}.weight_packed"] for p in ("q_proj", "k_proj", "v_proj")])
    report = {
        "lm_head_scheme": type(getattr(lm.lm_head, "scheme", None)).__name__,
        "lm_head_bits": getattr(getattr(lm.lm_head, "scheme", None), "num_bits", None),
        "lm_head_bytes_equal": torch.equal(lm.lm_head.weight_packed.data, stored["lm_head.weight_packed"]),
        "embed_method": type(lm.model.embed_tokens.quant_method).__name__,
        "drafter_embed_method": type(drafter.model.embed_tokens.quant_method).__name__,
        "drafter_lm_head_bits": getattr(getattr(drafter.lm_head, "scheme", None), "num_bits", None),
        "mtp_qkv_bits": getattr(getattr(mtp_qkv, "scheme", None), "num_bits", None),
        "mtp_qkv_bytes_equal": torch.equal(mtp_qkv.weight_packed.data, packed),
        "mtp_fc_bits": getattr(getattr(drafter.model.fc, "scheme", None), "num_bits", None),
    }
    head = getattr(drafter.model, "draft_lm_head", None)
    if head is not None:
        report["draft_head_bits"] = getattr(getattr(head, "scheme", None), "num_bits", None)
        report["draft_head_bytes_equal"] = torch.equal(head.weight_packed.data, stored["mtp.draft_lm_head.weight_packed"])
        report["draft_ids"] = drafter.model.draft_vocab.target_ids.tolist()
    key = "model.language_model.embed_tokens.weight_packed"
    if key in stored:
        report["embed_bytes_equal"] = torch.equal(lm.model.embed_tokens.weight_packed.data, stored[key])
    print("RESULT " + json.dumps(report))
    """
)


def load_report(model: Path) -> dict:
    """The RESULT line of _LOAD run on `model` (asserts the load itself succeeded)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(REPO)]))}
    proc = subprocess.run([sys.executable, "-c", _LOAD, str(model)], env=env, capture_output=True, text=True,
                          timeout=600, cwd=REPO)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(lines[-1][len("RESULT "):])
