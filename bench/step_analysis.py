"""Where a decode step's time goes: pure functions over a torch-profiler (Kineto/Chrome) trace of a
vLLM 0.28.0 engine, used by bench/step_profile.py and tested on synthetic traces.

Steps are the worker's `execute_context_<n>(<tokens>)_generation_<n>(<tokens>)` annotations
(vllm/v1/worker/gpu_worker.py annotate_profile). A step runs from its annotation's start to the next
step's start, so the period is what one token costs a stream at steady state. Within it:
- kernel time per category (GPU kernels, by name; the lm_head is the step's last GEMM),
- busy = the union of kernel intervals (streams can overlap),
- launch gaps = GPU idle between the step's first and last kernel (the host could not keep up),
- host gaps = GPU idle outside that span (scheduling, sampling sync, bookkeeping),
and on the host: the time of each CUDA API call per step (host_api_table). In a synchronize the host waits
for the GPU (sync_wait_ms); in launch gaps the GPU waits for the host. A step can hold both, and a slower
host shows as less of the first and more of the second (under the profiler, the H200's host spent
1.6-2.2 ms a step launching the decode graph alone).
Bytes per category come from the checkpoint's safetensors headers (weights) and the model config's
shapes (recurrent state, KV cache) at the cache dtypes the server runs with (cache_dtypes: its
/server_info engine config, else the checkpoint's), and are set against a measured device bandwidth.
The step time measured without the profiler comes from the window in which every stream decodes
(measured_step_ms), so other streams' prefill chunks do not inflate it.
"""

from __future__ import annotations

import bisect
import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from qwen_serving import memory, model

CATEGORIES = ("marlin_gemm", "lm_head", "dense_gemm", "gdn", "attention", "norm_act", "sampling", "memory", "other")
GAPS = ("gap_launch", "gap_host")

_RULES = (  # first match wins; lower-case substrings of the kernel name
    ("marlin_gemm", ("marlin", "machete")),
    ("gdn", ("gated_delta", "gdn", "recurrent", "conv1d", "solve_tril", "l2norm", "chunk_", "delta_rule",
             "recompute_w_u", "kkt")),
    ("attention", ("flash", "fmha", "attn", "attention", "reshape_and_cache", "rotary", "rope", "paged",
                   "split_kv", "merge_splits")),  # the last two: our split-KV verify attention (spec-decode-attn)
    ("dense_gemm", ("gemm", "gemv", "nvjet", "cutlass", "xmma", "cublas", "splitk")),
    ("sampling", ("sampl", "topk", "top_k", "top_p", "argmax", "argsort", "multinomial", "exponential",
                  "softmax", "penalt", "cumsum", "radix", "sort")),
    ("norm_act", ("norm", "rsqrt", "silu", "gelu", "act_and_mul", "swiglu", "sigmoid", "softplus",
                  "per_token_quant")),  # W4A8: int8 quantization of each GEMM's activations
    ("memory", ("memcpy", "memset")),
)
_STEP = re.compile(r"^execute_context_(\d+)\((\d+)\)_generation_(\d+)\((\d+)\)")
GEMM_CATEGORIES = ("marlin_gemm", "dense_gemm")


def categorize(kernel_name: str) -> str:
    name = kernel_name.lower()
    if name.startswith("triton_") and "fused" in name:
        # an inductor fusion is named after every op it holds, custom ops included: the RMSNorm feeding a
        # Marlin GEMM is "triton_red_fused_..._rms_norm_marlin_gemm_0", yet the GEMM runs in its own kernel
        name = name.replace("marlin_gemm", "")
    for category, needles in _RULES:
        if any(n in name for n in needles):
            return category
    return "other"


@dataclass(frozen=True)
class Kernel:
    name: str
    start_us: float
    dur_us: float

    @property
    def end_us(self) -> float:
        return self.start_us + self.dur_us


@dataclass(frozen=True)
class StepMark:
    start_us: float
    ctx_requests: int
    ctx_tokens: int
    gen_requests: int
    gen_tokens: int


def read_trace(path: Path) -> dict:
    import gzip

    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)


