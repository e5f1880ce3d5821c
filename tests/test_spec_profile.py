"""Speculative-step phases (bench.spec_profile) on hand-built Kineto traces whose phases are known.

Each step (10 ms apart, 1 request, k drafts) holds, as vLLM 0.28.0 runs an MTP step (offsets from the
step start in us, durations in us; graph = CUDA graph id, 0 outside a graph):
  prepare      : 2 input memcpys (1 each) at 0 and 10
  verify fwd   : graph 7 from 100: embedding+norm 5, Marlin 100, GDN 20, flash attention 10, Marlin 100, norm 5
  verify head  : nvjet 600 (graph 0)
  verify samp. : radix sort 30, softmax 100, rejection_random_sample_kernel 2
  bookkeeping  : postprocess_mamba 3, eagle_prepare_inputs_padded_kernel 1
  per draft    : graph 9: norm 4, nvjet 30; eager flash 10; graph 9: nvjet 80; head nvjet 600; argmax 8;
                 eagle_step_slot_mapping_metadata_kernel 2 (bookkeeping)
Kernels follow each other 1 us apart.

Our patched MTP step on the prepared checkpoint (PATCHED_*, as the H200 traces of 2026-12-02 show it): the same
verify forward (int4 Marlin, weight type uint4b8), then every other GEMM is an int8 Marlin (uint8b128): the
lm_head, the MTP layer (graphs 9 and 11 around eager split-KV attention) and the 3,707-row draft head, whose
logits are scattered into the full vocabulary (fill + index_copy) before the draft's top-k sampling.
"""

from __future__ import annotations

import json

import pytest

from bench import spec_profile as spp

STEP_US = 10_000.0
VERIFY = [("triton_red_fused__to_copy_add_embedding_rms_norm_0", 5, 7),
          ("void marlin::Marlin<1125899906909960l, 256>(...)", 100, 7),
          ("fused_sigmoid_gating_delta_rule_update_kernel", 20, 7),
          ("void cutlass::device_kernel<flash::FlashAttnFwdSm90<...>>", 10, 7),
          ("void marlin::Marlin<1125899906909960l, 256>(...)", 100, 7),
          ("triton_red_fused__to_copy_add_fused_add_rms_norm_3", 5, 7)]
HEAD = ("nvjet_sm90_tst_512x8_64x3_2x1_v_bz_TNT", 600, 0)
VERIFY_SAMPLING = [("DeviceRadixSortOnesweepKernel", 30, 0), ("cunn_SoftMaxForward", 100, 0),
                   ("rejection_random_sample_kernel", 2, 0)]
BOOKKEEPING = [("postprocess_mamba_fused_kernel", 3, 0), ("eagle_prepare_inputs_padded_kernel", 1, 0)]
DRAFT = [("triton_poi_fused_0", 4, 9), ("nvjet_sm90_tst_256x8_64x6_4x1_v_bz_splitK_TNT", 30, 9),
         ("void cutlass::device_kernel<flash::FlashAttnFwdSm90<...>>", 10, 0),
         ("nvjet_sm90_tst_384x8_64x4_4x1_v_bz_TNT", 80, 9), HEAD,
         ("void at::native::reduce_kernel<512, 1, ReduceOp<float, ArgMaxOps<float>>>", 8, 0),
         ("eagle_step_slot_mapping_metadata_kernel", 2, 0)]


INT4 = "void marlin::Marlin<1125899906909960l, 1125899907892224l, 1125899906909960l, 1125899906909960l, 256, 1, 8>(...)"
INT8 = "void marlin::Marlin<1125899906909960l, 1125899923621888l, 1125899906909960l, 1125899906909960l, 256, 1, 8>(...)"
INT8_SMALL = INT8.replace("256, 1, 8>", "128, 1, 4>")
PATCHED_VERIFY = [(INT4 if "marlin" in n else n, d, g) for n, d, g in VERIFY]
PATCHED_HEAD = (INT8, 335, 0)
PATCHED_VERIFY_SAMPLING = [("vectorized_gather_kernel", 2, 0), ("at::native::mbtopk::computeDigitCumSum", 6, 0),
                           ("_apply_cut_kernel", 3, 0), ("cunn_SoftMaxForward", 100, 0),
                           ("sample_recovered_tokens_kernel", 50, 0), ("rejection_random_sample_kernel", 2, 0)]
PATCHED_DRAFT = [("_dequant_gather_kernel", 2, 9), (INT8, 21, 9), (INT8, 25, 9), ("split_kv_kernel", 8, 0),
                 ("_merge_splits_kernel", 15, 0), (INT8, 15, 11), (INT8, 54, 11), (INT8, 31, 11),
                 ("triton_red_fused__to_copy_add_fused_add_rms_norm_3", 3, 11), ("index_elementwise_kernel", 3, 0),
                 (INT8_SMALL, 13, 0), ("FillFunctor<c10::BFloat16>", 1, 0), ("index_copy_kernel_impl", 4, 0),
                 ("at::native::mbtopk::computeDigitCumSum", 6, 0), ("_apply_cut_kernel", 3, 0),
                 ("ReduceOp<float, ArgMaxOps<float>>", 8, 0), ("eagle_step_slot_mapping_metadata_kernel", 2, 0)]


