"""Measure what the GDN recurrent-state dtype costs per decode step, and derive STATE_DTYPE's defaults from it.

    python bench/state_dtype.py --out DIR             # kernel level (~2 min on an H200) -> DIR/state-dtype-h200.json
    python bench/state_dtype.py --out DIR --engine [--engine-dtypes float16,bfloat16]
                                                      # engine level, ~3.5 min per dtype -> DIR/state-dtype-engine-h200.json
    python bench/state_dtype.py --recommend DIR/state-dtype-h200.json   # the recommendation again (no GPU)

What vLLM 0.28.0 runs (model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py):
- `__init__`: the fused CUDA decode op is enabled only for a bf16 model with K = V = 128, SiLU gating, the
  non-interleaved layout, a bf16 conv cache, a float32 or bfloat16 recurrent state (FUSED_GDN_STATE_DTYPES) and
  sm80+ (`_fused_gdn_decode_unsupported_reason`). A float16 state turns it off for the whole model.
- Enabled, `forward_cuda` calls the op `qwen_gdn_attention_core_fused_norm_packed`: the gated RMSNorm runs inside
  it (Triton `layer_norm_fwd`) and the CUDA kernel `fused_gdn_decode_post_conv_mtp` runs only for speculative
  verify steps and only when `num_v_heads == 8 * num_k_heads` (`_can_use_fused_gdn_mtp_decode`). The 27B has
  48 / 16 = 3, so the CUDA kernel never runs for it, whatever the dtype.
- Every other case goes through `_forward_core`: plain decode is the Triton packed kernel
  `fused_recurrent_gated_delta_rule_packed_decode` (VLLM_ENABLE_FLA_PACKED_RECURRENT_DECODE, on by default), a
  verify step is the Triton `fused_sigmoid_gating_delta_rule_update`, which writes the state after every verify
  position. Disabled (float16), the norm runs after the op, in the compiled graph.
So the dtype decides the bytes of the state sweep and where the norm runs, not the recurrent kernel.

Kernel level: for each dtype, vLLM's own methods (`_forward_core`, `_forward_core_fused_norm_packed`, ...) are
called on a stand-in layer with the 27B's GDN shapes (16 key / 48 value heads of 128, conv kernel 4) and a state
pool, for plain decode at C1/8/32/64 (batch mode) and an MTP verify step of DRAFT_TOKENS + 1 tokens at C1-C8
(single-user mode), on the path vLLM picks for that dtype. Each timed unit is `rotations` calls on disjoint state
slots captured into one CUDA graph (the engine replays decode steps from graphs, so launch gaps do not count),
replayed by triton.testing.do_bench (median, L2 flushed between replays). x 48 layers = the GDN share of one step.
The HBM bandwidth is measured in the same run (a 1 GiB device copy); bytes per step are modelled (`layer_traffic`).
The input and output projections are the same GEMMs for every dtype and are not timed.

Engine level (--engine, off by default: each engine start costs ~3 min): offline vLLM on the `shape` checkpoint
with 8 layers (6 GDN), one engine per dtype in its own process; decode step time at C1 and C64 from generation
wall time, (t(272 tokens) - t(16 tokens)) / 256, which cancels prefill and fixed costs.

`recommend(report)` turns the numbers into one default per mode (rules in docs/state-dtype.md).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import MethodType, SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.serving import write_json_atomic  # noqa: E402
from qwen_serving import memory, model  # noqa: E402

STATE_DTYPES = ("float32", "bfloat16", "float16")
DECODE_BATCHES = (1, 8, 32, 64)  # batch mode runs up to MAX_SEQS=64 plain decodes
VERIFY_BATCHES = (1, 2, 4, 8)  # single-user mode: C1-C8 MTP verify steps
RESULT_NAME = "state-dtype-h200.json"
ENGINE_RESULT_NAME = "state-dtype-engine-h200.json"
ROTATE_BYTES = 256 << 20  # state bytes one graph replay sweeps: several times the H200's 50 MB L2
MAX_ROTATIONS = 32
REFERENCE_FREE_VRAM_GIB = 23.6  # a headless 24 GiB RTX 3090, as tests/test_memory.py counts it
CAPACITY_PROMPT = 128  # the spec's resident counts are quoted at 128-token prompts
CAPACITY_ANSWER = {"batch": 512, "single": 256}  # batch: the spec's 128 in / 512 out benchmark
NOISE = 0.03  # do_bench medians of one kernel repeat within ~1-2%: differences below 3% are ties
FP16_BATCH_TOLERANCE = 0.10  # see recommend()
ENGINE_SHORT, ENGINE_LONG = 16, 272
DEFAULT_SHAPE_MODEL = Path("/tmp/qwen-shape-8l")

PACKED_DECODE = "fused_recurrent_gated_delta_rule_packed_decode (Triton)"
SIGMOID_UPDATE = "fused_sigmoid_gating_delta_rule_update (Triton)"
MTP_CUDA = "fused_gdn_decode_post_conv_mtp (CUDA)"
NORM_IN_OP = "layer_norm_fwd (Triton, inside vllm::qwen_gdn_attention_core_fused_norm_packed)"
NORM_AFTER_OP = ("RMSNormGated after vllm::qwen_gdn_attention_core (timed as its forward_cuda, one Triton kernel; "
                 "the engine compiles forward_native into one kernel of the same work)")

T0 = time.monotonic()


def say(msg: str) -> None:
    print(f"[bench/state_dtype +{time.monotonic() - T0:6.1f}s] {msg}", flush=True)


@dataclass(frozen=True)
class GdnDims:
    """The GDN geometry the kernels see (the 27B's by default)."""

    k_heads: int = model.GDN_K_HEADS
    v_heads: int = model.GDN_V_HEADS
    head_dim: int = model.GDN_HEAD_DIM
    conv_kernel: int = model.CONV_KERNEL
    layers: int = model.GDN_LAYERS

    @property
    def key_dim(self) -> int:
        return self.k_heads * self.head_dim

    @property
    def value_dim(self) -> int:
        return self.v_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim


REAL = GdnDims()


# ---- bytes --------------------------------------------------------------------------------------------------


def state_bytes(dims: GdnDims, state_dtype: str) -> int:
    """One request's [HV, V, K] recurrent state in one layer."""
    return dims.v_heads * dims.head_dim * dims.head_dim * model.DTYPE_BYTES[state_dtype]


def layer_traffic(dims: GdnDims, state_dtype: str, batch: int, tokens: int) -> int:
    """HBM bytes one layer's decode call moves for `batch` requests of `tokens` tokens each (modelled).

    The state is read once and written after every token (a verify step keeps each position's state for the
    rollback; plain decode writes it once); the conv tail (bf16) is read and written; activations (bf16) are
    read and written once per kernel: qkv through the conv and into the recurrence, a/b, the core output,
    the gate, the normed output.
    """
    act = model.DTYPE_BYTES[model.DTYPE]
    state = state_bytes(dims, state_dtype) * (1 + tokens)
    conv = 2 * (dims.conv_kernel - 1 + tokens - 1) * dims.conv_dim * act
    acts = tokens * (3 * dims.conv_dim + 2 * dims.v_heads + 4 * dims.value_dim) * act
    return batch * (state + conv + acts)


# ---- vLLM's layer, stood in for ------------------------------------------------------------------------------

VLLM_METHODS = (
    "_fused_gdn_decode_unsupported_reason", "_can_use_fused_gdn_mtp_decode", "split_ba", "rearrange_mixed_qkv",
    "_forward_core", "_forward_core_decode_non_spec", "_forward_core_fused_norm_packed", "_forward_core_fused_norm",
    "_forward_core_decode_spec_fused_norm", "_forward_core_decode_spec_post_conv_fused_norm", "_rms_norm_gated_cuda",
)


def torch_dtype(name: str):
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def gdn_layer(dims: GdnDims, state_dtype: str, *, slots: int, conv_rows: int, device, act_dtype):
    """A stand-in for one QwenGatedDeltaNetAttention with vLLM's own methods bound to it.

    It carries exactly the attributes those methods read, a state pool of `slots` slots laid out as vLLM's
    kv_cache (conv tail [slots, rows, conv_dim] in the default SD layout, state [slots, HV, V, K]; slot 0 is the
    null block), and the conv/gating parameters of one layer. The model's dtype is `act_dtype` (bf16 on the GPU).
    """
    import torch
    from vllm import envs
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention

    kw = {"device": device}
    layer = SimpleNamespace(
        prefix="model.layers.0.linear_attn", tp_size=1, tp_rank=0, num_k_heads=dims.k_heads,
        num_v_heads=dims.v_heads, head_k_dim=dims.head_dim, head_v_dim=dims.head_dim, key_dim=dims.key_dim,
        value_dim=dims.value_dim, conv_kernel_size=dims.conv_kernel, activation="silu",
        gqa_interleaved_layout=False, disable_tp_for_ba_proj=False, layer_norm_epsilon=1e-6,
        enable_packed_recurrent_decode=envs.VLLM_ENABLE_FLA_PACKED_RECURRENT_DECODE, gdn_decode_kernel="triton",
        conv1d=SimpleNamespace(weight=torch.randn(dims.conv_dim, 1, dims.conv_kernel, dtype=act_dtype, **kw) * 0.3,
                               bias=None),
        A_log=torch.empty(dims.v_heads, dtype=torch.float32, **kw).uniform_(1, 16).log_(),  # Mamba's A init
        dt_bias=torch.ones(dims.v_heads, dtype=act_dtype, **kw),
        norm=SimpleNamespace(weight=torch.ones(dims.head_dim, dtype=act_dtype, **kw), bias=None, eps=1e-6,
                             group_size=None, norm_before_gate=True, activation="silu"),
        kv_cache=(torch.randn(slots, conv_rows, dims.conv_dim, dtype=act_dtype, **kw),
                  (torch.randn(slots, dims.v_heads, dims.head_dim, dims.head_dim, **kw) * 0.05)
                  .to(torch_dtype(state_dtype))),
        get_state_dtype=lambda: (act_dtype, torch_dtype(state_dtype)),
    )
    for name in VLLM_METHODS:
        setattr(layer, name, MethodType(getattr(QwenGatedDeltaNetAttention, name), layer))
    return layer


def decode_metadata(indices):
    """vLLM's GDN metadata for a batch of plain decodes (one token each) on the state slots `indices` [B]."""
    import torch
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata

    batch = indices.shape[0]
    return GDNAttentionMetadata(
        num_prefills=0, num_prefill_tokens=0, num_decodes=batch, num_decode_tokens=batch, num_spec_decodes=0,
        num_spec_decode_tokens=0, num_actual_tokens=batch, non_spec_state_indices_tensor=indices,
        non_spec_query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=indices.device))


