"""Decode-step breakdown (bench.step_analysis) on a synthetic Kineto trace, values derived by hand.

bench/fixtures/step_trace_c1.json: one prefill step, then six decode steps 10 ms apart, each with
the same kernels (offsets from the step start, microseconds):
  Marlin 100+1000, GDN 1200+500, Marlin 1800+1000, flash attention 2900+400, RMS norm 3400+300,
  Marlin 3800+1000, nvjet (lm_head) 4900+1500, div 6500+200, argmax 6800+100, DtoH copy 7000+50.
CPU-side annotations run 3 ms ahead of the GPU ones; the GPU ones must be used.

Also: bytes of GDN state and KV at the cache dtypes the server reports (checked against the config
vLLM 0.28.0 itself builds and serves on /server_info), and the measured step time from the window in
which every stream decodes, on hand-made token times.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from bench import step_analysis as sp

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
    ("split_kv_kernel", "attention"),  # our split-KV verify attention (qwen_serving/engine/kernels/spec_attn.py)
    ("_merge_splits_kernel", "attention"),
    ("nvjet_tst_64x8_64x16_4x1_v_bz_TNT", "dense_gemm"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32", "dense_gemm"),
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "norm_act"),
    ("void vllm::act_and_mul_kernel<...>", "norm_act"),
    # inductor fusions named after the custom op they feed (H200 traces, 2026-11-29): not the GEMM itself
    ("triton_red_fused__to_copy_add_fused_add_rms_norm_marlin_gemm_0", "norm_act"),
    ("triton_poi_fused_marlin_gemm_mul_silu_slice_1", "norm_act"),
    ("_per_token_quant_int8", "norm_act"),
    ("void marlin::Marlin<1125899906909960l, 1125899907892224l, 256, 1, 8, 8>(...)", "marlin_gemm"),
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


REAL_27B = {  # the text config of the real checkpoint (issue 3 / the synth `full` size), as far as used here
    "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 16,
    "linear_num_value_heads": 48, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "num_key_value_heads": 4, "head_dim": 256, "dtype": "bfloat16", "mamba_ssm_dtype": "float32",
}
GDN_STATE_ELEMENTS = 48 * 128 * 128  # one request's delta-rule state in one GDN layer


def test_state_and_kv_bytes_at_the_server_dtypes():
    # what a server started with --mamba-ssm-cache-dtype float16 --kv-cache-dtype fp8 moves
    b = sp.state_bytes(REAL_27B, batch=1, ctx_tokens=1000, ssm_dtype="float16", kv_dtype="fp8")
    # 48 GDN layers x (48 x 128 x 128 x 2 B) read + written
    assert b["gdn"] == 2 * 48 * GDN_STATE_ELEMENTS * 2 == 150_994_944
    # 16 attention layers x 1000 tokens x K+V x 4 heads x 256 x 1 B
    assert b["attention"] == 16 * 1000 * 2 * 4 * 256 * 1 == 32_768_000
    # and one started without cache flags: float32 state (the checkpoint's mamba_ssm_dtype), bf16 KV
    auto = sp.state_bytes(REAL_27B, batch=1, ctx_tokens=1000, ssm_dtype="float32", kv_dtype="torch.bfloat16")
    assert auto["gdn"] == 2 * 48 * GDN_STATE_ELEMENTS * 4 == 2 * b["gdn"]
    assert auto["attention"] == 16 * 1000 * 2 * 4 * 256 * 2 == 2 * b["attention"]
    c64 = sp.state_bytes(REAL_27B, batch=64, ctx_tokens=1000, ssm_dtype="float16", kv_dtype="fp8")
    assert c64 == {"gdn": 64 * b["gdn"], "attention": 64 * b["attention"]}
    # int8 per token and head: 2 x 256 int8 + an fp32 scale for K and one for V, per head
    i8 = sp.state_bytes(REAL_27B, batch=1, ctx_tokens=1000, ssm_dtype="float16", kv_dtype="int8_per_token_head")
    assert i8["attention"] == 16 * 1000 * 4 * (2 * 256 + 2 * 4) == 33_280_000


def test_state_bytes_refuses_a_dtype_it_cannot_size():
    with pytest.raises(ValueError, match="nvfp4"):
        sp.state_bytes(REAL_27B, batch=1, ctx_tokens=10, ssm_dtype="float16", kv_dtype="nvfp4")
    with pytest.raises(TypeError):
        sp.state_bytes(REAL_27B, 1, 10)  # the dtypes have no default: they are the server's to say


def _engine(cache_dtype="auto", mamba_ssm="auto", mamba="auto", model="torch.bfloat16") -> dict:
    """The parts of /server_info's vllm_config that cache_dtypes reads (shape checked against vLLM below)."""
    return {"model_config": {"dtype": model}, "cache_config": {
        "cache_dtype": cache_dtype, "mamba_cache_dtype": mamba, "mamba_ssm_cache_dtype": mamba_ssm}}