def trace_events(trace: dict) -> tuple[list[Kernel], list[StepMark]]:
    """GPU kernels and step annotations of a Chrome trace (GPU-side annotation copies preferred)."""
    kernels, cpu_marks, gpu_marks = [], [], []
    for ev in trace.get("traceEvents", []):
        if ev.get("ph") != "X":
            continue
        cat = ev.get("cat", "")
        if cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            kernels.append(Kernel(ev["name"], float(ev["ts"]), float(ev.get("dur", 0.0))))
        elif cat in ("user_annotation", "gpu_user_annotation"):
            m = _STEP.match(ev.get("name", ""))
            if m:
                mark = StepMark(float(ev["ts"]), *(int(g) for g in m.groups()))
                (gpu_marks if cat == "gpu_user_annotation" else cpu_marks).append(mark)
    kernels.sort(key=lambda k: k.start_us)
    return kernels, sorted(gpu_marks or cpu_marks, key=lambda s: s.start_us)


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    return total + (cur_end - cur_start if cur_end is not None else 0.0)


def step_breakdown(kernels: list[Kernel], start_us: float, end_us: float) -> dict[str, float]:
    """Milliseconds per category, gaps, busy and period of one step [start_us, end_us)."""
    mine = [k for k in kernels if start_us <= k.start_us < end_us]
    cats = [categorize(k.name) for k in mine]
    gemm_idx = [i for i, c in enumerate(cats) if c in GEMM_CATEGORIES]
    if gemm_idx:
        last = gemm_idx[-1]
        cats[last] = "lm_head"
        # what follows the logits GEMM and is not model work is the sampler (elementwise, reductions)
        cats[last + 1:] = ["sampling" if c in ("other", "norm_act", "memory") else c for c in cats[last + 1:]]
    out = dict.fromkeys(CATEGORIES, 0.0)
    for k, c in zip(mine, cats, strict=True):
        out[c] += k.dur_us / 1000.0
    clipped = [(k.start_us, min(k.end_us, end_us)) for k in mine]
    busy = _union_us(clipped) / 1000.0
    span = (max(e for _, e in clipped) - mine[0].start_us) / 1000.0 if mine else 0.0
    out["gap_launch"] = span - busy
    out["gap_host"] = (end_us - start_us) / 1000.0 - span
    out["busy"] = busy
    out["period"] = (end_us - start_us) / 1000.0
    out["kernels"] = len(mine)
    return out


def decode_steps(marks: list[StepMark], batch: int) -> list[tuple[float, float]]:
    """[start, next start) of every pure-decode step with `batch` requests decoding (no prefill in it),
    whose next step is also such a step (so the period is a decode-to-decode period)."""
    def is_decode(m: StepMark) -> bool:
        return m.ctx_requests == 0 and m.gen_requests == batch

    return [(a.start_us, b.start_us) for a, b in zip(marks, marks[1:], strict=False) if is_decode(a) and is_decode(b)]


def profile_steps(trace: dict, batch: int, skip: int = 2) -> dict:
    """Mean breakdown over the decode steps at `batch`, dropping the first `skip` (warm-up)."""
    kernels, marks = trace_events(trace)
    windows = decode_steps(marks, batch)[skip:]
    if not windows:
        found = sorted({(m.ctx_requests, m.gen_requests) for m in marks})
        raise ValueError(f"no decode steps with {batch} requests in the trace (context/generation request "
                         f"counts seen: {found[:12]})")
    per_step = [step_breakdown(kernels, a, b) for a, b in windows]
    mean = {k: sum(s[k] for s in per_step) / len(per_step) for k in per_step[0]}
    mean["steps"] = len(per_step)
    return mean


def kernel_table(trace: dict, batch: int, skip: int = 2, top: int = 20) -> list[dict]:
    """The kernels of the decode steps profile_steps averages, by name: microseconds and calls per step,
    largest first (`top` of them), with each name's category."""
    kernels, marks = trace_events(trace)
    windows = decode_steps(marks, batch)[skip:]
    if not windows:
        return []
    time_us: dict[str, float] = {}
    calls: dict[str, int] = {}
    for start, end in windows:
        for k in kernels:
            if start <= k.start_us < end:
                time_us[k.name] = time_us.get(k.name, 0.0) + k.dur_us
                calls[k.name] = calls.get(k.name, 0) + 1
    rows = sorted(time_us, key=time_us.__getitem__, reverse=True)[:top]
    return [{"name": n, "category": categorize(n), "us_per_step": time_us[n] / len(windows),
             "calls_per_step": calls[n] / len(windows)} for n in rows]