def _patched_step(k: int, draft: list = PATCHED_DRAFT, verify: list = PATCHED_VERIFY) -> list[tuple[str, float, int]]:
    return [*verify, PATCHED_HEAD, *PATCHED_VERIFY_SAMPLING, *(BOOKKEEPING if k else []), *(draft * k)]


def _step(k: int, draft: list = DRAFT) -> list[tuple[str, float, int]]:
    return [*VERIFY, HEAD, *VERIFY_SAMPLING, *(BOOKKEEPING if k else []), *(draft * k)]


def build_trace(k: int, steps: int = 5, broken_step: int | None = None, step_ops=None, launches: bool = False) -> dict:
    """`steps` decode steps (after a prefill mark); broken_step's drafts lose their sampling kernel. With launches,
    each op has its host launch: an eager op's cudaLaunchKernel returns 3 us before the op starts, a CUDA graph's
    cudaGraphLaunch (one per run of a graph id) returns 20 us before its first kernel starts."""
    events = []
    names = ["execute_context_1(100)_generation_0(0)"] + [f"execute_context_0(0)_generation_1({1 + k})"] * steps
    gpu = []
    for s, name in enumerate(names):
        t0 = s * STEP_US
        events.append({"ph": "X", "cat": "gpu_user_annotation", "name": name, "ts": t0, "dur": 9000.0})
        for off in (0.0, 10.0):
            gpu.append({"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "ts": t0 + off,
                        "dur": 1.0, "args": {"graph id": 0}})
        ops = step_ops if step_ops is not None else _step(k, [d for d in DRAFT if "ArgMax" not in d[0]]
                                                          if s == broken_step else DRAFT)
        t = t0 + 100.0
        for op_name, dur, graph in ops:
            gpu.append({"ph": "X", "cat": "kernel", "name": op_name, "ts": t, "dur": float(dur),
                        "args": {"graph id": graph}})
            t += dur + 1.0
    prev_graph = 0
    for corr, ev in enumerate(gpu, 1):
        graph = ev["args"]["graph id"]
        if launches and (graph == 0 or graph != prev_graph):
            lead, call, name = (80.0, 60.0, "cudaGraphLaunch") if graph else (5.0, 2.0, "cudaLaunchKernel")
            events.append({"ph": "X", "cat": "cuda_runtime", "name": name, "ts": ev["ts"] - lead, "dur": call,
                           "args": {"correlation": corr}})
            launch = corr
        ev["args"]["correlation"] = launch if launches else corr
        prev_graph = graph
    return {"traceEvents": events + gpu}


def _ms(ops) -> float:
    return sum(d for _, d, _ in ops) / 1000.0


def test_speculative_step_is_split_into_its_phases():
    prof = spp.profile_trace(build_trace(k=4), batch=1, skip=1)
    assert prof["k"] == 4 and prof["steps"] == 3  # 5 steps -> 4 step-to-step windows, 1 dropped
    kernel = prof["kernel_ms"]
    assert kernel["prepare"] == pytest.approx(0.002)
    assert kernel["verify_forward"] == pytest.approx(_ms(VERIFY))
    assert kernel["verify_lm_head"] == pytest.approx(0.6)
    assert kernel["verify_sampling"] == pytest.approx(0.132)
    assert kernel["draft_forward"] == pytest.approx(4 * 0.124)
    assert kernel["draft_lm_head"] == pytest.approx(4 * 0.6)
    assert kernel["draft_sampling"] == pytest.approx(4 * 0.008)
    assert kernel["bookkeeping"] == pytest.approx(0.004 + 4 * 0.002)
    assert prof["drafts"] == [pytest.approx({"forward": 0.124, "lm_head": 0.6, "sampling": 0.008})] * 4
    # wall: every op's start to the next op's start; the rest of the 10 ms is host gap
    n_ops = len(_step(4))
    assert sum(prof["wall_ms"].values()) == pytest.approx(0.1 + _ms(_step(4)) + (n_ops - 1) / 1000.0)
    assert prof["wall_ms"]["prepare"] == pytest.approx(0.1)  # the gap before the graph launch lands here
    assert prof["host_gap_ms"] == pytest.approx(10.0 - sum(prof["wall_ms"].values()))
    assert prof["busy_ms"] == pytest.approx(0.002 + _ms(_step(4)))
    assert prof["verify_forward_by_category"]["marlin_gemm"] == pytest.approx(0.2)
    assert prof["draft_forward_by_category"] == pytest.approx({"other": 0.016, "dense_gemm": 0.44,
                                                               "attention": 0.04})