def verify_metadata(indices, accepted):
    """The same for a batch of verify steps: `indices` [B, T] (one slot per position), `accepted` [B] in 1..T."""
    import torch
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata

    batch, tokens = indices.shape
    dev = indices.device
    return GDNAttentionMetadata(
        num_prefills=0, num_prefill_tokens=0, num_decodes=0, num_decode_tokens=0, num_spec_decodes=batch,
        num_spec_decode_tokens=batch * tokens, num_actual_tokens=batch * tokens,
        spec_query_start_loc=torch.arange(0, batch * tokens + 1, tokens, dtype=torch.int32, device=dev),
        spec_state_indices_tensor=indices, spec_sequence_masks=torch.ones(batch, dtype=torch.bool, device=dev),
        num_accepted_tokens=accepted)


def vllm_choice(state_dtype: str, dims: GdnDims = REAL, verify_tokens: int = 5, device="cpu") -> dict:
    """Which decode path vLLM 0.28.0 takes for this state dtype, asked of vLLM's own conditions.

    Mirrors only the five lines of `QwenGatedDeltaNetAttention.__init__` that turn the reason into the kernel
    choice; the conditions themselves are vLLM's methods. The model dtype is bf16 (the checkpoint's).
    """
    import torch
    from vllm import envs

    layer = gdn_layer(dims, state_dtype, slots=1, conv_rows=dims.conv_kernel - 1, device="meta",
                      act_dtype=torch.bfloat16)
    kernel = envs.VLLM_GDN_DECODE_KERNEL.strip().lower()
    reason = None
    if kernel == "cuda":
        reason = layer._fused_gdn_decode_unsupported_reason(
            SimpleNamespace(model_config=SimpleNamespace(dtype=torch.bfloat16)))
        if reason is not None:
            kernel = "triton"
    layer.gdn_decode_kernel = kernel
    fused = kernel == "cuda"
    indices = torch.arange(1, verify_tokens + 1, dtype=torch.int32, device=device)[None]
    mtp_cuda = fused and layer._can_use_fused_gdn_mtp_decode(
        verify_metadata(indices, torch.ones(1, dtype=torch.int32, device=device)))
    return {
        "fused_norm_op": fused,
        "fused_op_unsupported_reason": reason,
        "decode_kernel": PACKED_DECODE if layer.enable_packed_recurrent_decode else SIGMOID_UPDATE,
        "verify_kernel": MTP_CUDA if mtp_cuda else SIGMOID_UPDATE,
        "norm": NORM_IN_OP if fused else NORM_AFTER_OP,
    }


