"""Where a speculative (MTP) step's time goes, side by side for several torch-profiler traces of vLLM 0.28.0:

    python -m bench.spec_profile TRACE... --out OUT.json [--png OUT.png] [--run-json RUN.json] [--meta KEY=VALUE]

vLLM 0.28.0 marks only the whole step (`execute_context_X(Y)_generation_Z(W)`, one annotation per V1
runner step): it emits no annotation around the verify forward, the sampler or the drafter. The phases
are therefore read off the kernel sequence of each step (bench.step_analysis.categorize names the kernels):
- the target's forward starts at the first kernel of the CUDA graph that holds the step's first Marlin GEMM
  (the fused embedding + norm; eager: at that GEMM) and ends before its lm_head;
- a logits GEMM (a head) is a GEMM, dense or Marlin, followed by a sampling kernel (top-k, sort, softmax,
  argmax, exponential, rejection) before any other GEMM: the first one from the forward's start is the
  target's lm_head, each later one closes one draft (MTP) pass. The layers of the body and of the MTP
  layer are GEMMs followed by GEMMs, so position alone tells a head from the body's or the drafter's GEMMs,
  whatever their kernel: stock runs the MTP layer and both heads as bf16 cuBLAS/nvjet GEMMs, our prepared
  checkpoint runs the lm_head, the MTP layer and the 3,707-row draft head as int8 Marlin GEMMs (weight type
  uint8b128) beside the body's int4 ones (uint4b8), and the draft head's scatter of its logits into the
  248k vocabulary (a fill and an index_copy) lands in the draft's sampling;
- each head's sampling runs from the head to the last sampling kernel before the next GEMM (for the target
  head: its top-k/top-p, softmax and the rejection sampler; for a draft head: the draft's sampling);
- a draft pass's body starts at the first CUDA-graph kernel after the previous sampling (vLLM runs the MTP
  layer in piecewise graphs; without graphs, at its first GEMM) and ends before its head;
- everything else after the forward starts is bookkeeping (state copies, drafter input preparation, slot
  mapping, the device-to-host copies of the tokens); kernels before it prepare the step's inputs.
A step is refused (an error, not a wrong split) when its head count is not 1 + k (k = its scheduled tokens
per request - 1), when a draft pass runs a CUDA graph of the verify forward (the target's forward was cut
short: a sampling-like kernel inside the body), or when a GEMM follows the last draft's sampling.
Marlin kernels carry their weight type in their name (the second template argument, a vLLM ScalarType id);
gemm_ms_by_weight gives, per phase, the GEMM time by weight type, so the split can be read against it
(on our checkpoint: verify_forward int4 only, the heads and draft_forward int8 only).

Per phase: kernel_ms (GPU time of its kernels) and wall_ms (from each of its kernels' start to the next
kernel's start: kernel time plus the GPU idle that follows it); host_gap_ms is the idle before the step's
first and after its last kernel. host_ms is the host's side, from the launch calls' correlation ids: per
phase the host time up to each of its ops' launch (Python, then the launch call), plus between_steps (from
the previous step's last launch to this step's first); a phase whose host_ms exceeds its kernel_ms keeps the
GPU waiting unless the host ran ahead during an earlier, longer phase. Under the profiler the host runs
slower (kernel durations hold, idle and host time grow), so each config also carries the step time measured
without the profiler when --run-json gives it, and unexplained_ms = that step time - the kernel time of a
profiled step.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from bench import step_analysis as sp

PHASES = ("prepare", "verify_forward", "verify_lm_head", "verify_sampling", "draft_forward", "draft_lm_head",
          "draft_sampling", "bookkeeping")


@dataclass(frozen=True)
class GpuOp:
    name: str
    start_us: float
    dur_us: float
    graph: int  # CUDA graph id (0: launched outside a graph)
    launched_us: float | None = None  # host end of the CUDA call that launched it (for a graph: cudaGraphLaunch)

    @property
    def category(self) -> str:
        return sp.categorize(self.name)

    @property
    def is_gemm(self) -> bool:
        return self.category in sp.GEMM_CATEGORIES


def gpu_ops(trace: dict) -> list[GpuOp]:
    """GPU kernels, memcpys and memsets of a Chrome trace, by start time, with their CUDA graph ids and the host
    time their launch returned (the runtime/driver call of the same correlation id; None where the trace has none)."""
    events = [ev for ev in trace.get("traceEvents", []) if ev.get("ph") == "X"]
    launched = {ev["args"]["correlation"]: float(ev["ts"]) + float(ev.get("dur", 0.0)) for ev in events
                if ev.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in (ev.get("args") or {})}
    ops = []
    for ev in events:
        if ev.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            args = ev.get("args") or {}
            ops.append(GpuOp(ev["name"], float(ev["ts"]), float(ev.get("dur", 0.0)), int(args.get("graph id", 0)),
                             launched.get(args.get("correlation"))))
    return sorted(ops, key=lambda k: k.start_us)


def _heads(ops: list[GpuOp], first: int) -> list[tuple[int, int]]:
    """(head index, index of the last sampling kernel of its sampling) for every logits GEMM from `first` on."""
    gemms = [i for i in range(first, len(ops)) if ops[i].is_gemm]
    out = []
    for g, nxt in zip(gemms, [*gemms[1:], len(ops)], strict=True):
        sampling = [i for i in range(g + 1, nxt) if ops[i].category == "sampling"]
        if sampling:
            out.append((g, sampling[-1]))
    return out


def split_step(ops: list[GpuOp], k: int) -> dict:
    """Phase labels of one step's GPU ops (sorted by start), for a step that verifies k drafts (k=0: a
    plain decode step). Returns {"labels": [phase per op], "drafts": [[body, head, sampling] index
    ranges per draft]}. Raises ValueError when the kernels do not fit the rules (module docstring)."""
    marlin = [i for i, op in enumerate(ops) if op.category == "marlin_gemm"]
    if not marlin:
        raise ValueError("no Marlin GEMM in the step: the target's forward cannot be found")
    first = marlin[0]
    start = first
    if ops[first].graph:
        while start > 0 and ops[start - 1].graph == ops[first].graph:
            start -= 1
    heads = _heads(ops, first)
    if len(heads) != 1 + k:
        raise ValueError(f"expected {1 + k} logits GEMMs (target + {k} drafts) from the target's first Marlin GEMM "
                         f"on, found {len(heads)}: the kernel sequence does not fit the phase rules")
    labels = ["prepare"] * start + ["bookkeeping"] * (len(ops) - start)
    target_head, target_sampled = heads[0]
    labels[start:target_head] = ["verify_forward"] * (target_head - start)
    labels[target_head] = "verify_lm_head"
    labels[target_head + 1:target_sampled + 1] = ["verify_sampling"] * (target_sampled - target_head)
    target_graphs = {op.graph for op in ops[start:target_head] if op.graph}
    drafts, prev_sampled = [], target_sampled
    for n, (head, sampled) in enumerate(heads[1:], 1):
        first_gemm = next(i for i in range(prev_sampled + 1, head + 1) if ops[i].is_gemm)
        body = next((i for i in range(prev_sampled + 1, first_gemm + 1) if ops[i].graph), first_gemm)
        shared = target_graphs & {op.graph for op in ops[body:head]}
        if shared:
            raise ValueError(f"draft pass {n} runs CUDA graph {min(shared)} of the verify forward: the target's "
                             f"forward was cut before its end (a sampling kernel inside the body?)")
        labels[body:head] = ["draft_forward"] * (head - body)
        labels[head] = "draft_lm_head"
        labels[head + 1:sampled + 1] = ["draft_sampling"] * (sampled - head)
        drafts.append({"forward": (body, head), "lm_head": (head, head + 1), "sampling": (head + 1, sampled + 1)})
        prev_sampled = sampled
    trailing = [op.name for op in ops[prev_sampled + 1:] if op.is_gemm]
    if trailing:
        raise ValueError(f"a GEMM ({trailing[0][:60]}) follows the last head's sampling: it belongs to no phase")
    return {"labels": labels, "drafts": drafts}


_MARLIN_TYPES = re.compile(r"marlin::Marlin<(\d+)l,\s*(\d+)l,")  # ScalarType ids are printed as long literals


def scalar_type_name(type_id: int) -> str:
    """A vLLM ScalarType id as vLLM's ScalarType.__str__ names the type (uint4b8, uint8b128, int8; floats as
    float<bits>_e<e>m<m>, + f for finite-only, + n for a non-IEEE NaN). The id packs, from bit 0 up: exponent
    (8 bits), mantissa (8), signed (1), bias (32, two's complement), finite values only (1), NaN repr (8)."""
    exponent, mantissa, signed = type_id & 0xFF, (type_id >> 8) & 0xFF, (type_id >> 16) & 1
    bias = (type_id >> 17) & 0xFFFFFFFF
    bias -= (bias >> 31) << 32
    finite, nan_repr = (type_id >> 49) & 1, (type_id >> 50) & 0xFF
    bits = exponent + mantissa + signed
    if exponent == 0:
        return f"{'int' if signed else 'uint'}{bits}" + (f"b{bias}" if bias else "")
    ieee = nan_repr == 1 and not finite
    return f"float{bits}_e{exponent}m{mantissa}" + ("" if ieee else "f" * finite + "n" * (nan_repr != 0))


def gemm_weight(op: GpuOp) -> str:
    """What a GEMM kernel multiplies by: "marlin <weight type>" for a Marlin kernel whose name carries its
    template arguments (activation type, weight type, ...), "marlin" when it does not, "dense" otherwise."""
    if op.category != "marlin_gemm":
        return "dense"
    m = _MARLIN_TYPES.search(op.name)
    return f"marlin {scalar_type_name(int(m.group(2)))}" if m else "marlin"


def _by_category(ops: list[GpuOp]) -> dict[str, float]:
    out: dict[str, float] = {}
    for op in ops:
        out[op.category] = out.get(op.category, 0.0) + op.dur_us / 1000.0
    return out


def _host_ms(before: GpuOp | None, mine: list[GpuOp], labels: list[str]) -> dict[str, float] | None:
    """Host milliseconds per phase: the time from the previous op's launch returning to this op's launch returning
    is the host's work towards this op (Python, then the launch call itself); the first op's share, from the
    previous step's last launch, is between_steps (output processing, scheduling, input preparation up to the
    first copy). Ops of one CUDA graph after its first add nothing. None when a launch is missing from the trace."""
    if before is None or before.launched_us is None or any(op.launched_us is None for op in mine):
        return None
    host = dict.fromkeys((*PHASES, "between_steps"), 0.0)
    prev = before.launched_us
    for i, (op, label) in enumerate(zip(mine, labels, strict=True)):
        host["between_steps" if i == 0 else label] += (op.launched_us - prev) / 1000.0
        prev = op.launched_us
    return host


def step_phases(ops: list[GpuOp], start_us: float, end_us: float, k: int) -> dict:
    """Milliseconds per phase of the step [start_us, end_us): kernel, wall and host time, host gap, period,
    and per draft its forward, lm_head and sampling kernel time."""
    first = bisect.bisect_left([op.start_us for op in ops], start_us)
    mine = [op for op in ops[first:] if op.start_us < end_us]
    if not mine:
        raise ValueError(f"no GPU work in the step at {start_us:.0f} us")
    split = split_step(mine, k)
    kernel = dict.fromkeys(PHASES, 0.0)
    wall = dict.fromkeys(PHASES, 0.0)
    nexts = [op.start_us for op in mine[1:]] + [min(max(op.start_us + op.dur_us for op in mine), end_us)]
    for op, label, nxt in zip(mine, split["labels"], nexts, strict=True):
        kernel[label] += op.dur_us / 1000.0
        wall[label] += (nxt - op.start_us) / 1000.0
    period = (end_us - start_us) / 1000.0
    drafts = [{part: sum(op.dur_us for op in mine[a:b]) / 1000.0 for part, (a, b) in d.items()}
              for d in split["drafts"]]
    by_phase: dict[str, list[GpuOp]] = {phase: [] for phase in PHASES}
    for op, label in zip(mine, split["labels"], strict=True):
        by_phase[label].append(op)
    gemm_weights: dict[str, dict[str, float]] = {}
    kernel_us: dict[str, dict[str, float]] = {}
    kernel_calls: dict[str, dict[str, float]] = {}
    for phase, phase_ops in by_phase.items():
        gemm_weights[phase], kernel_us[phase], kernel_calls[phase] = {}, {}, {}
        for op in phase_ops:
            if op.is_gemm:
                weight = gemm_weight(op)
                gemm_weights[phase][weight] = gemm_weights[phase].get(weight, 0.0) + op.dur_us / 1000.0
            kernel_us[phase][op.name] = kernel_us[phase].get(op.name, 0.0) + op.dur_us
            kernel_calls[phase][op.name] = kernel_calls[phase].get(op.name, 0) + 1
    return {"period_ms": period, "kernel_ms": kernel, "wall_ms": wall, "busy_ms": sum(kernel.values()),
            "host_gap_ms": period - sum(wall.values()), "drafts": drafts,
            "verify_forward_by_category": _by_category(by_phase["verify_forward"]),
            "draft_forward_by_category": _by_category(by_phase["draft_forward"]),
            "gemm_ms_by_weight": gemm_weights, "_kernel_us": kernel_us, "_kernel_calls": kernel_calls,
            "host_ms": _host_ms(ops[first - 1] if first else None, mine, split["labels"])}


def _mean(dicts: list[dict], sort: bool = False) -> dict:
    """Key by key mean of per-step dicts (nested dicts and lists of dicts alike): a key a step lacks counts 0, a
    key some step has as None is None."""
    keys = sorted({k for d in dicts for k in d}) if sort else list(dict.fromkeys(k for d in dicts for k in d))
    out = {}
    for key in keys:
        values = [d[key] for d in dicts if key in d]
        sample = values[0]
        if any(v is None for v in values):  # a figure some step could not give (host_ms without launches)
            out[key] = None
        elif isinstance(sample, dict):
            out[key] = _mean([d.get(key, {}) for d in dicts], sort=True)
        elif isinstance(sample, list):
            out[key] = [_mean([v[i] for v in values]) for i in range(len(sample))]
        else:
            out[key] = sum(values) / len(dicts)
    return out


def _phase_kernels(kernel_us: dict[str, dict[str, float]], calls: dict[str, dict[str, float]],
                   top: int) -> dict[str, list[dict]]:
    """Per phase, its `top` kernels by time per step (from the step means of kernel time and calls)."""
    return {phase: [{"name": name, "category": sp.categorize(name), "us_per_step": us[name],
                     "calls_per_step": calls[phase][name]}
                    for name in sorted(us, key=us.__getitem__, reverse=True)[:top]]
            for phase, us in kernel_us.items() if us}


def profile_trace(trace: dict, batch: int = 1, skip: int = 2, top: int = 20) -> dict:
    """Mean phase split over the steady steps of `batch` decoding requests (the first `skip` dropped), the
    top kernels and host API calls of those steps. k comes from the steps' scheduled tokens per request."""
    _, marks = sp.trace_events(trace)
    windows = sp.decode_steps(marks, batch)[skip:]
    if not windows:
        raise ValueError(f"no decode steps with {batch} requests in the trace")
    by_start = {m.start_us: m for m in marks}
    ks = {by_start[a].gen_tokens // by_start[a].gen_requests - 1 for a, _ in windows}
    if len(ks) != 1:
        raise ValueError(f"the steady steps verify different draft counts {sorted(ks)}")
    k = ks.pop()
    ops = gpu_ops(trace)
    steps = []
    for i, (a, b) in enumerate(windows):
        try:
            steps.append(step_phases(ops, a, b, k))
        except ValueError as e:
            raise ValueError(f"step {i + skip} (at {a:.0f} us): {e}") from e
    mean = _mean(steps)
    phase_kernels = _phase_kernels(mean.pop("_kernel_us"), mean.pop("_kernel_calls"), top=8)
    return {"k": k, "steps": len(steps), **mean, "phase_kernels": phase_kernels,
            "kernel_table": sp.kernel_table(trace, batch, skip, top),
            "host_api": sp.host_api_table(trace, batch, skip)}


def trace_name(path: Path) -> str:
    return path.name.removesuffix(".gz").removesuffix(".json").removesuffix(".trace")


def measured_ms(run: dict, name: str) -> float | None:
    """The C1 step time a scripted-mtp run JSON measured without the profiler for server `name`."""
    return (((run.get("measurements") or {}).get(name) or {}).get("c1") or {}).get("ms_per_step")


def build_report(paths: list[Path], run: dict | None, meta: dict, batch: int, skip: int) -> dict:
    configs = []
    for path in paths:
        prof = profile_trace(sp.read_trace(path), batch, skip)
        name = trace_name(path)
        ms = measured_ms(run or {}, name)
        prof = {"name": name, "trace": path.name, "measured_ms_per_step": ms,
                "unexplained_ms": ms - prof["busy_ms"] if ms is not None else None, **prof}
        if run:
            prof["server"] = (run.get("servers") or {}).get(name, {}).get("what")
            prof["spec"] = (((run.get("measurements") or {}).get(name) or {}).get("c1") or {}).get("spec")
        configs.append(prof)
    report = {"schema": "qwen-serving spec-profile/1", **meta, "batch": batch, "skip": skip, "phases": list(PHASES),
              "configs": configs}
    if run:
        report["patches"] = (run.get("patches") or {}).get("series")
    return report


def write_png(report: dict, path: Path) -> bool:
    """Stacked bars of kernel ms per phase (+ the idle rest of the profiled step) and a tick at the step time measured
    without the profiler; False without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        print("spec_profile: matplotlib is not installed here, no PNG written", file=sys.stderr)
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [c["name"] for c in report["configs"]]
    fig, ax = plt.subplots(figsize=(1.8 * len(names) + 3, 5))
    bottom = [0.0] * len(names)
    for phase in (*PHASES, "idle"):
        values = [c["period_ms"] - c["busy_ms"] if phase == "idle" else c["kernel_ms"][phase] for c in report["configs"]]
        ax.bar(names, values, bottom=bottom, label=phase)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    measured = [(n, c["measured_ms_per_step"]) for n, c in zip(names, report["configs"], strict=True)
                if c.get("measured_ms_per_step") is not None]
    if measured:  # the profiled idle is mostly the profiler's own host cost: show the real step beside it
        ax.scatter([n for n, _ in measured], [ms for _, ms in measured], marker="_", s=2000, color="black",
                   zorder=3, label="measured step (no profiler)")
    ax.set_ylabel("ms per step (profiled)")
    ax.legend(fontsize=7, markerscale=0.2)
    fig.tight_layout()
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    os.replace(tmp, path)
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("traces", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--png", type=Path)
    ap.add_argument("--run-json", type=Path, help="a bench/gpu/scripted_mtp.py run JSON: step times, patches")
    ap.add_argument("--meta", action="append", default=[], metavar="KEY=VALUE", help="written at the top level")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--skip", type=int, default=2, help="steady steps to drop first (warm-up)")
    args = ap.parse_args(argv)
    bad = [m for m in args.meta if "=" not in m]
    if bad:
        ap.error(f"--meta takes KEY=VALUE, got {bad[0]!r}")
    meta = dict(m.split("=", 1) for m in args.meta)
    run = json.loads(args.run_json.read_text()) if args.run_json else None
    try:
        report = build_report(args.traces, run, meta, args.batch, args.skip)
    except (ValueError, OSError) as e:
        print(f"spec_profile: {e}", file=sys.stderr)
        return 1
    tmp = args.out.with_name(args.out.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=1) + "\n")
    os.replace(tmp, args.out)
    if args.png:
        write_png(report, args.png)
    for c in report["configs"]:
        k = c["kernel_ms"]
        print(f"{c['name']}: k={c['k']} steps={c['steps']} profiled {c['period_ms']:.2f} ms, kernels {c['busy_ms']:.2f} ms, "
              f"measured {c['measured_ms_per_step'] or float('nan'):.2f} ms | "
              + " ".join(f"{p}={k[p]:.2f}" for p in PHASES))
    return 0


if __name__ == "__main__":
    sys.exit(main())