def test_plain_decode_step_has_no_drafts():
    prof = spp.profile_trace(build_trace(k=0), batch=1, skip=1)
    assert prof["k"] == 0 and prof["drafts"] == []
    assert prof["kernel_ms"]["verify_sampling"] == pytest.approx(0.132)
    assert prof["kernel_ms"]["draft_lm_head"] == 0.0 and prof["kernel_ms"]["bookkeeping"] == 0.0


def test_a_draft_without_sampling_is_refused_with_the_step_named():
    with pytest.raises(ValueError, match=r"at 30000 us.*expected 5 logits GEMMs .* found 1"):
        spp.profile_trace(build_trace(k=4, broken_step=3), batch=1, skip=1)


def test_a_step_without_marlin_gemms_is_refused():
    ops = [op for op in _step(4) if "marlin" not in op[0]]
    with pytest.raises(ValueError, match="no Marlin GEMM"):
        spp.profile_trace(build_trace(k=4, step_ops=ops), batch=1, skip=1)


def test_eager_drafts_start_at_their_first_gemm():
    eager = [(n, d, 0) for n, d, _ in DRAFT]
    prof = spp.profile_trace(build_trace(k=1, step_ops=_step(1, eager)), batch=1, skip=1)
    # without graph ids the draft's leading norm (4 us) is not known to be the MTP's: bookkeeping
    assert prof["kernel_ms"]["draft_forward"] == pytest.approx(0.120)
    assert prof["kernel_ms"]["bookkeeping"] == pytest.approx(0.004 + 0.004 + 0.002)


def test_cli_writes_the_side_by_side_report(tmp_path, capsys):
    paths = []
    for name, k in (("plain", 0), ("mtp4", 4)):
        paths.append(tmp_path / f"{name}.trace.json")
        paths[-1].write_text(json.dumps(build_trace(k)))
    run = {"patches": {"series": ["a.patch"]}, "servers": {"mtp4": {"what": "ours k=4"}},
           "measurements": {"mtp4": {"c1": {"ms_per_step": 5.0, "spec": {"tokens_per_step": 1.0}}}}}
    (tmp_path / "run.json").write_text(json.dumps(run))
    out = tmp_path / "out.json"
    assert spp.main([*map(str, paths), "--out", str(out), "--run-json", str(tmp_path / "run.json"),
                     "--meta", "gpu=NVIDIA H200", "--skip", "1"]) == 0
    report = json.loads(out.read_text())
    assert report["gpu"] == "NVIDIA H200" and report["patches"] == ["a.patch"]
    plain, mtp = report["configs"]
    assert (plain["name"], plain["k"], plain["measured_ms_per_step"]) == ("plain", 0, None)
    assert (mtp["name"], mtp["k"], mtp["server"]) == ("mtp4", 4, "ours k=4")
    assert mtp["unexplained_ms"] == pytest.approx(5.0 - mtp["busy_ms"])
    assert mtp["kernel_table"][0]["name"] == HEAD[0]


def test_cli_refuses_a_trace_it_cannot_split_and_writes_nothing(tmp_path, capsys):
    bad = tmp_path / "bad.trace.json"
    bad.write_text(json.dumps(build_trace(k=4, broken_step=2)))
    out = tmp_path / "out.json"
    assert spp.main([str(bad), "--out", str(out), "--skip", "1"]) == 1
    assert not out.exists() and "expected 5 logits GEMMs" in capsys.readouterr().err


def test_patched_step_tells_int8_heads_and_drafter_from_the_int4_body():
    prof = spp.profile_trace(build_trace(k=4, step_ops=_patched_step(4)), batch=1, skip=1)
    kernel = prof["kernel_ms"]
    assert kernel["verify_forward"] == pytest.approx(_ms(PATCHED_VERIFY))
    assert kernel["verify_lm_head"] == pytest.approx(0.335)
    assert kernel["verify_sampling"] == pytest.approx(_ms(PATCHED_VERIFY_SAMPLING))
    # the draft body runs from its first graph kernel to the head: MTP layer, its attention, the row select
    assert kernel["draft_forward"] == pytest.approx(4 * _ms(PATCHED_DRAFT[:10]))
    assert kernel["draft_lm_head"] == pytest.approx(4 * 0.013)
    # the draft head's scatter into the full vocabulary (fill + index_copy) is the draft's sampling
    assert kernel["draft_sampling"] == pytest.approx(4 * _ms(PATCHED_DRAFT[11:16]))
    assert kernel["bookkeeping"] == pytest.approx(0.004 + 4 * 0.002)
    weights = prof["gemm_ms_by_weight"]
    assert weights["verify_forward"] == pytest.approx({"marlin uint4b8": 0.2})
    assert weights["verify_lm_head"] == pytest.approx({"marlin uint8b128": 0.335})
    assert weights["draft_forward"] == pytest.approx({"marlin uint8b128": 4 * 0.146})
    assert weights["draft_lm_head"] == pytest.approx({"marlin uint8b128": 4 * 0.013})
    sampling = {row["name"]: row for row in prof["phase_kernels"]["draft_sampling"]}
    assert sampling["index_copy_kernel_impl"]["us_per_step"] == pytest.approx(16.0)
    assert sampling["index_copy_kernel_impl"]["calls_per_step"] == 4