def layer_call(layer, ctx, qkvz, ba, fused: bool):
    """One layer's GDN core for one step, entered as vLLM's `forward_cuda` enters it (after in_proj_qkvz/ba)."""
    import torch
    from vllm.forward_context import override_forward_context
    from vllm.model_executor.layers.layernorm import RMSNormGated

    tokens = qkvz.shape[0]
    core = torch.zeros(tokens, layer.num_v_heads, layer.head_v_dim, dtype=qkvz.dtype, device=qkvz.device)
    with override_forward_context(ctx):
        if fused:
            layer._forward_core_fused_norm_packed(qkvz, ba, core)
            return core
        mixed_qkv, gate = qkvz.split([2 * layer.key_dim + layer.value_dim, layer.value_dim], dim=-1)
        b, a = layer.split_ba(ba)
        layer._forward_core(mixed_qkv, b.contiguous(), a.contiguous(), core)
    return RMSNormGated.forward_cuda(layer.norm, core.reshape(-1, layer.head_v_dim),
                                     gate.reshape(-1, layer.head_v_dim))


def build_point(path: str, state_dtype: str, batch: int, *, dims: GdnDims, tokens: int, rotations: int, fused: bool,
                device, act_dtype):
    """`rotations` ready-to-run layer calls on disjoint state slots, and the layer they share.

    Plain decode (`path="decode"`): one slot per request. Verify (`"verify"`): `tokens` slots per request, as
    vLLM gives a speculating request one state slot per verify position, and a conv tail of 3 + k rows.
    """
    import torch
    from vllm.forward_context import ForwardContext

    per_request = 1 if path == "decode" else tokens
    per_call = batch * per_request
    layer = gdn_layer(dims, state_dtype, slots=1 + rotations * per_call,
                      conv_rows=dims.conv_kernel - 1 + per_request - 1, device=device, act_dtype=act_dtype)
    calls = []
    for r in range(rotations):
        slots = torch.arange(1 + r * per_call, 1 + (r + 1) * per_call, dtype=torch.int32, device=device)
        if path == "decode":
            meta = decode_metadata(slots)
        else:
            accepted = (torch.arange(batch, dtype=torch.int32, device=device) % tokens) + 1
            meta = verify_metadata(slots.view(batch, tokens), accepted)
        n = batch * per_request
        qkvz = torch.randn(n, dims.conv_dim + dims.value_dim, dtype=act_dtype, device=device)
        ba = torch.randn(n, 2 * dims.v_heads, dtype=act_dtype, device=device)
        ctx = ForwardContext(no_compile_layers={}, attn_metadata={layer.prefix: meta}, slot_mapping={})
        calls.append(partial(layer_call, layer, ctx, qkvz, ba, fused))
    return calls, layer


