"""Where one decode step's time goes, at C1 and C64, on a running server started with vLLM's torch profiler:

    vllm serve CKPT ... --profiler-config '{"profiler": "torch", "torch_profiler_dir": "/abs/TRACES",
        "torch_profiler_use_gzip": false, "torch_profiler_with_stack": false}'
    python bench/step_profile.py --url URL --trace-dir /abs/TRACES --model-dir CKPT --out OUT.json

Per batch size B: B streams without the profiler, 4 x --tokens long, give the measured time per step:
1000 x B / their aggregate decode rate over the window in which all B streams decode (the mean of
the streams' own rates also counts steps that carry other streams' prefill; it is kept as
per_stream_ms_per_token, and used only when the streams never overlapped). The same load, --tokens
long, between /start_profile and /stop_profile gives a trace, which bench.step_analysis splits
into kernel time per category and gaps. Bytes per category (weights from the checkpoint's
safetensors headers, GDN state and KV from its config's shapes at the server's cache dtypes, read
from /server_info when the server runs with VLLM_SERVER_DEV_MODE=1, else the checkpoint's, with a
note) are set against the device copy bandwidth measured here (--bandwidth-gbps to give it instead).
Writes OUT.json and OUT.png (stacked bars).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from conc_ladder import document, stream_one  # noqa: E402

from bench import report as br  # noqa: E402
from bench import serving  # noqa: E402
from bench import step_analysis as sp  # noqa: E402


def device_copy_gbps(nbytes: int = 1 << 30) -> float | None:
    """(read + write) bytes per second of a device-to-device copy, best of 10; None without CUDA."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / 1000.0)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / best / 1e9


