"""Decode-step breakdown (qwen_serving.stepprofile) on a synthetic Kineto trace, values derived by hand.

bench/fixtures/step_trace_c1.json: one prefill step, then six decode steps 10 ms apart, each with
the same kernels (offsets from the step start, microseconds):
  Marlin 100+1000, GDN 1200+500, Marlin 1800+1000, flash attention 2900+400, RMS norm 3400+300,
  Marlin 3800+1000, nvjet (lm_head) 4900+1500, div 6500+200, argmax 6800+100, DtoH copy 7000+50.
CPU-side annotations run 3 ms ahead of the GPU ones; the GPU ones must be used.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from qwen_serving import stepprofile as sp

FIX = Path(__file__).resolve().parents[1] / "bench" / "fixtures"


@pytest.fixture(scope="module")
def trace() -> dict:
    return sp.read_trace(FIX / "step_trace_c1.json")


@pytest.mark.parametrize("name,category", [
    ("void marlin::Marlin<(vllm::ScalarTypeId)4, 256>(MarlinParams)", "marlin_gemm"),
    ("machete::Kernel<...>", "marlin_gemm"),
    ("fused_recurrent_gated_delta_rule_packed_decode_kernel", "gdn"),
    ("_causal_conv1d_update_kernel", "gdn"),
    ("chunk_gated_delta_rule_fwd_kernel_h_blockdim64", "gdn"),
    ("void flash::flash_fwd_splitkv_kernel<...>", "attention"),
    ("void vllm::reshape_and_cache_flash_kernel<...>", "attention"),
    ("triton_poi_fused_rotary_emb_3", "attention"),
    ("nvjet_tst_64x8_64x16_4x1_v_bz_TNT", "dense_gemm"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32", "dense_gemm"),
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "norm_act"),
    ("void vllm::act_and_mul_kernel<...>", "norm_act"),
    ("void at::native::reduce_kernel<ArgMaxOps<float>>", "sampling"),
    ("Memcpy DtoH (Device -> Pinned)", "memory"),
    ("void at::native::vectorized_elementwise_kernel<4, DivFunctor>", "other"),
])
def test_categorize(name, category):
    assert sp.categorize(name) == category


def test_decode_step_breakdown(trace):
    prof = sp.profile_steps(trace, batch=1, skip=2)
    # 6 decode marks -> 5 decode-to-decode windows (the prefill step is not one); 2 skipped
    assert prof["steps"] == 3
    assert prof["kernels"] == 10
    assert prof["marlin_gemm"] == pytest.approx(3.0)
    assert prof["lm_head"] == pytest.approx(1.5)  # the step's last GEMM, not counted as dense_gemm
    assert prof["dense_gemm"] == 0.0
    assert prof["gdn"] == pytest.approx(0.5)
    assert prof["attention"] == pytest.approx(0.4)
    assert prof["norm_act"] == pytest.approx(0.3)
    # div, argmax and the token copy come after the logits GEMM: the sampler's 0.2 + 0.1 + 0.05
    assert prof["sampling"] == pytest.approx(0.35)
    assert prof["busy"] == pytest.approx(6.05)
    # first kernel at 0.1 ms, last ends at 7.05 ms -> 6.95 ms span, 0.9 ms of it idle
    assert prof["gap_launch"] == pytest.approx(0.9)
    assert prof["gap_host"] == pytest.approx(10.0 - 6.95)
    assert prof["period"] == pytest.approx(10.0)
    parts = sum(prof[c] for c in sp.CATEGORIES) + prof["gap_launch"] + prof["gap_host"]
    assert parts == pytest.approx(prof["period"])


def test_overlapping_streams_count_once_in_busy():
    kernels = [sp.Kernel("marlin a", 0.0, 1000.0), sp.Kernel("flash b", 500.0, 1000.0),
               sp.Kernel("rms_norm", 2000.0, 500.0)]
    b = sp.step_breakdown(kernels, 0.0, 4000.0)
    assert b["busy"] == pytest.approx(2.0)  # [0, 1.5] and [2.0, 2.5]
    assert b["gap_launch"] == pytest.approx(0.5)
    assert b["gap_host"] == pytest.approx(1.5)
    assert b["lm_head"] == pytest.approx(1.0)  # the only GEMM is the last one


def test_no_matching_steps_names_what_was_seen(trace):
    with pytest.raises(ValueError, match=r"no decode steps with 64 requests.*\(0, 1\)"):
        sp.profile_steps(trace, batch=64)


def test_cpu_annotations_are_the_fallback(trace):
    cpu_only = {"traceEvents": [e for e in trace["traceEvents"] if e.get("cat") != "gpu_user_annotation"]}
    _, marks = sp.trace_events(cpu_only)
    assert marks[1].start_us == 1_000_000 + 30_000 - 3_000
    prof = sp.profile_steps(cpu_only, batch=1)
    assert prof["period"] == pytest.approx(10.0)  # the period survives the shift, the split does not matter here


REAL_27B = {  # the text config shapes of the real checkpoint (issue 3 / the synth `full` size)
    "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 16,
    "linear_num_value_heads": 48, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "num_key_value_heads": 4, "head_dim": 256,
}


def test_state_and_kv_bytes():
    b = sp.state_bytes(REAL_27B, batch=1, ctx_tokens=1000)
    # 48 GDN layers x (48 x 128 x 128 x 2 B) read + written
    assert b["gdn"] == 2 * 48 * 48 * 128 * 128 * 2 == 150_994_944
    # 16 attention layers x 1000 tokens x K+V x 4 heads x 256 x 2 B
    assert b["attention"] == 16 * 1000 * 2 * 4 * 256 * 2
    assert sp.state_bytes(REAL_27B, batch=64, ctx_tokens=1000)["gdn"] == 64 * b["gdn"]


def test_weight_bytes_from_a_safetensors_header(tmp_path):
    header = {
        "__metadata__": {"format": "pt"},
        "model.layers.0.mlp.down_proj.weight_packed": {"dtype": "I32", "shape": [5120, 2176], "data_offsets": [0, 0]},
        "model.layers.0.mlp.down_proj.weight_scale": {"dtype": "F16", "shape": [5120, 136], "data_offsets": [0, 0]},
        "model.layers.0.mlp.down_proj.weight_shape": {"dtype": "I64", "shape": [2], "data_offsets": [0, 0]},
        "model.layers.0.input_layernorm.weight": {"dtype": "BF16", "shape": [5120], "data_offsets": [0, 0]},
        "lm_head.weight": {"dtype": "BF16", "shape": [248320, 5120], "data_offsets": [0, 0]},
        "model.embed_tokens.weight": {"dtype": "BF16", "shape": [248320, 5120], "data_offsets": [0, 0]},
        "mtp.fc.weight": {"dtype": "BF16", "shape": [5120, 10240], "data_offsets": [0, 0]},
    }
    raw = json.dumps(header).encode()
    path = tmp_path / "model-00001-of-00001.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)
    tensors = sp.read_safetensors_header(path)
    assert "__metadata__" not in tensors
    wb = sp.weight_bytes(tensors)
    assert wb["marlin_gemm"] == 5120 * 2176 * 4 + 5120 * 136 * 2 + 2 * 8
    assert wb["lm_head"] == wb["embed"] == 248320 * 5120 * 2
    assert wb["dense"] == 5120 * 2
    assert wb["mtp"] == 5120 * 10240 * 2


def test_bandwidth_table():
    t = sp.bandwidth_table({"marlin_gemm": 5.0, "lm_head": 0.0}, {"marlin_gemm": 15_000_000_000, "lm_head": 10},
                           device_gbps=4000.0)
    m = t["marlin_gemm"]
    assert m["achieved_gbps"] == pytest.approx(3000.0)  # 15 GB in 5 ms
    assert m["roofline_ms"] == pytest.approx(3.75)  # 15 GB at 4,000 GB/s
    assert m["fraction_of_device"] == pytest.approx(0.75)
    assert t["lm_head"]["achieved_gbps"] == 0.0  # no time measured: nothing to divide