# ---- timing (GPU) -------------------------------------------------------------------------------------------


def rotations_for(traffic: int) -> int:
    return max(2, min(MAX_ROTATIONS, math.ceil(ROTATE_BYTES / max(traffic, 1))))


def time_calls_us(calls) -> tuple[float, str, str | None]:
    """Median microseconds per call: all calls captured into one CUDA graph, the replay timed by do_bench.

    Falls back to eager calls (launch gaps included, so an overestimate at small batches) if capture fails.
    """
    import torch
    import triton.testing

    for call in calls:  # JIT-compile every kernel before capture
        call()
    torch.cuda.synchronize()
    try:
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for call in calls:
                call()
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph):
            for call in calls:
                call()
        ms = triton.testing.do_bench(graph.replay, warmup=25, rep=150, return_mode="median")
        return ms * 1e3 / len(calls), "cuda_graph", None
    except Exception as err:  # a capture failure must not cost the point its number
        torch.cuda.synchronize()
        state = {"i": 0}

        def step():
            calls[state["i"] % len(calls)]()
            state["i"] += 1

        ms = triton.testing.do_bench(step, warmup=25, rep=150, return_mode="median")
        return ms * 1e3, "eager", repr(err)[:300]


def kernels_seen(call) -> list[dict]:
    """The GPU kernels one eager call launches, from the torch profiler (name, calls, device us)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    rows = [{"name": e.key, "calls": e.count, "device_us": round(e.self_device_time_total, 2)}
            for e in prof.key_averages() if e.self_device_time_total > 0]
    return sorted(rows, key=lambda r: -r["device_us"])


def hbm_bandwidth_gbs() -> float:
    import torch
    import triton.testing

    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    return 2 * src.numel() / (ms * 1e-3) / 1e9


def measure_point(path: str, state_dtype: str, batch: int, tokens: int, fused: bool, hbm_gbs: float) -> dict:
    import torch

    traffic = layer_traffic(REAL, state_dtype, batch, tokens)
    rotations = rotations_for(traffic)
    calls, _ = build_point(path, state_dtype, batch, dims=REAL, tokens=tokens, rotations=rotations, fused=fused,
                           device="cuda", act_dtype=torch.bfloat16)
    us, timing, error = time_calls_us(calls)
    del calls
    torch.cuda.empty_cache()
    point = {
        "path": path, "state_dtype": state_dtype, "batch": batch, "tokens_per_request": tokens,
        "layer_us": round(us, 3), "step_ms": round(us * REAL.layers / 1e3, 4), "timing": timing,
        "rotations": rotations, "bytes_per_layer": traffic, "bytes_per_step": traffic * REAL.layers,
        "achieved_gbs": round(traffic / (us * 1e-6) / 1e9, 1),
        "hbm_fraction": round(traffic / (us * 1e-6) / 1e9 / hbm_gbs, 3),
    }
    if error:
        point["graph_capture_error"] = error
    return point


# ---- capacity (memory model) --------------------------------------------------------------------------------


def capacity_table(free_vram: int) -> dict:
    """Resident requests per state dtype under each mode's default knobs, in the pool KV_MEM=auto gives on a card
    with `free_vram` bytes free: the launcher's own arithmetic (qwen_serving/plan.py, memory.py)."""
    from qwen_serving import plan

    probe = plan.Probe(free_vram=free_vram)
    table: dict = {}
    for mode in ("batch", "single"):
        table[mode] = {}
        for dtype in STATE_DTYPES:
            built = plan.build(mode, {"KV_MEM": "auto", "STATE_DTYPE": dtype}, probe)
            cache = built.cache
            entry = {
                "residents": cache.residents(built.kv_mem, CAPACITY_PROMPT, CAPACITY_ANSWER[mode]),
                "residents_at_4k_prompts": cache.residents(built.kv_mem, 4096, CAPACITY_ANSWER[mode]),
                "max_seqs": built.value("MAX_SEQS"), "pool_bytes": built.kv_mem,
                "state_page_bytes": cache.resident_bytes(), "prefix_cache": cache.prefix_cache,
                "spec": cache.spec, "spec_tokens": cache.spec_tokens, "kv_dtype": cache.kv_dtype,
            }
            if cache.prefix_cache:
                plain = plan.build(mode, {"KV_MEM": "auto", "STATE_DTYPE": dtype, "PREFIX_CACHE": "0"}, probe)
                entry["residents_with_prefix_cache_off"] = plain.cache.residents(
                    plain.kv_mem, CAPACITY_PROMPT, CAPACITY_ANSWER[mode])
            table[mode][dtype] = entry
    return table


