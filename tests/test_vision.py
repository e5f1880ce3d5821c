"""VISION=1 (issue #23, CPU half): the synthetic tower loads in vLLM 0.28.0's own model code and encodes images;
the plan's flags parse the way vLLM reads them; a checkpoint without the tower is refused before boot; the
memory model counts the tower (or, with VISION_OFFLOAD=1, its budget) and the encoder cache. The offload itself:
tests/test_engine_vision_offload.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from qwen_serving import knobs, memory, model, plan, vllm_028
from qwen_serving.checkpoint import synth
from qwen_serving.plan import PlanError, Probe
from tests.helpers.tiny_checkpoint import REPO, make_tiny

SMALL, CAPPED = (96, 128), (2000, 2000)  # under the processor's minimum (scaled up); over the 2048-token cap


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny(tmp_path_factory)


def test_the_tiny_tower_encodes_images_in_vllms_model_code(tiny):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    sizes = [f"{h}x{w}" for h, w in (SMALL, CAPPED)]
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "helpers" / "vision_encode.py"), str(tiny), *sizes],
                          env=env, capture_output=True, text=True, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-6000:]
    result = json.loads(lines[0].removeprefix("RESULT "))
    vision = synth.TINY.vision
    assert result["tower"] == "Qwen3_VisionTransformer"  # built, not vLLM's skipped StageMissingLayer
    assert result["tower_tensors"] == len(model.vision_tensor_shapes(vision))
    assert result["limit_mm_per_prompt"] == {"image": 1} and result["max_pixels"] == knobs.VISION_MAX_PIXELS
    patch_values = vision["in_channels"] * vision["temporal_patch_size"] * vision["patch_size"] ** 2
    merge = vision["spatial_merge_size"] ** 2
    for image in result["images"]:
        t, h, w = image["grid_thw"]
        assert image["patches"] == [t * h * w, patch_values]
        assert image["shape"] == [t * h * w // merge, vision["out_hidden_size"]]  # one row per 2 x 2 patches
        assert image["dtype"] == "torch.bfloat16" and image["finite"] and image["std"] > 0.1
    small, capped = result["images"]
    assert small["shape"][0] < capped["shape"][0] <= knobs.VISION_IMAGE_TOKENS < CAPPED[0] * CAPPED[1] // 32**2


def _vision_argv(vllm_cli, probe, env):
    p = plan.build("single", {"VISION": "1", **env}, probe)
    ns, ea = vllm_cli.serve(list(p.argv[1:]))
    return p, ea


@pytest.fixture
def probe(tmp_path) -> Probe:
    return Probe(repo=tmp_path, kv_dtypes=vllm_028.KV_CACHE_DTYPES)


def test_vision_argv_parses_with_vllms_parser_and_extra_args_override_it(vllm_cli, probe):
    p, ea = _vision_argv(vllm_cli, probe, {})
    assert ea.language_model_only is False
    assert ea.limit_mm_per_prompt == {"image": 1}
    assert ea.mm_processor_kwargs == {"max_pixels": knobs.VISION_MAX_PIXELS}
    _, ea = _vision_argv(vllm_cli, probe, {"EXTRA_ARGS": "--limit-mm-per-prompt '{\"image\": 2}' "
                                                        "--mm-processor-kwargs '{\"max_pixels\": 1048576}'"})
    assert ea.limit_mm_per_prompt == {"image": 2} and ea.mm_processor_kwargs == {"max_pixels": 1048576}
    _, ea = vllm_cli.serve(list(plan.build("single", {}, probe).argv[1:]))
    assert ea.language_model_only is True


def _checkpoint(probe: Probe, tensors: list[str], processor: bool = True) -> str:
    path = probe.repo / "ckpt"
    path.mkdir()
    (path / "config.json").write_text("{}")
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": dict.fromkeys(tensors, "a")}))
    if processor:
        (path / "preprocessor_config.json").write_text("{}")
    return str(path)


def test_vision_refuses_a_checkpoint_without_the_tower_before_boot(probe):
    text_only = _checkpoint(probe, ["lm_head.weight", "model.language_model.norm.weight"])
    with pytest.raises(PlanError, match=r"VISION=1 needs the vision tower, and .*ckpt has no model\.visual\.\*"):
        plan.build("single", {"VISION": "1", "MODEL": text_only}, probe)
    assert plan.build("single", {"MODEL": text_only}, probe).value("VISION") == 0  # text-only serving is fine


def test_vision_needs_the_image_processor_config(tmp_path):
    probe = Probe(repo=tmp_path, kv_dtypes=vllm_028.KV_CACHE_DTYPES)
    path = _checkpoint(probe, ["model.visual.patch_embed.proj.weight"], processor=False)
    with pytest.raises(PlanError, match="preprocessor_config.json"):
        plan.build("single", {"VISION": "1", "MODEL": path}, probe)
    (tmp_path / "ckpt" / "preprocessor_config.json").write_text("{}")
    assert plan.build("single", {"VISION": "1", "MODEL": path}, probe).value("VISION") == 1


def test_the_synthetic_checkpoint_passes_the_vision_check(tiny, tmp_path):
    probe = Probe(repo=tmp_path, kv_dtypes=vllm_028.KV_CACHE_DTYPES)
    p = plan.build("single", {"VISION": "1", "MODEL": str(tiny)}, probe)
    assert "--language-model-only" not in p.argv


def test_vision_offload_is_exported_for_the_patch_and_leaves_the_argv_alone(vllm_cli, probe):
    offloaded, ea = _vision_argv(vllm_cli, probe, {})
    assert offloaded.env[knobs.VISION_OFFLOAD_ENV] == "1"
    assert float(offloaded.env[knobs.VISION_OFFLOAD_ENV + "_GIB"]) == knobs.VISION_OFFLOAD_GIB
    assert ea.language_model_only is False and ea.limit_mm_per_prompt == {"image": 1}
    whole, _ = _vision_argv(vllm_cli, probe, {"VISION_OFFLOAD": "0"})
    assert whole.env[knobs.VISION_OFFLOAD_ENV] == "0" and knobs.VISION_OFFLOAD_ENV + "_GIB" not in whole.env
    assert whole.argv == offloaded.argv  # the offload is the patch's business: vLLM's flags are the same
    budget, _ = _vision_argv(vllm_cli, probe, {"VISION_OFFLOAD_GIB": "0.5"})
    assert budget.env[knobs.VISION_OFFLOAD_ENV + "_GIB"] == "0.5"
    for mode in knobs.MODES:  # the tower is not there: nothing to offload, nothing exported
        text = plan.build(mode, {}, probe)
        assert text.value("VISION_OFFLOAD") == 0 and not any(k.startswith(knobs.VISION_OFFLOAD_ENV) for k in text.env)
    assert plan.build("batch", {"VISION": "1"}, probe).env[knobs.VISION_OFFLOAD_ENV] == "1"  # batch as single


def test_vision_offload_without_the_tower_and_a_budget_below_the_floor_are_refused(probe):
    with pytest.raises(PlanError, match=r"VISION_OFFLOAD=1 streams the vision tower .* set VISION=1 for images, or "
                                        r"unset VISION_OFFLOAD"):
        plan.build("single", {"VISION_OFFLOAD": "1"}, probe)
    floor = model.vision_offload_floor_bytes() / memory.GiB
    assert knobs.VISION_OFFLOAD_MIN_GIB - 0.001 < floor <= knobs.VISION_OFFLOAD_MIN_GIB
    with pytest.raises(PlanError, match=rf"VISION_OFFLOAD_GIB='0.09': 0.09 GiB is below {knobs.VISION_OFFLOAD_MIN_GIB}"):
        plan.build("single", {"VISION": "1", "VISION_OFFLOAD_GIB": "0.09"}, probe)
    assert plan.build("single", {"VISION": "1", "VISION_OFFLOAD_GIB": str(knobs.VISION_OFFLOAD_MIN_GIB)}, probe)
    unused = plan.build("single", {"VISION": "1", "VISION_OFFLOAD": "0", "VISION_OFFLOAD_GIB": "0.5"}, probe)
    assert any("VISION_OFFLOAD_GIB is set but VISION_OFFLOAD=0" in w for w in unused.warnings)


def test_memory_counts_the_offload_budget_instead_of_the_tower(probe):
    whole = memory.weights_bytes("dflash2", vision=True)
    offloaded = memory.weights_bytes("dflash2", vision=True, vision_offload_gib=0.125)
    assert whole - offloaded == pytest.approx(memory.VISION_TOWER_BYTES - 0.125 * memory.GiB)
    assert memory.weights_bytes("dflash2", vision=True, vision_offload_gib=2.0) == whole  # never more than the tower
    assert memory.weights_bytes("dflash2", vision=False, vision_offload_gib=0.125) == memory.weights_bytes("dflash2")
    assert memory.weights("off", vision=True, vision_offload_gib=0.25).whole == 0.25 * memory.GiB  # on every card
    line = next(x for x in plan.explain_lines(plan.build("single", {"VISION": "1"}, probe), probe)
                if x.startswith("vision tower "))
    assert "0.12 GiB + 20 MiB encoder cache" in line and "0.86 GiB of BF16 weights in host RAM" in line
    for mode in knobs.MODES:  # the plan's weights take the budget
        on = plan.build(mode, {"VISION": "1"}, probe).derived
        off = plan.build(mode, {"VISION": "1", "VISION_OFFLOAD": "0"}, probe).derived
        on_gib, off_gib = (float(next(d.value for d in ds if d.name == "weights on GPU").split()[0]) for ds in (on, off))
        assert off_gib - on_gib == pytest.approx((memory.VISION_TOWER_BYTES - 0.125 * memory.GiB) / memory.GiB, abs=0.011)


def test_auto_pool_grows_by_what_the_offload_keeps_off_the_card(tmp_path):
    probe = Probe(repo=tmp_path, kv_dtypes=vllm_028.KV_CACHE_DTYPES, free_vram=int(23.6 * memory.GiB),
                  total_vram=24 * memory.GiB)
    whole = plan.build("single", {"KV_MEM": "auto", "VISION": "1", "VISION_OFFLOAD": "0"}, probe)
    offloaded = plan.build("single", {"KV_MEM": "auto", "VISION": "1"}, probe)
    assert offloaded.kv_mem - whole.kv_mem == pytest.approx(memory.VISION_TOWER_BYTES - 0.125 * memory.GiB,
                                                            abs=memory.MiB)


def test_memory_counts_the_tower_and_the_encoder_cache(probe):
    # vLLM keeps max(--max-num-batched-tokens, one image's tokens) encoder rows of the text width in BF16
    assert memory.encoder_cache_bytes(2048, 2048) == 2048 * 5120 * 2
    assert memory.encoder_cache_bytes(8192, 2048) == 8192 * 5120 * 2
    free = int(23.6 * memory.GiB)
    text = memory.weights_bytes("mtp", vision=False)
    with_tower = memory.weights_bytes("mtp", vision=True)
    assert with_tower - text == pytest.approx(memory.VISION_TOWER_BYTES)
    cache = memory.encoder_cache_bytes(memory.PREFILL_CHUNK, knobs.VISION_IMAGE_TOKENS)
    assert memory.auto_kv_mem(free, text) - memory.auto_kv_mem(free, with_tower, encoder_cache=cache) == \
        pytest.approx(memory.VISION_TOWER_BYTES + cache, abs=memory.MiB)
    lines = plan.explain_lines(plan.build("single", {"VISION": "1", "VISION_OFFLOAD": "0"}, probe), probe)
    tower = [line for line in lines if line.startswith("vision tower ")]
    assert len(tower) == 1 and "0.86 GiB + 20 MiB encoder cache" in tower[0] and "2,048 tokens" in tower[0]
    assert not [line for line in plan.explain_lines(plan.build("single", {}, probe), probe)
                if line.startswith("vision tower ")]


def test_auto_pool_takes_the_encoder_cache_out(tmp_path):
    probe = Probe(repo=tmp_path, kv_dtypes=vllm_028.KV_CACHE_DTYPES, free_vram=int(23.6 * memory.GiB),
                  total_vram=24 * memory.GiB)
    text = plan.build("single", {"KV_MEM": "auto"}, probe)
    vision = plan.build("single", {"KV_MEM": "auto", "VISION": "1", "VISION_OFFLOAD": "0"}, probe)
    cache = memory.encoder_cache_bytes(memory.PREFILL_CHUNK, knobs.VISION_IMAGE_TOKENS)
    assert text.kv_mem - vision.kv_mem == pytest.approx(memory.VISION_TOWER_BYTES + cache, abs=memory.MiB)
    assert any(f"{cache / memory.GiB:.2f} GiB encoder cache" in note for note in vision.notes)
    assert not any("encoder cache" in note for note in text.notes)


def _smoke_api(monkeypatch, post_answer, text_only_prompt_tokens=12):
    sys.path.insert(0, str(REPO / "bench"))
    import api_smoke

    sent = []
    monkeypatch.setattr(api_smoke.Api, "post", lambda self, path, body: sent.append(body) or post_answer)
    monkeypatch.setattr(api_smoke.Api, "chat", lambda self, **body: sent.append(body) or {
        "usage": {"prompt_tokens": text_only_prompt_tokens, "completion_tokens": 8}})
    return api_smoke, object.__new__(api_smoke.Api), sent


def test_api_smoke_image_request_skips_without_the_tower_and_counts_image_tokens(monkeypatch):
    refusal = (400, {"error": {"message": "At most 0 image(s) may be provided in one prompt."}})
    api_smoke, api, sent = _smoke_api(monkeypatch, refusal)
    with pytest.raises(api_smoke.Inconclusive, match="without the vision tower"):
        api_smoke.check_image(api)
    (part,) = [p for p in sent[0]["messages"][0]["content"] if p["type"] == "image_url"]
    assert part["image_url"]["url"].startswith("data:image/png;base64,")
    api_smoke, api, _ = _smoke_api(monkeypatch, (200, {"usage": {"prompt_tokens": 78, "completion_tokens": 8}}))
    assert "became 66 prompt tokens" in api_smoke.check_image(api)
    api_smoke, api, _ = _smoke_api(monkeypatch, (200, {"usage": {"prompt_tokens": 14, "completion_tokens": 8}}))
    with pytest.raises(AssertionError, match="not expanded"):  # the image was dropped, not encoded
        api_smoke.check_image(api)