def test_patched_plain_step_has_an_int8_marlin_lm_head():
    prof = spp.profile_trace(build_trace(k=0, step_ops=_patched_step(0)), batch=1, skip=1)
    assert prof["k"] == 0 and prof["drafts"] == []
    assert prof["kernel_ms"]["verify_lm_head"] == pytest.approx(0.335)
    assert prof["kernel_ms"]["verify_forward"] == pytest.approx(_ms(PATCHED_VERIFY))


def test_a_body_cut_short_by_a_sampling_kernel_is_refused():
    # a softmax inside the body makes its first Marlin GEMM look like the target's head; with the last draft's
    # sampling lost the head count still reads 1 + k, but the first "draft" then runs the verify forward's graph
    verify = [*PATCHED_VERIFY[:2], ("cunn_SoftMaxForward", 5, 7), *PATCHED_VERIFY[2:]]
    broken = [op for op in PATCHED_DRAFT if "ArgMax" not in op[0] and "mbtopk" not in op[0]]
    ops = _patched_step(4, verify=verify)[:-len(PATCHED_DRAFT)] + broken
    with pytest.raises(ValueError, match="draft pass 1 runs CUDA graph 7 of the verify forward"):
        spp.profile_trace(build_trace(k=4, step_ops=ops), batch=1, skip=1)


def test_a_gemm_after_the_last_drafts_sampling_is_refused():
    ops = [*_patched_step(4), (INT8, 20, 0)]
    with pytest.raises(ValueError, match="follows the last head's sampling"):
        spp.profile_trace(build_trace(k=4, step_ops=ops), batch=1, skip=1)


def test_a_patched_step_with_a_draft_pass_missing_is_refused():
    ops = _patched_step(4)[:-len(PATCHED_DRAFT)]
    with pytest.raises(ValueError, match="expected 5 logits GEMMs .* found 4"):
        spp.profile_trace(build_trace(k=4, step_ops=ops), batch=1, skip=1)


def test_marlin_weight_types_read_as_vllm_names_them():
    assert spp.gemm_weight(spp.GpuOp(INT4, 0.0, 1.0, 0)) == "marlin uint4b8"
    assert spp.gemm_weight(spp.GpuOp(INT8_SMALL, 0.0, 1.0, 0)) == "marlin uint8b128"
    assert spp.gemm_weight(spp.GpuOp(VERIFY[1][0], 0.0, 1.0, 0)) == "marlin"  # no type ids in the name
    assert spp.gemm_weight(spp.GpuOp(HEAD[0], 0.0, 1.0, 0)) == "dense"
    assert spp.scalar_type_name(0x4000000010708) == "float16_e8m7"  # bfloat16, Marlin's activation type here
    scalar_type = pytest.importorskip("vllm.scalar_type")
    for t in ("uint4b8", "uint8b128", "int8", "uint4", "int4", "float8_e4m3fn", "float4_e2m1f"):
        assert spp.scalar_type_name(getattr(scalar_type.scalar_types, t).id) == t


def test_host_time_per_phase_follows_the_launches():
    prof = spp.profile_trace(build_trace(k=4, launches=True), batch=1, skip=1)
    host = prof["host_ms"]
    assert sum(host.values()) == pytest.approx(10.0)  # one step's launches, end to end, are one period
    # from the second input copy's launch (returns at 7 us) to the graph's (80 us): the rest of the graph adds 0
    assert host["verify_forward"] == pytest.approx(0.073)
    # the head's launch returns 3 us before it starts, after the graph's kernels, each followed by 1 us
    head_start = 100 + sum(d + 1 for _, d, _ in VERIFY)
    assert host["verify_lm_head"] == pytest.approx((head_start - 3 - 80) / 1000.0)
    # from the last op of the previous step (a draft's slot mapping) to this step's first input copy
    last_op_start = 100 + sum(d + 1 for _, d, _ in _step(4)[:-1])
    assert host["between_steps"] == pytest.approx((STEP_US - last_op_start) / 1000.0)
    assert spp.profile_trace(build_trace(k=4), batch=1, skip=1)["host_ms"] is None  # no launches in the trace