# ---- the decision -------------------------------------------------------------------------------------------

MODE_RULES = {
    # mode: (step table, batches that count, tolerance granted to float16, seats wanted)
    "batch": ("decode", "largest", FP16_BATCH_TOLERANCE, "most"),
    "single": ("verify", "all", NOISE, "max_seqs"),
}


def _recommend_mode(mode: str, report: dict) -> dict:
    path, which, tolerance, wanted = MODE_RULES[mode]
    capacity = report.get("capacity", {}).get(mode, {})
    table = report.get("step_ms", {}).get(path, {})
    if not table.get("float16") or "float16" not in capacity:
        return {"state_dtype": None, "line": f"{mode}: undecided, no float16 {path} measurement with a capacity "
                                             "figure in the report"}
    max_seqs = capacity["float16"]["max_seqs"]
    batches = sorted(int(b) for b in table["float16"] if int(b) <= max_seqs)
    if not batches:
        return {"state_dtype": None, "line": f"{mode}: undecided, no float16 {path} batch <= {max_seqs}"}
    if which == "largest":
        batches = batches[-1:]
    # a dtype competes only on the batches float16 was measured at
    measured = [dt for dt in STATE_DTYPES
                if dt in capacity and all(str(b) in table.get(dt, {}) for b in batches)]
    cost = {dt: sum(table[dt][str(b)] for b in batches) / len(batches) for dt in measured}
    seats = {dt: min(capacity[dt]["residents"], max_seqs) for dt in measured}
    most = [dt for dt in measured if seats[dt] == max(seats.values())]
    full = [dt for dt in measured if seats[dt] >= max_seqs]
    if wanted == "most" or not full:
        eligible, among = most, "the dtypes with the most seats"
    else:
        eligible, among = full, f"the dtypes that seat MAX_SEQS={max_seqs}"
    fastest = min(eligible, key=lambda dt: (cost[dt], dt != "float16"))  # a tie goes to float16
    keep_fp16 = "float16" in eligible and cost["float16"] <= cost[fastest] * (1 + tolerance)
    choice = "float16" if keep_fp16 else fastest
    where = f"C{batches[0]}" if len(batches) == 1 else f"mean of C{'/'.join(map(str, batches))}"
    figures = ", ".join(f"{dt} {cost[dt]:.3f} ms / {seats[dt]} seats" for dt in measured)
    if keep_fp16 and fastest == "float16":
        why = f"the fastest of {among}"
    elif keep_fp16:
        why = f"within {tolerance:.0%} of {fastest}, the fastest of {among}"
    elif "float16" in eligible:
        why = f"the fastest of {among}; float16 is {cost['float16'] / cost[choice] - 1:.0%} slower, " \
              f"beyond its {tolerance:.0%} allowance"
    else:
        why = f"the fastest of {among}; float16 is not one of them"
    if choice == "bfloat16":
        why += "; bf16 keeps 7 mantissa bits against fp16's 10: pass the quality gate before switching"
    return {
        "state_dtype": choice, "eligible": eligible, "cost_ms": cost, "seats": seats, "batches": batches,
        "line": f"{mode}: STATE_DTYPE={choice} ({why}; GDN {path} step over {REAL.layers} layers, {where}: "
                f"{figures})",
    }


def recommend(report: dict) -> dict:
    """One STATE_DTYPE per mode from a report's step times and capacity table.

    Batch mode wants capacity: of the dtypes that seat the most requests (resident in the default pool,
    capped at MAX_SEQS), float16 stays unless its plain-decode GDN step at the largest batch is more than
    FP16_BATCH_TOLERANCE (10%) slower than the fastest of them; at C64 the GDN sweep is a fraction of a
    step the GEMMs dominate, so 10% of it is a few % of the step, inside the spec's 5-8% run-to-run spread,
    and not worth a dtype the quality gate has not passed. Single-user mode wants the fastest verify step
    at C1-C8 among the dtypes that seat MAX_SEQS requests (or, if none does, that seat the most); float16
    stays when it is within NOISE (3%) of that fastest.
    """
    return {mode: _recommend_mode(mode, report) for mode in MODE_RULES}


def knob_change(recs: dict) -> str:
    """The edit to qwen_serving/knobs.py's STATE_DTYPE defaults that the recommendation asks for."""
    batch, single = recs["batch"]["state_dtype"], recs["single"]["state_dtype"]
    if batch is None or single is None:
        return "none: the report does not decide every mode (see the lines above)"
    if batch == single == "float16":
        return 'none: _rules(Rule("float16")) stays'
    if batch == single:
        rules = f'_rules(Rule("{batch}"))'
    else:
        rules = f'_rules(Rule("{single}", {{"mode": "single"}}, "bench/state_dtype.py"), Rule("{batch}"))'
    return (f"STATE_DTYPE defaults -> {rules}; update the knob's doc line, the README knob tables "
            "(python -m qwen_serving.knobs --update), and tests/test_plan.py's float16 assertion")


