"""vLLM 0.28.0 builds and loads the prepared tiny checkpoint on CPU: target model and MTP drafter.

vLLM's own `initialize_model` and `load_weights` take the prepared tensors; its loader's
completeness check must find every parameter filled, and the int8 modules must come up with the
compressed-tensors int8 methods holding exactly the bytes prepare/ wrote (the linear kernel is
forced to Marlin, the one CUDA picks: the CPU platform has none for int8). embed_tokens is only
quantized in the engine once patches/qwen3_5-embed-quant.patch is applied (tests/run.sh runs
against the patched copy and says so in QS_PATCHED_VLLM); without it the embedding step is left out.
With patches/qwen3_5-mtp-draft-vocab.patch in the series, the drafter's int8 draft head is checked too.
Runs in a subprocess: it stubs vLLM's missing compiled ops and initialises torch.distributed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

from qwen_serving.checkpoint import steps
from tests.helpers.tiny_checkpoint import REPO, make_tiny, run

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


def test_vllm_loads_the_prepared_checkpoint(tmp_path_factory, tmp_path):
    model = tmp_path / "tiny"
    shutil.copytree(make_tiny(tmp_path_factory), model)
    patched = bool(os.environ.get("QS_PATCHED_VLLM"))
    series = (REPO / "patches" / "series").read_text().split()
    draft_head = patched and "qwen3_5-mtp-draft-vocab.patch" in series
    for step in ("quant_lm_head", "quant_mtp", *(["quant_embed"] if patched else [])):
        assert run(model, step) == 0
    ids = list(range(5, 4096, 16))
    if draft_head:
        assert steps.run_step(model, "draft_vocab", lambda m: steps.build_draft_head(m, ids, "test")) == 0
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(REPO)]))}
    proc = subprocess.run([sys.executable, "-c", _LOAD, str(model)], env=env, capture_output=True, text=True,
                          timeout=600, cwd=REPO)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-6000:]
    report = json.loads(lines[-1][len("RESULT "):])
    assert report["lm_head_scheme"] == "CompressedTensorsWNA16" and report["lm_head_bits"] == 8, report
    assert report["drafter_lm_head_bits"] == 8 and report["mtp_qkv_bits"] == 8 and report["mtp_fc_bits"] == 8, report
    assert report["lm_head_bytes_equal"] and report["mtp_qkv_bytes_equal"], report
    if patched:
        assert report["embed_method"] == report["drafter_embed_method"] == "CompressedTensorsEmbeddingWNA16Int", report
        assert report["embed_bytes_equal"], report
    if draft_head:
        assert report["draft_head_bits"] == 8 and report["draft_head_bytes_equal"], report
        assert report["draft_ids"] == ids