NO_SSM_DTYPE = {k: v for k, v in REAL_27B.items() if k != "mamba_ssm_dtype"}


@pytest.mark.parametrize("text_config,engine,ssm,kv,model", [
    # the H200 run's server: --mamba-ssm-cache-dtype float16 --kv-cache-dtype fp8
    (REAL_27B, _engine("fp8", "float16"), "float16", "fp8", "bfloat16"),
    (REAL_27B, _engine("fp8_e4m3", "bfloat16"), "bfloat16", "fp8_e4m3", "bfloat16"),
    # "auto" state: the checkpoint's mamba_ssm_dtype (vLLM's Qwen3.5 hook), else mamba_cache_dtype, else the model's
    (REAL_27B, _engine(), "float32", "bfloat16", "bfloat16"),
    (NO_SSM_DTYPE, _engine(mamba="float16"), "float16", "bfloat16", "bfloat16"),
    (NO_SSM_DTYPE, _engine(), "bfloat16", "bfloat16", "bfloat16"),
    # "auto" KV: the server's model dtype, not the checkpoint's
    (NO_SSM_DTYPE, _engine(model="torch.float16"), "float16", "float16", "float16"),
])
def test_cache_dtypes_from_the_server(text_config, engine, ssm, kv, model):
    assert sp.cache_dtypes(text_config, engine) == {"ssm": ssm, "kv": kv, "model": model, "source": "server"}


def test_cache_dtypes_without_server_info_fall_back_to_the_checkpoint():
    assert sp.cache_dtypes(REAL_27B, None) == {"ssm": "float32", "kv": "bfloat16", "model": "bfloat16",
                                               "source": "checkpoint"}
    old_style = {**NO_SSM_DTYPE, "torch_dtype": "float16"}
    del old_style["dtype"]
    assert sp.cache_dtypes(old_style) == {"ssm": "float16", "kv": "float16", "model": "float16",
                                          "source": "checkpoint"}


def test_cache_dtypes_refuse_what_they_cannot_size_before_anything_runs():
    with pytest.raises(ValueError, match="turboquant_k8v4"):
        sp.cache_dtypes(REAL_27B, _engine(cache_dtype="turboquant_k8v4"))


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> Path:
    from qwen_serving.checkpoint import synth

    out = tmp_path_factory.mktemp("synth") / "tiny"
    assert synth.main(["--size", "tiny", "--out", str(out), "--seed", "0"]) == 0
    return out