# ---- report -------------------------------------------------------------------------------------------------


def machine() -> dict:
    import torch
    import triton

    info = {"host": platform.node(), "python": platform.python_version(), "torch": torch.__version__,
            "triton": triton.__version__, "cuda": torch.version.cuda}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info |= {"gpu": props.name, "capability": f"{props.major}.{props.minor}",
                 "gpu_memory_gib": round(props.total_memory / memory.GiB, 1)}
    try:
        import vllm

        info |= {"vllm": vllm.__version__, "vllm_path": str(Path(vllm.__file__).parent)}
    except Exception as err:
        info["vllm"] = f"not importable: {err!r}"[:200]
    info["env"] = {k: os.environ[k] for k in ("VLLM_GDN_DECODE_KERNEL", "VLLM_ENABLE_FLA_PACKED_RECURRENT_DECODE",
                                              "VLLM_SSM_CONV_STATE_LAYOUT") if k in os.environ}
    return info


def step_table(points: list[dict]) -> dict:
    table: dict = {}
    for p in points:
        table.setdefault(p["path"], {}).setdefault(p["state_dtype"], {})[str(p["batch"])] = p["step_ms"]
    return table


def finish(report: dict) -> dict:
    report["step_ms"] = step_table(report["points"])
    recs = recommend(report)
    report["recommendation"] = {mode: rec["line"] for mode, rec in recs.items()}
    report["recommended"] = {mode: rec["state_dtype"] for mode, rec in recs.items()}
    report["knob_change"] = knob_change(recs)
    return report


def run_kernels(args, out_path: Path) -> int:
    import torch

    torch.manual_seed(0)
    torch.set_grad_enabled(False)
    dtypes = args.dtypes
    report: dict = {
        "what": "GDN decode-path cost per state dtype at the 27B's shapes (bench/state_dtype.py)",
        "machine": machine(), "dims": vars(REAL) | {"value_dim": REAL.value_dim, "conv_dim": REAL.conv_dim},
        "verify_tokens": args.verify_tokens, "errors": {}, "points": [], "kernels_seen": {},
        "state_bytes_per_request": {dt: {"plain": memory.gdn_state_bytes(dt),
                                         f"k={args.verify_tokens - 1}": memory.gdn_state_bytes(
                                             dt, args.verify_tokens - 1)} for dt in dtypes},
        "capacity": capacity_table(int(args.free_vram_gib * memory.GiB)),
        "capacity_basis": f"KV_MEM=auto pool with {args.free_vram_gib} GiB free, mode defaults, "
                          f"{CAPACITY_PROMPT}-token prompts (memory model)",
    }
    say(f"machine: {report['machine']}")
    report["hbm_bandwidth_gbs"] = round(hbm_bandwidth_gbs(), 1)
    say(f"HBM bandwidth (1 GiB device copy): {report['hbm_bandwidth_gbs']:.0f} GB/s")
    report["vllm_choice"] = {dt: vllm_choice(dt, REAL, args.verify_tokens) for dt in dtypes}
    for dt, choice in report["vllm_choice"].items():
        say(f"{dt}: fused-norm op {'on' if choice['fused_norm_op'] else 'off'}; decode {choice['decode_kernel']}; "
            f"verify {choice['verify_kernel']}")
    for path, batches, tokens in (("decode", args.batches, 1), ("verify", args.verify_batches, args.verify_tokens)):
        for dt in dtypes:
            fused = report["vllm_choice"][dt]["fused_norm_op"]
            for batch in batches:
                key = f"{path}/{dt}/C{batch}"
                try:
                    point = measure_point(path, dt, batch, tokens, fused, report["hbm_bandwidth_gbs"])
                except Exception:  # one broken point must not cost the others their numbers
                    report["errors"][key] = traceback.format_exc()[-3000:]
                    say(f"{key} FAILED:\n{report['errors'][key]}")
                    torch.cuda.empty_cache()
                    continue
                choice = report["vllm_choice"][dt]
                point |= {"recurrent_kernel": choice[f"{path}_kernel"], "norm": choice["norm"]}
                report["points"].append(point)
                say(f"{key}: {point['layer_us']:.1f} us/layer, {point['step_ms']:.3f} ms/step over "
                    f"{REAL.layers} layers, {point['achieved_gbs']:.0f} GB/s ({point['hbm_fraction']:.0%} of HBM), "
                    f"{point['timing']}")
            try:
                calls, _ = build_point(path, dt, batches[-1], dims=REAL, tokens=tokens, rotations=1, fused=fused,
                                       device="cuda", act_dtype=torch.bfloat16)
                report["kernels_seen"].setdefault(path, {})[dt] = kernels_seen(calls[0])
                del calls
            except Exception:
                report["errors"][f"{path}/{dt}/kernels_seen"] = traceback.format_exc()[-3000:]
            write_json_atomic(out_path, finish(report))
    write_json_atomic(out_path, finish(report))
    say(f"wrote {out_path}")
    for line in report["recommendation"].values():
        print(line)
    print(f"knobs.py: {report['knob_change']}")
    return 1 if report["errors"] else 0