def host_api_table(trace: dict, batch: int, skip: int = 2, top: int = 8) -> dict:
    """Host-side CUDA API time of the decode steps profile_steps averages: each call by name (microseconds and
    calls per step, largest first, `top` of them), their total, and sync_wait_ms, the time spent waiting in a
    synchronize. A call belongs to the step whose window holds its start (host and GPU share Kineto's clock;
    a call issued for the next step lands in this one, which evens out over steady steps)."""
    _, marks = trace_events(trace)
    windows = decode_steps(marks, batch)[skip:]
    if not windows:
        return {"total_ms": None, "sync_wait_ms": None, "calls": []}
    starts = [a for a, _ in windows]
    time_us: dict[str, float] = {}
    calls: dict[str, int] = {}
    for ev in trace.get("traceEvents", []):
        if ev.get("ph") != "X" or ev.get("cat") not in ("cuda_runtime", "cuda_driver"):
            continue
        i = bisect.bisect_right(starts, float(ev["ts"])) - 1
        if i < 0 or float(ev["ts"]) >= windows[i][1]:
            continue
        time_us[ev["name"]] = time_us.get(ev["name"], 0.0) + float(ev.get("dur", 0.0))
        calls[ev["name"]] = calls.get(ev["name"], 0) + 1
    n = len(windows)
    rows = sorted(time_us, key=time_us.__getitem__, reverse=True)[:top]
    return {"total_ms": sum(time_us.values()) / n / 1000.0,
            "sync_wait_ms": sum(t for name, t in time_us.items() if "Synchronize" in name) / n / 1000.0,
            "calls": [{"name": name, "us_per_step": time_us[name] / n, "calls_per_step": calls[name] / n,
                       "us_per_call": time_us[name] / calls[name]} for name in rows]}


# ---- bytes moved ---------------------------------------------------------------------------------