def run_streams(client: serving.Client, model: str, batch: int, tokens: int, salt: str) -> dict:
    outs = [{} for _ in range(batch)]
    bodies = [{"model": model, "prompt": document(100, f"{salt}-{i}"), "max_tokens": tokens, "ignore_eos": True,
               "temperature": 0, "cache_salt": f"{salt}-{i}", "stream": True,
               "stream_options": {"include_usage": True, "continuous_usage_stats": True}} for i in range(batch)]
    threads = [threading.Thread(target=stream_one, args=(client, b, o)) for b, o in zip(bodies, outs, strict=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    failed = [o.get("error", "no tokens") for o in outs if "error" in o or len(o["times"]) < 2]
    if failed:
        raise RuntimeError(f"{len(failed)} of {batch} streams failed: {failed[0]}")
    return br.ladder_figures([o["start"] for o in outs], [o["times"] for o in outs])


def server_vllm_config(client: serving.Client) -> dict | None:
    """The engine config from /server_info (VLLM_SERVER_DEV_MODE=1), or None with a printed note."""
    try:
        config, status = client.get_json("/server_info?config_format=json", timeout_s=120).get("vllm_config"), 200
    except serving.HttpError as e:
        config, status = None, e.status
    except (OSError, ValueError, AttributeError) as e:
        config, status = None, repr(e)
    if not isinstance(config, dict):
        print(f"note: no engine config from {client.base}/server_info ({status}; start the server with "
              "VLLM_SERVER_DEV_MODE=1): GDN state and KV bytes use the checkpoint config's dtypes "
              "(every cache setting 'auto')", flush=True)
        return None
    return config


def new_trace(trace_dir: Path, before: set[Path], timeout_s: float = 600.0) -> Path:
    """The worker's trace written after /stop_profile (the one with GPU kernels), once its size settles."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        fresh = sorted(set(trace_dir.rglob("*.json*")) - before, key=lambda p: p.stat().st_mtime)
        for path in fresh:
            size = path.stat().st_size
            time.sleep(2.0)
            if path.stat().st_size == size and size > 0:
                try:
                    trace = sp.read_trace(path)
                except (OSError, ValueError, EOFError):
                    continue
                if any(e.get("cat") == "kernel" for e in trace.get("traceEvents", [])):
                    return path
        time.sleep(2.0)
    raise RuntimeError(f"no trace with GPU kernels appeared in {trace_dir} within {timeout_s:.0f} s "
                       "(is the server started with --profiler-config and this torch_profiler_dir?)")


def model_bytes(model_dir: Path) -> tuple[dict[str, int], dict]:
    tensors = {}
    for shard in sorted(model_dir.glob("*.safetensors")):
        tensors.update(sp.read_safetensors_header(shard))
    if not tensors:
        raise RuntimeError(f"no *.safetensors in {model_dir}")
    config = json.loads((model_dir / "config.json").read_text())
    return sp.weight_bytes(tensors), config.get("text_config", config)


def plot(results: dict, path: Path) -> None:
    plt = br._matplotlib()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 5))
    names = list(results)
    bottom = [0.0] * len(names)
    for part in (*sp.CATEGORIES, *sp.GAPS):
        vals = [results[n]["breakdown_ms"][part] for n in names]
        ax.bar(names, vals, bottom=bottom, label=part, hatch="//" if part in sp.GAPS else None)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax.plot(names, [results[n]["measured_ms_per_token"] for n in names], "k_", markersize=40, mew=2,
            label="measured ms/token (no profiler)")
    ax.set_ylabel("ms per decode step")
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    br.save_figure(fig, path)
    plt.close(fig)


def analyze(trace_path: Path, batch: int, step: dict, ctx: int, text_config: dict, weights: dict, dtypes: dict,
            gbps: float | None) -> dict:
    """One batch size's figures from its trace and the step time measured without the profiler."""
    trace = sp.read_trace(trace_path)
    breakdown = sp.profile_steps(trace, batch, skip=4)
    ms_per_token = step["ms_per_token"]
    state = sp.state_bytes(text_config, batch, ctx, ssm_dtype=dtypes["ssm"], kv_dtype=dtypes["kv"])
    moved = {"marlin_gemm": weights["marlin_gemm"], "lm_head": weights["lm_head"], "gdn": state["gdn"],
             "attention": state["attention"]}
    return {
        "batch": batch, "trace": str(trace_path), "breakdown_ms": breakdown,
        "measured_ms_per_token": ms_per_token, "measured_source": step["source"],
        "window_ms_per_token": step["window_ms_per_token"], "per_stream_ms_per_token": step["per_stream_ms_per_token"],
        "profiled_period_over_measured": breakdown["period"] / ms_per_token,
        "kernel_share_of_period": breakdown["busy"] / breakdown["period"],
        "bytes": moved, "bandwidth": sp.bandwidth_table(breakdown, moved, gbps) if gbps else None,
        "top_kernels": sp.kernel_table(trace, batch, skip=4), "host_api": sp.host_api_table(trace, batch, skip=4),
        "context_tokens": ctx,
    }


def print_result(name: str, r: dict) -> None:
    b = r["breakdown_ms"]
    print(f"{name}: period {b['period']:.2f} ms (measured {r['measured_ms_per_token']:.2f} ms/token, "
          f"{r['measured_source']}), kernels {b['busy']:.2f} ms, launch gaps {b['gap_launch']:.2f}, host gaps "
          f"{b['gap_host']:.2f}; Marlin {b['marlin_gemm']:.2f}, lm_head {b['lm_head']:.2f}, GDN {b['gdn']:.2f}, "
          f"attention {b['attention']:.2f}", flush=True)
    host = r["host_api"]
    if host["calls"]:
        print(f"  host: CUDA API {host['total_ms']:.2f} ms a step ({host['calls'][0]['name']} "
              f"{host['calls'][0]['us_per_step'] / 1000:.2f}), waiting for the GPU {host['sync_wait_ms']:.2f}", flush=True)


def reanalyze(args: argparse.Namespace) -> int:
    """Figures of an earlier report computed again from its saved traces with this code (the measured step
    times are the report's own: they need the server)."""
    old = json.loads(args.reanalyze.read_text())
    if not args.model_dir or not (args.model_dir / "config.json").is_file():
        args_error("--reanalyze needs --model-dir: a folder with the checkpoint's config.json (its safetensors "
                   "too, or the report's weight bytes are kept)")
    config = json.loads((args.model_dir / "config.json").read_text())
    text_config = config.get("text_config", config)
    weights = model_bytes(args.model_dir)[0] if any(args.model_dir.glob("*.safetensors")) else old["weight_bytes"]
    vllm_config = None
    if args.server_report:
        vllm_config = (json.loads(args.server_report.read_text()).get("server") or {}).get("vllm_config")
    dtypes = sp.cache_dtypes(text_config, vllm_config)
    results = {}
    for name, r in old["steps"].items():
        trace = args.trace_dir / Path(r["trace"]).name
        if not trace.is_file():
            args_error(f"{trace}: not there (--trace-dir holds the report's traces by file name)")
        step = {"ms_per_token": r["measured_ms_per_token"], "source": r.get("measured_source", "per-stream mean"),
                "window_ms_per_token": r.get("window_ms_per_token"),
                "per_stream_ms_per_token": r.get("per_stream_ms_per_token", r["measured_ms_per_token"])}
        ctx = r.get("context_tokens", 130 + args.tokens // 2)
        results[name] = analyze(trace, r["batch"], step, ctx, text_config, weights, dtypes, old.get("device_copy_gbps"))
        print_result(name, results[name])
    report = {**old, "cache_dtypes": dtypes, "weight_bytes": weights, "steps": results, "definitions": sp.__doc__,
              "reanalyzed": {"from": str(args.reanalyze), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                             "note": "breakdown, bytes and kernel table recomputed from the saved traces; "
                                     "measured step times as recorded on the device"}}
    serving.write_json_atomic(args.out, report)
    plot(results, args.out.with_suffix(".png"))
    print(f"wrote {args.out}")
    return 0


def args_error(message: str) -> None:
    print(f"step_profile: {message}", file=sys.stderr)
    sys.exit(2)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:18020")
    p.add_argument("--api-key", help="default: $VLLM_API_KEY, else the first line of api_key.txt")
    p.add_argument("--trace-dir", type=Path, required=True, help="the server's torch_profiler_dir")
    p.add_argument("--model-dir", type=Path, help="the served checkpoint (safetensors + config); required unless "
                                                   "--reanalyze")
    p.add_argument("--batches", default="1,64")
    p.add_argument("--tokens", type=int, default=48, help="answer length of the profiled requests")
    p.add_argument("--bandwidth-gbps", type=float, help="device copy bandwidth (default: measured here)")
    p.add_argument("--reanalyze", type=Path, metavar="REPORT.json",
                   help="no server: recompute REPORT's figures from its traces (in --trace-dir) with this code")
    p.add_argument("--server-report", type=Path, help="with --reanalyze: a harness report of the same server "
                                                       "(its engine config gives the cache dtypes)")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    if not args.trace_dir.is_dir():
        p.error(f"--trace-dir {args.trace_dir}: not a folder")
    if args.reanalyze:
        return reanalyze(args)
    if not args.model_dir:
        p.error("--model-dir is required")
    batches = [int(b) for b in args.batches.split(",")]
    weights, text_config = model_bytes(args.model_dir)
    gbps = args.bandwidth_gbps or device_copy_gbps()
    client = serving.Client(args.url, serving.api_key(args.api_key))
    model = client.served_model()
    dtypes = sp.cache_dtypes(text_config, server_vllm_config(client))
    print(f"cache dtypes ({dtypes['source']}): GDN state {dtypes['ssm']}, KV {dtypes['kv']}", flush=True)
    results = {}
    ctx = 130 + args.tokens // 2  # ~100 words of prompt plus half the answer, on average
    for batch in batches:
        salt = f"steps-{time.time_ns()}-{batch}"
        print(f"C{batch}: measuring without the profiler ...", flush=True)
        run_streams(client, model, batch, 8, salt + "-warm")
        measured = run_streams(client, model, batch, 4 * args.tokens, salt + "-measure")
        before = set(args.trace_dir.rglob("*.json*"))
        client.post_json("/start_profile", {})
        run_streams(client, model, batch, args.tokens, salt + "-profile")
        client.post_json("/stop_profile", {})
        trace_path = new_trace(args.trace_dir, before)
        results[f"C{batch}"] = analyze(trace_path, batch, sp.measured_step_ms(measured, batch), ctx, text_config,
                                       weights, dtypes, gbps)
        print_result(f"C{batch}", results[f"C{batch}"])
    report = {"url": client.base, "model": model, "model_dir": str(args.model_dir), "device_copy_gbps": gbps,
              "cache_dtypes": dtypes,
              "weight_bytes": weights, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "steps": results,
              "definitions": sp.__doc__}
    serving.write_json_atomic(args.out, report)
    plot(results, args.out.with_suffix(".png"))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