# ---- engine level -------------------------------------------------------------------------------------------


def engine_worker(state_dtype: str, model: Path, out_json: Path) -> int:
    """One offline engine with this state dtype: decode step time at C1 and C64 (method in the module doc)."""
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    os.environ.setdefault("VLLM_DISABLED_KERNELS", "MacheteLinearKernel")  # Marlin: the RTX 3090's W4A16 kernel
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=str(model), mamba_ssm_cache_dtype=state_dtype, max_num_seqs=64, max_model_len=1024,
              enable_prefix_caching=False, gdn_prefill_backend="triton", language_model_only=True, seed=0)
    result: dict = {"state_dtype": state_dtype, "method": f"(t({ENGINE_LONG}) - t({ENGINE_SHORT})) / "
                    f"{ENGINE_LONG - ENGINE_SHORT} tokens, min of 2 runs each, greedy, ignore_eos, 64-token prompts",
                    "cohorts": {}}
    for conc in (1, 64):
        prompts = [TokensPrompt(prompt_token_ids=[100 + (7 * i + 31 * j) % 3000 for j in range(64)])
                   for i in range(conc)]
        generation_seconds(llm, prompts, ENGINE_SHORT, SamplingParams)  # warm-up
        short = min(generation_seconds(llm, prompts, ENGINE_SHORT, SamplingParams) for _ in range(2))
        long = min(generation_seconds(llm, prompts, ENGINE_LONG, SamplingParams) for _ in range(2))
        result["cohorts"][f"C{conc}"] = {"short_s": round(short, 4), "long_s": round(long, 4),
                                         "step_ms": round((long - short) / (ENGINE_LONG - ENGINE_SHORT) * 1e3, 4)}
        print(f"C{conc}: {result['cohorts'][f'C{conc}']['step_ms']:.3f} ms per decode step", flush=True)
    write_json_atomic(out_json, result)
    return 0


def generation_seconds(llm, prompts, tokens: int, sampling_params) -> float:
    """Wall time of generating exactly `tokens` tokens for every prompt at once."""
    params = sampling_params(max_tokens=tokens, min_tokens=tokens, ignore_eos=True, temperature=0.0)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    lengths = {len(o.outputs[0].token_ids) for o in outs}
    if lengths != {tokens}:
        raise RuntimeError(f"asked for {tokens} tokens per request, got {sorted(lengths)}")
    return elapsed


def gdn_layers_of(model: Path) -> int:
    config = json.loads((model / "config.json").read_text())
    types = config.get("text_config", config).get("layer_types", [])
    return sum(t == "linear_attention" for t in types)


def ensure_shape_checkpoint(model: Path) -> None:
    if (model / "config.json").exists():
        return
    cmd = [sys.executable, "-m", "qwen_serving.checkpoint.synth", "--size", "shape", "--layers", "8", "--out", str(model),
           "--seed", "0"]
    say(f"no checkpoint at {model}: {' '.join(cmd)}")
    subprocess.run(cmd, cwd=REPO, check=True)


def engine_summary(engine: dict, gdn_layers: int) -> dict:
    """Step-time differences against float16, and what they would be over the full model's 48 GDN layers."""
    base = engine.get("float16", {}).get("cohorts", {})
    summary: dict = {}
    for dt, entry in engine.items():
        for cohort, figures in entry.get("cohorts", {}).items():
            if dt == "float16" or cohort not in base:
                continue
            delta = figures["step_ms"] - base[cohort]["step_ms"]
            summary.setdefault(dt, {})[cohort] = {
                "minus_float16_ms": round(delta, 4),
                "per_gdn_layer_us": round(delta / gdn_layers * 1e3, 2),
                "over_48_gdn_layers_ms": round(delta / gdn_layers * REAL.layers, 3)}
    return summary


def run_engine(args, out_path: Path) -> int:
    args.out.mkdir(parents=True, exist_ok=True)
    ensure_shape_checkpoint(args.model)
    report = json.loads(out_path.read_text()) if out_path.exists() else {}
    report |= {"what": "decode step time per state dtype, offline vLLM on the shape checkpoint "
                       "(bench/state_dtype.py --engine)", "model": str(args.model),
               "gdn_layers": gdn_layers_of(args.model), "machine": machine()}
    report.setdefault("engine", {})
    report.setdefault("errors", {})
    failures = 0
    for dt in args.engine_dtypes:
        log = args.out / f"state-dtype-engine-{dt}.log"
        tmp = args.out / f".state-dtype-engine-{dt}.json"
        tmp.unlink(missing_ok=True)
        cmd = [sys.executable, str(Path(__file__).resolve()), "--engine-worker", dt, "--model", str(args.model),
               "--out", str(tmp)]
        say(f"engine {dt}: starting (about 3 min; log {log})")
        with open(log, "w") as sink:
            proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, cwd=REPO)
            deadline = time.monotonic() + args.engine_timeout
            while proc.poll() is None:
                if time.monotonic() > deadline:
                    proc.kill()
                    proc.wait()
                    break
                time.sleep(15)
                lines = log.read_text(errors="replace").strip().splitlines()
                say(f"engine {dt}: {lines[-1][:160] if lines else '(no output yet)'}")
        text = log.read_text(errors="replace")
        picked = [line.strip() for line in text.splitlines()
                  if "GDN decode kernel:" in line or "Falling back to the Triton GDN decode path" in line]
        if proc.returncode == 0 and tmp.exists():
            report["engine"][dt] = json.loads(tmp.read_text()) | {"log_lines": picked}
            report["errors"].pop(dt, None)
            tmp.unlink()
        else:
            failures += 1
            report["errors"][dt] = f"rc {proc.returncode}: " + text[-3000:]
            say(f"engine {dt} FAILED (rc {proc.returncode}); log: {log}")
        report["vs_float16"] = engine_summary(report["engine"], report["gdn_layers"])
        write_json_atomic(out_path, report)
    say(f"wrote {out_path}: {json.dumps(report['vs_float16'])}")
    return 1 if failures else 0