_DTYPE_BYTES = {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "F16": 2, "BF16": 2, "I16": 2, "F8_E4M3": 1,
                "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1}


def read_safetensors_header(path: Path) -> dict[str, tuple[str, list[int]]]:
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    return {k: (v["dtype"], v["shape"]) for k, v in header.items() if k != "__metadata__"}


def weight_bytes(tensors: dict[str, tuple[str, list[int]]]) -> dict[str, int]:
    """Bytes a decode step reads per weight category: every quantized linear (Marlin), the lm_head, the
    other dense tensors of the body. The embedding (a row gather) and the MTP module (drafting only)
    are counted apart and not read by a plain decode step."""
    out = {"marlin_gemm": 0, "lm_head": 0, "dense": 0, "embed": 0, "mtp": 0}
    for name, (dtype, shape) in tensors.items():
        n = _DTYPE_BYTES[dtype]
        for dim in shape:
            n *= dim
        if name.startswith("mtp.") or ".mtp." in name:
            out["mtp"] += n
        elif "embed_tokens" in name:
            out["embed"] += n
        elif "lm_head" in name:
            out["lm_head"] += n
        elif re.search(r"\.weight_(packed|scale|zero_point|g_idx|shape)$", name):
            out["marlin_gemm"] += n
        else:
            out["dense"] += n
    return out


PER_TOKEN_HEAD_KV = ("int8_per_token_head", "int4_per_token_head")  # data plus per-head scales (memory.py)


def _dtype_name(name: str) -> str:
    return str(name).removeprefix("torch.").lower()  # "torch.bfloat16" is how /server_info writes a torch.dtype


def element_bytes(dtype: str) -> int:
    """Bytes per element of a vLLM dtype name (model.DTYPE_BYTES)."""
    name = _dtype_name(dtype)
    if name not in model.DTYPE_BYTES:
        raise ValueError(f"no byte size known for dtype {dtype!r} (known: {', '.join(model.DTYPE_BYTES)})")
    return model.DTYPE_BYTES[name]


def kv_bytes_per_token_layer(kv_dtype: str, kv_heads: int, head_dim: int) -> int:
    """Bytes of one token's K and V in one attention layer, at a resolved KV cache dtype."""
    name = _dtype_name(kv_dtype)
    if name in PER_TOKEN_HEAD_KV:
        return memory.kv_bytes_per_token_layer(name, kv_heads, head_dim)
    return 2 * kv_heads * head_dim * element_bytes(name)


def cache_dtypes(text_config: dict, vllm_config: dict | None = None) -> dict[str, str]:
    """The GDN recurrent-state and KV cache dtypes of a vLLM 0.28.0 server, resolved as vLLM does.

    vllm_config is the engine config as `GET /server_info?config_format=json` returns it (a server
    started with VLLM_SERVER_DEV_MODE=1): its cache_config's mamba_ssm_cache_dtype, mamba_cache_dtype
    and cache_dtype, and model_config's dtype. None (no /server_info) = every cache setting "auto",
    the model dtype from the checkpoint: what a server started without cache flags runs with.
    - ssm: mamba_ssm_cache_dtype unless "auto"; else the checkpoint's mamba_ssm_dtype (vLLM's Qwen3.5
      config hook, model_executor/models/config.py, sets it so at start-up); else mamba_cache_dtype
      unless "auto"; else the model dtype (mamba_utils.py _mamba_state_dtype).
    - kv: cache_dtype unless "auto"; else the model dtype (fp8 = fp8_e4m3, one byte).
    Both are checked to have a known byte size here, before anything is measured.
    """
    cache = (vllm_config or {}).get("cache_config") or {}
    model = (vllm_config or {}).get("model_config") or {}
    model_dtype = _dtype_name(model.get("dtype") or text_config.get("dtype") or text_config.get("torch_dtype")
                              or "bfloat16")
    ssm = cache.get("mamba_ssm_cache_dtype", "auto")
    if ssm == "auto":
        ssm = text_config.get("mamba_ssm_dtype") or "auto"
    if ssm == "auto":
        ssm = cache.get("mamba_cache_dtype", "auto")
    if ssm == "auto":
        ssm = model_dtype
    kv = cache.get("cache_dtype", "auto")
    if kv == "auto":
        kv = model_dtype
    out = {"ssm": _dtype_name(ssm), "kv": _dtype_name(kv), "model": model_dtype,
           "source": "server" if vllm_config else "checkpoint"}
    element_bytes(out["ssm"])
    kv_bytes_per_token_layer(out["kv"], 1, 2)
    return out


def state_bytes(text_config: dict, batch: int, ctx_tokens: int, *, ssm_dtype: str, kv_dtype: str) -> dict[str, int]:
    """Per decode step: GDN recurrent state (at ssm_dtype) read and written once per GDN layer and
    request; attention reads every cached K and V (at kv_dtype) of each full-attention layer
    (ctx_tokens per request). Dtypes as cache_dtypes resolves them."""
    types = text_config["layer_types"]
    gdn_layers = sum(t == "linear_attention" for t in types)
    attn_layers = sum(t == "full_attention" for t in types)
    state = (text_config["linear_num_value_heads"] * text_config["linear_key_head_dim"]
             * text_config["linear_value_head_dim"] * element_bytes(ssm_dtype))
    kv = kv_bytes_per_token_layer(kv_dtype, text_config["num_key_value_heads"], text_config["head_dim"])
    return {"gdn": 2 * gdn_layers * batch * state, "attention": attn_layers * batch * ctx_tokens * kv}


# ---- measured step time --------------------------------------------------------------------------

def measured_step_ms(figures: dict, batch: int) -> dict:
    """Milliseconds per decode step of `batch` concurrent streams measured without the profiler, from
    bench.report.ladder_figures. One step makes one token per stream (no speculation), so
    the step time is 1000 x batch / aggregate_decode_tok_s, the rate over the window in which every
    stream decodes. The mean of each stream's own rate (per_stream) is slower: a stream's decode
    window also holds the steps that carry the other streams' prefill chunks. It is the fallback when
    the streams never overlapped (aggregate None); at batch 1 the two are the same."""
    aggregate, per_stream = figures.get("aggregate_decode_tok_s"), figures.get("per_stream_decode_tok_s")
    window_ms = 1000.0 * batch / aggregate if aggregate else None
    per_stream_ms = 1000.0 / per_stream if per_stream else None
    if window_ms is None and per_stream_ms is None:
        raise ValueError("no decode rate measured (every stream produced a single token)")
    return {"ms_per_token": window_ms if window_ms is not None else per_stream_ms,
            "source": "all-streams-decoding window" if window_ms is not None else "per-stream mean (no overlap)",
            "window_ms_per_token": window_ms, "per_stream_ms_per_token": per_stream_ms}


def bandwidth_table(breakdown_ms: dict[str, float], bytes_by_category: dict[str, int],
                    device_gbps: float) -> dict[str, dict[str, float]]:
    """For each category with known bytes: GB moved, achieved GB/s, and the time those bytes take at
    the measured device bandwidth (the roofline) against the time measured."""
    table = {}
    for cat, nbytes in bytes_by_category.items():
        ms = breakdown_ms.get(cat, 0.0)
        roofline_ms = nbytes / (device_gbps * 1e9) * 1000.0
        table[cat] = {"gb": nbytes / 1e9, "ms": ms, "roofline_ms": roofline_ms,
                      "achieved_gbps": nbytes / 1e9 / (ms / 1000.0) if ms > 0 else 0.0,
                      "fraction_of_device": roofline_ms / ms if ms > 0 else 0.0}
    return table
