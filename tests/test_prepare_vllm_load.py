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

import os
import shutil

from qwen_serving.checkpoint import steps
from tests.helpers.prepared_vllm_load import load_report
from tests.helpers.tiny_checkpoint import REPO, make_tiny, run


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
    report = load_report(model)  # the load script lives in tests/helpers (tests/test_drafter.py runs it too)
    assert report["lm_head_scheme"] == "CompressedTensorsWNA16" and report["lm_head_bits"] == 8, report
    assert report["drafter_lm_head_bits"] == 8 and report["mtp_qkv_bits"] == 8 and report["mtp_fc_bits"] == 8, report
    assert report["lm_head_bytes_equal"] and report["mtp_qkv_bytes_equal"], report
    if patched:
        assert report["embed_method"] == report["drafter_embed_method"] == "CompressedTensorsEmbeddingWNA16Int", report
        assert report["embed_bytes_equal"], report
    if draft_head:
        assert report["draft_head_bits"] == 8 and report["draft_head_bytes_equal"], report
        assert report["draft_ids"] == ids