@pytest.mark.parametrize("flags,ssm,kv", [
    ({}, "float32", "bfloat16"),  # the checkpoint's mamba_ssm_dtype, resolved by vLLM at start-up
    ({"mamba_ssm_cache_dtype": "float16", "kv_cache_dtype": "fp8"}, "float16", "fp8"),
])
def test_cache_dtypes_read_vllms_own_server_info(tiny_checkpoint, flags, ssm, kv):
    """The engine config a vLLM 0.28.0 server builds from these flags, serialized by the /server_info
    route's own adapter and sent as JSON, resolves to the dtypes the server's caches use."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.entrypoints.serve.dev.server_info.api_router import PydanticVllmConfig

    engine = EngineArgs(model=str(tiny_checkpoint), language_model_only=True, max_model_len=4096, max_num_seqs=8,
                        enforce_eager=True, **flags).create_engine_config()
    served = json.loads(json.dumps(PydanticVllmConfig.dump_python(engine, mode="json", fallback=str)))
    text_config = json.loads((tiny_checkpoint / "config.json").read_text())["text_config"]
    assert text_config["mamba_ssm_dtype"] == "float32"
    dtypes = sp.cache_dtypes(text_config, served)
    assert dtypes == {"ssm": ssm, "kv": kv, "model": "bfloat16", "source": "server"}
    # the same dtypes the engine sizes its caches with
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateDtypeCalculator
    from vllm.utils.torch_utils import get_kv_cache_torch_dtype

    cc = engine.cache_config
    _, ssm_torch = MambaStateDtypeCalculator.gated_delta_net_state_dtype(
        engine.model_config.dtype, cc.mamba_cache_dtype, cc.mamba_ssm_cache_dtype)
    assert ssm_torch.itemsize == sp.element_bytes(dtypes["ssm"])
    assert get_kv_cache_torch_dtype(cc.cache_dtype, engine.model_config.dtype).itemsize == sp.element_bytes(kv)


def _figures(*streams: tuple[float, list[float]]) -> dict:
    from bench import report as br

    return br.ladder_figures([s for s, _ in streams], [t for _, t in streams])


def test_measured_step_time_is_the_all_streams_decoding_window():
    # two streams started together; A's step at 0.20 s also carried B's prefill (100 ms), the rest take 20 ms
    a = (0.0, [0.10, 0.20, 0.22, 0.24, 0.26, 0.28])
    b = (0.0, [0.20, 0.22, 0.24, 0.26, 0.28, 0.30])
    step = sp.measured_step_ms(_figures(a, b), batch=2)
    # window (0.20, 0.28]: 4 tokens of each stream in 0.08 s = 100 tok/s; 1000 x 2 / 100 = 20 ms per step
    assert step["ms_per_token"] == step["window_ms_per_token"] == pytest.approx(20.0)
    assert step["source"] == "all-streams-decoding window"
    # per stream: A 5 tokens / 0.18 s, B 5 / 0.10 s -> mean 38.9 tok/s -> 25.7 ms, polluted by B's prefill
    assert step["per_stream_ms_per_token"] == pytest.approx(1000.0 / ((5 / 0.18 + 5 / 0.10) / 2))
    assert step["per_stream_ms_per_token"] == pytest.approx(25.714, abs=1e-3)


def test_measured_step_time_at_batch_1_is_the_streams_own():
    step = sp.measured_step_ms(_figures((0.0, [0.10, 0.12, 0.14, 0.16])), batch=1)
    assert step["ms_per_token"] == pytest.approx(20.0)  # 3 tokens after the first in 0.06 s
    assert step["per_stream_ms_per_token"] == pytest.approx(20.0)


def test_measured_step_time_falls_back_when_streams_never_overlap():
    a = (0.0, [0.10, 0.12, 0.14])
    b = (0.14, [0.30, 0.325, 0.35])  # B's first token after A's last: no common window
    figures = _figures(a, b)
    assert figures["aggregate_decode_tok_s"] is None
    step = sp.measured_step_ms(figures, batch=2)
    assert step["window_ms_per_token"] is None
    assert step["source"] == "per-stream mean (no overlap)"
    # A 2 tokens / 0.04 s = 50 tok/s, B 2 / 0.05 s = 40 tok/s -> 45 tok/s -> 22.2 ms
    assert step["ms_per_token"] == step["per_stream_ms_per_token"] == pytest.approx(1000.0 / 45.0)
    with pytest.raises(ValueError, match="no decode rate"):
        sp.measured_step_ms({"aggregate_decode_tok_s": None, "per_stream_decode_tok_s": None}, batch=2)


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


def test_kernel_table(trace):
    table = sp.kernel_table(trace, batch=1, skip=2, top=3)
    assert len(table) == 3 and table == sorted(table, key=lambda r: -r["us_per_step"])
    total = sum(r["us_per_step"] for r in sp.kernel_table(trace, batch=1, skip=2, top=100))
    prof = sp.profile_steps(trace, batch=1, skip=2)
    categories = [c for c in sp.CATEGORIES if c != "lm_head"] + ["lm_head"]
    assert total / 1000 == pytest.approx(sum(prof[c] for c in categories))  # the same kernels, by name
    assert sum(r["calls_per_step"] for r in sp.kernel_table(trace, batch=1, skip=2, top=100)) == prof["kernels"]
    assert sp.kernel_table(trace, batch=7) == []



def test_host_api_table(trace):
    """Host CUDA API calls are averaged over the same decode windows as the kernels; a synchronize is the
    host's wait for the GPU (its slack)."""
    _, marks = sp.trace_events(trace)
    windows = sp.decode_steps(marks, 1)
    host = [{"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 0.0, "dur": 9000.0}]  # before all
    for start, _ in windows:
        host += [{"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": start + 100, "dur": 1500.0},
                 {"ph": "X", "cat": "cuda_runtime", "name": "cudaEventSynchronize", "ts": start + 5000, "dur": 400.0},
                 {"ph": "X", "cat": "cuda_driver", "name": "cuLaunchKernel", "ts": start + 7000, "dur": 10.0},
                 {"ph": "X", "cat": "cpu_op", "name": "aten::copy_", "ts": start + 7100, "dur": 50.0}]
    with_host = {"traceEvents": trace["traceEvents"] + host}
    table = sp.host_api_table(with_host, batch=1, skip=2)
    assert [r["name"] for r in table["calls"]] == ["cudaGraphLaunch", "cudaEventSynchronize", "cuLaunchKernel"]
    assert table["calls"][0] == {"name": "cudaGraphLaunch", "us_per_step": 1500.0, "calls_per_step": 1.0,
                                 "us_per_call": 1500.0}
    assert table["total_ms"] == pytest.approx(1.91) and table["sync_wait_ms"] == pytest.approx(0.4)
    assert sp.host_api_table(with_host, batch=1, skip=2, top=1)["calls"][0]["name"] == "cudaGraphLaunch"
    assert sp.host_api_table(trace, batch=1)["calls"] == []  # the fixture itself records no host calls
    assert sp.host_api_table(with_host, batch=64) == {"total_ms": None, "sync_wait_ms": None, "calls": []}