# ---- command line -------------------------------------------------------------------------------------------


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: give batch sizes of 1 or more")
    return sorted(set(values))


def _dtype_list(text: str) -> list[str]:
    values = [v.strip() for v in text.split(",") if v.strip()]
    bad = [v for v in values if v not in STATE_DTYPES]
    if not values or bad:
        raise argparse.ArgumentTypeError(f"{text!r}: state dtypes are {', '.join(STATE_DTYPES)}")
    return [dt for dt in STATE_DTYPES if dt in values]


def parser() -> argparse.ArgumentParser:
    from qwen_serving import knobs

    draft = knobs.resolve("single", {})["DRAFT_TOKENS"].value
    ap = argparse.ArgumentParser(prog="bench/state_dtype.py", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="Rules and results: docs/state-dtype.md")
    ap.add_argument("--out", type=Path, help="folder for the JSON (the engine worker: the JSON file itself)")
    ap.add_argument("--force", action="store_true", help="replace an existing report")
    ap.add_argument("--dtypes", type=_dtype_list, default=list(STATE_DTYPES), help="state dtypes to measure")
    ap.add_argument("--batches", type=_int_list, default=list(DECODE_BATCHES), help="plain-decode batch sizes")
    ap.add_argument("--verify-batches", type=_int_list, default=list(VERIFY_BATCHES),
                    help="verify-step batch sizes (single-user mode)")
    ap.add_argument("--verify-tokens", type=int, default=draft + 1,
                    help=f"tokens per verify step (default: MTP's DRAFT_TOKENS {draft} + 1)")
    ap.add_argument("--free-vram-gib", type=float, default=REFERENCE_FREE_VRAM_GIB,
                    help="free VRAM of the card the capacity is counted for (default: a headless 24 GiB card)")
    ap.add_argument("--recommend", type=Path, metavar="REPORT",
                    help="print the recommendation of an existing report and exit (no GPU)")
    ap.add_argument("--engine", action="store_true", help="engine-level check instead (~3.5 min per dtype)")
    ap.add_argument("--engine-dtypes", type=_dtype_list, default=list(STATE_DTYPES),
                    help="dtypes for --engine; runs add to an existing engine report")
    ap.add_argument("--engine-timeout", type=int, default=480, help="seconds one engine may take")
    ap.add_argument("--model", type=Path, default=DEFAULT_SHAPE_MODEL,
                    help="shape checkpoint for --engine (made with qwen_serving.checkpoint.synth --size shape --layers 8 "
                         "if missing)")
    ap.add_argument("--engine-worker", choices=STATE_DTYPES,
                    help="internal: run one engine in this process and write --out (what --engine starts)")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    if args.recommend:
        try:
            report = json.loads(args.recommend.read_text())
        except (OSError, ValueError) as err:
            ap.error(f"cannot read the report {args.recommend}: {err}")
        recs = recommend(report)
        for rec in recs.values():
            print(rec["line"])
        print(f"knobs.py: {knob_change(recs)}")
        return 0
    if args.out is None:
        ap.error("--out is required (a folder for the report)")
    if args.verify_tokens < 2:
        ap.error("--verify-tokens counts the verify step's tokens (drafts + 1): 2 or more")
    if args.engine_worker:
        return engine_worker(args.engine_worker, args.model, args.out)
    if args.out.exists() and not args.out.is_dir():
        ap.error(f"--out {args.out} exists and is not a folder")
    out_path = args.out / (ENGINE_RESULT_NAME if args.engine else RESULT_NAME)
    if out_path.exists() and not args.force and not args.engine:
        ap.error(f"{out_path} exists; pass --force to replace it")

    import torch

    if not torch.cuda.is_available():
        print("bench/state_dtype.py measures on a CUDA GPU and none is visible here (torch.cuda.is_available() "
              "is False). Without a GPU only --recommend REPORT works.", file=sys.stderr)
        return 2
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    return run_engine(args, out_path) if args.engine else run_kernels(args, out_path)


if __name__ == "__main__":
    sys.exit(main())
