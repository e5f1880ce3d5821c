"""Figures for the serving harness (bench/): pure functions over `vllm bench serve` result files and
Prometheus /metrics pages, plus the report's chart (bench.serving reads the pages and writes the files).

Definitions used everywhere in this project (and in the product spec's tables):
- decode rate = C x 1000 / mean TPOT (ms), C = the cohort's max concurrency; the rate a user feels
  once generation starts. TPOT excludes the first token, so prefill is not in it.
- tokens per step = 1 + accepted / drafts over the run (1.0 without speculation): vLLM counts one
  draft per request per verify step, and every step emits the accepted drafts plus one token.
- per-position acceptance = accepted at draft position p / drafts (vllm/v1/spec_decode/metrics.py).
All counters come from /metrics deltas taken around one run, so earlier traffic never leaks in.
"""

from __future__ import annotations

import json
import os
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.serving import parse_prometheus

SCHEMA = "qwen-serving-bench/1"

# Prometheus sample names as vLLM 0.28.0 exposes them: prometheus_client appends `_total` to a Counter.
SPEC_DRAFTS = "vllm:spec_decode_num_drafts_total"
SPEC_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
SPEC_ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
SPEC_ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
COUNTERS = {
    "prompt_tokens": "vllm:prompt_tokens_total",
    "generation_tokens": "vllm:generation_tokens_total",
    "prefix_cache_queries": "vllm:prefix_cache_queries_total",
    "prefix_cache_hits": "vllm:prefix_cache_hits_total",
    "preemptions": "vllm:num_preemptions_total",
    "requests_finished": "vllm:request_success_total",
    "spec_drafts": SPEC_DRAFTS,
    "spec_draft_tokens": SPEC_DRAFT_TOKENS,
    "spec_accepted": SPEC_ACCEPTED,
}
CACHE_CONFIG_INFO = "vllm:cache_config_info"

@dataclass
class MetricsSnapshot:
    """The counters the harness reads from one /metrics page, summed over engines and label sets."""

    counters: dict[str, float]
    accepted_per_pos: dict[int, float]
    spec_enabled: bool
    cache_config: dict[str, str] = field(default_factory=dict)


def snapshot(text: str) -> MetricsSnapshot:
    names = {sample_name: key for key, sample_name in COUNTERS.items()}
    counters = dict.fromkeys(COUNTERS, 0.0)
    per_pos: dict[int, float] = {}
    spec_enabled = False
    cache_config: dict[str, str] = {}
    for sample in parse_prometheus(text):
        if sample.name in names:
            counters[names[sample.name]] += sample.value
            spec_enabled |= sample.name == SPEC_DRAFTS
        elif sample.name == SPEC_ACCEPTED_PER_POS:
            pos = int(sample.labels["position"])
            per_pos[pos] = per_pos.get(pos, 0.0) + sample.value
        elif sample.name == CACHE_CONFIG_INFO and not cache_config:
            cache_config = {k: v for k, v in sample.labels.items() if k != "engine"}
    return MetricsSnapshot(counters, per_pos, spec_enabled, cache_config)


def metrics_delta(before: MetricsSnapshot, after: MetricsSnapshot) -> MetricsSnapshot:
    """after - before. A counter that went down means the server restarted between the two pages."""
    counters = {}
    for key in COUNTERS:
        diff = after.counters[key] - before.counters[key]
        if diff < 0:
            raise ValueError(f"counter {COUNTERS[key]} went down ({before.counters[key]:g} -> "
                             f"{after.counters[key]:g}): the server restarted during the run")
        counters[key] = diff
    per_pos = {p: after.accepted_per_pos.get(p, 0.0) - before.accepted_per_pos.get(p, 0.0)
               for p in sorted(set(before.accepted_per_pos) | set(after.accepted_per_pos))}
    return MetricsSnapshot(counters, per_pos, before.spec_enabled and after.spec_enabled, after.cache_config)


def spec_figures(delta: MetricsSnapshot) -> dict[str, Any]:
    """Tokens per step and acceptance over one run; 1.0 tokens per step when nothing speculates."""
    c = delta.counters
    drafts = c["spec_drafts"]
    if not delta.spec_enabled or drafts == 0:
        return {"speculative": delta.spec_enabled, "tokens_per_step": 1.0, "drafts": int(drafts),
                "acceptance_rate": None, "per_position_acceptance": []}
    return {
        "speculative": True,
        "tokens_per_step": 1.0 + c["spec_accepted"] / drafts,
        "drafts": int(drafts),
        "draft_tokens": int(c["spec_draft_tokens"]),
        "accepted_tokens": int(c["spec_accepted"]),
        "draft_tokens_per_step": c["spec_draft_tokens"] / drafts,
        "acceptance_rate": c["spec_accepted"] / c["spec_draft_tokens"] if c["spec_draft_tokens"] else None,
        "per_position_acceptance": [delta.accepted_per_pos[p] / drafts for p in sorted(delta.accepted_per_pos)],
    }


def _require(bench: dict[str, Any], keys: list[str], what: str) -> None:
    missing = [k for k in keys if k not in bench]
    if missing:
        raise ValueError(f"{what}: `vllm bench serve` result lacks {missing} (TTFT/TPOT are only saved when "
                         "the client has a tokenizer: pass --tokenizer if the server's model path is not local)")
    if not bench["completed"]:
        raise ValueError(f"{what}: no request completed ({bench.get('failed', '?')} failed)")


def _stat_block(bench: dict[str, Any], metric: str) -> dict[str, float]:
    return {stat: float(bench[f"{stat}_{metric}_ms"]) for stat in ("mean", "median", "std", "p50", "p90", "p99")
            if f"{stat}_{metric}_ms" in bench}


def cohort_figures(bench: dict[str, Any], concurrency: int, delta: MetricsSnapshot) -> dict[str, Any]:
    """Every figure of one `vllm bench serve` run at max concurrency C, with its /metrics delta."""
    _require(bench, ["completed", "mean_tpot_ms", "mean_ttft_ms", "output_throughput", "total_output_tokens"],
             f"C{concurrency}")
    mean_tpot = float(bench["mean_tpot_ms"])
    if mean_tpot <= 0:
        raise ValueError(f"C{concurrency}: mean TPOT is {mean_tpot} ms (every answer was a single token?)")
    c = delta.counters
    figures: dict[str, Any] = {
        "concurrency": concurrency,
        "requests": int(bench["completed"]),
        "failed": int(bench.get("failed", 0)),
        "decode_tok_s": concurrency * 1000.0 / mean_tpot,
        "per_stream_decode_tok_s": 1000.0 / mean_tpot,
        "e2e_output_tok_s": float(bench["output_throughput"]),
        "total_input_tokens": int(bench.get("total_input_tokens", 0)),
        "total_output_tokens": int(bench["total_output_tokens"]),
        "mean_output_tokens": bench["total_output_tokens"] / bench["completed"],
        "duration_s": float(bench.get("duration", 0.0)),
        "ttft_ms": _stat_block(bench, "ttft"),
        "tpot_ms": _stat_block(bench, "tpot"),
        "itl_ms": _stat_block(bench, "itl"),
        "e2el_ms": _stat_block(bench, "e2el"),
        "server_counters": {k: int(v) for k, v in c.items() if not k.startswith("spec_")},
        "prefix_cache_hit_rate": c["prefix_cache_hits"] / c["prefix_cache_queries"] if c["prefix_cache_queries"] else 0.0,
    }
    figures.update(spec_figures(delta))
    # one engine step emits tokens_per_step tokens per request, so a step costs TPOT x tokens/step
    figures["ms_per_step"] = mean_tpot * figures["tokens_per_step"]
    if "spec_decode_acceptance_length" in bench:
        # vllm bench serve takes its own /metrics delta (without the ready-check request); kept as a cross-check
        figures["bench_acceptance_length"] = float(bench["spec_decode_acceptance_length"])
    return figures


def prefill_figures(bench: dict[str, Any], input_len: int) -> dict[str, Any]:
    """Prefill rate of single-request runs with 1-token answers: prompt tokens / TTFT."""
    _require(bench, ["completed", "mean_ttft_ms", "total_input_tokens"], f"prefill {input_len}")
    mean_prompt = bench["total_input_tokens"] / bench["completed"]
    ttft_s = float(bench["mean_ttft_ms"]) / 1000.0
    return {"input_len": input_len, "requests": int(bench["completed"]), "mean_prompt_tokens": mean_prompt,
            "mean_ttft_ms": ttft_s * 1000.0, "prefill_tok_s": mean_prompt / ttft_s}


def stream_figures(start: float, token_times: list[float]) -> dict[str, Any]:
    """One streamed answer: start time and the arrival time of each content chunk (seconds)."""
    if not token_times:
        raise ValueError("the stream produced no tokens")
    if any(b < a for a, b in zip(token_times, token_times[1:], strict=False)) or token_times[0] < start:
        raise ValueError("token times must be non-decreasing and after the request start")
    decode_s = token_times[-1] - token_times[0]
    return {"tokens": len(token_times), "ttft_ms": (token_times[0] - start) * 1000.0,
            "decode_tok_s": (len(token_times) - 1) / decode_s if decode_s > 0 else None}


def ladder_figures(starts: list[float], streams: list[list[float]]) -> dict[str, Any]:
    """Per-stream and aggregate decode of N concurrent streams.

    aggregate_decode_tok_s counts only the window in which every stream was decoding (from the last
    first-token to the first last-token), so one stream's prefill or tail does not dilute it; None
    when the streams never overlapped (the server ran them one after the other).
    e2e_aggregate_tok_s is all tokens over first request start -> last token.
    """
    per_stream = [stream_figures(s, t) for s, t in zip(starts, streams, strict=True)]
    window_start = max(t[0] for t in streams)
    window_end = min(t[-1] for t in streams)
    in_window = sum(sum(window_start < x <= window_end for x in t) for t in streams)
    rates = [s["decode_tok_s"] for s in per_stream if s["decode_tok_s"] is not None]
    total = sum(len(t) for t in streams)
    return {
        "streams": len(streams),
        "per_stream_decode_tok_s": sum(rates) / len(rates) if rates else None,
        "aggregate_decode_tok_s": in_window / (window_end - window_start) if window_end > window_start else None,
        "e2e_aggregate_tok_s": total / (max(t[-1] for t in streams) - min(starts)),
        "mean_ttft_ms": sum(s["ttft_ms"] for s in per_stream) / len(per_stream),
        "per_stream": per_stream,
    }


@dataclass(frozen=True)
class RunSpec:
    """One `vllm bench serve` call of the harness."""

    name: str  # key in the report: C1, C64, prefill-4096, long-16384
    section: str  # cohorts | prefill | long_context
    concurrency: int
    dataset: str  # custom (the prompts file) | random
    num_prompts: int
    output_len: int
    input_len: int = 0  # random dataset only


SINGLE_COHORTS = (1, 2, 4, 8)
PREFILL_LENS = (1024, 4096, 16384)
LONG_LENS = (8192, 16384, 32768)


def plan_runs(mode: str, *, prefill: bool = False, long: bool = False, cohorts: tuple[int, ...] | None = None,
              num_prompts: int | None = None, prompts_in_file: int = 8) -> list[RunSpec]:
    """single: C1/C2/C4/C8 over the real prompts, 1,024-token answers. batch: C64, random 128 in / 512 out.
    --prefill: one request at a time, 1-token answers, at 1k/4k/16k. --long: C1 decode at 8k/16k/32k."""
    if mode == "single":
        runs = [RunSpec(f"C{c}", "cohorts", c, "custom", num_prompts or prompts_in_file, 1024)
                for c in cohorts or SINGLE_COHORTS]
        if num_prompts and num_prompts > prompts_in_file:
            raise ValueError(f"--num-prompts {num_prompts} > the {prompts_in_file} prompts in the file: vllm bench "
                             "serve would replay prompts into the prefix cache")
    elif mode == "batch":
        runs = [RunSpec(f"C{c}", "cohorts", c, "random", num_prompts or 4 * c, 512, 128) for c in cohorts or (64,)]
    else:
        raise ValueError(f"mode must be single or batch, not {mode!r}")
    if prefill:
        runs += [RunSpec(f"prefill-{n}", "prefill", 1, "random", 3, 1, n) for n in PREFILL_LENS]
    if long:
        runs += [RunSpec(f"long-{n}", "long_context", 1, "random", 2, 512, n) for n in LONG_LENS]
    return runs


WARMUP_OUTPUT_LEN = 16  # a few decode steps at the cohort's batch size


def warmup_run(run: RunSpec) -> RunSpec:
    """The unmeasured call before a run: the same shapes (concurrency, prompt length) with short answers. A
    server's first batch of a new shape compiles and tunes kernels; on the H200 that put 7 s into the p99 TTFT
    of the first C64 run after boot and took 11% off its output rate, with the decode step unchanged."""
    return RunSpec(f"{run.name}-warmup", run.section, run.concurrency, run.dataset, run.concurrency,
                   min(run.output_len, WARMUP_OUTPUT_LEN), run.input_len)


def bench_serve_args(run: RunSpec, *, base_url: str, seed: int, cache_salt: str, result_dir: str,
                     prompts_file: str, tokenizer: str | None = None, ignore_eos: bool = False,
                     temperature: float | None = None, model: tuple[str, str] | None = None) -> list[str]:
    """Arguments after `vllm bench serve` (vLLM 0.28.0 flags) for one run.

    Nothing replays into a prefix cache: the random dataset draws new tokens from --seed, and every
    call carries its own cache_salt, which vLLM folds into the first block hash of each prompt.
    The ready check stays off (its default), so no extra request is sent outside the /metrics window.
    `model` is the server's (id, root) from /v1/models: given, vllm bench serve skips its own model lookup, which
    sends no API key (a keyed server answers it 401).
    """
    extra_body = {"cache_salt": cache_salt}
    args = ["--backend", "openai", "--endpoint", "/v1/completions", "--base-url", base_url,
            "--max-concurrency", str(run.concurrency), "--num-prompts", str(run.num_prompts),
            "--seed", str(seed), "--request-rate", "inf",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
            "--save-result", "--result-dir", result_dir, "--result-filename", f"{run.name}.json",
            "--label", run.name, "--disable-tqdm"]
    if run.dataset == "custom":
        args += ["--dataset-name", "custom", "--dataset-path", prompts_file, "--custom-output-len",
                 str(run.output_len), "--chat-template-kwargs", json.dumps({"enable_thinking": False})]
        if ignore_eos:
            args.append("--ignore-eos")  # random datasets set it themselves
    else:
        args += ["--dataset-name", "random", "--random-input-len", str(run.input_len),
                 "--random-output-len", str(run.output_len), "--random-range-ratio", "0"]
    if model:
        served, root = model
        args += ["--model", root, "--served-model-name", served]
    if tokenizer:
        args += ["--tokenizer", tokenizer]
    if temperature is not None:
        args += ["--temperature", str(temperature)]
    args += ["--extra-body", json.dumps(extra_body)]
    return args


def build_report(*, tag: str, mode: str, machine: dict, server: dict, runs: dict, notes: list[str]) -> dict:
    return {"schema": SCHEMA, "tag": tag, "mode": mode, "machine": machine, "server": server,
            "notes": notes, **runs}


def summary_markdown(report: dict) -> str:
    """The report's headline table, in the layout of the spec's benchmark tables."""
    lines = [f"### {report['tag']} ({report['mode']}, {report['machine'].get('gpu', {}).get('name', '?')})", "",
             "| cohort | decode tok/s | per-stream | e2e tok/s | tokens/step | acceptance by position | mean TTFT ms | mean TPOT ms |",
             "|---|---|---|---|---|---|---|---|"]
    rows = {**report.get("cohorts", {}), **report.get("long_context", {})}
    for name, c in rows.items():
        per_pos = " / ".join(f"{100 * a:.0f}%" for a in c["per_position_acceptance"]) or "-"
        lines.append(f"| {name} | {c['decode_tok_s']:.1f} | {c['per_stream_decode_tok_s']:.1f} | "
                     f"{c['e2e_output_tok_s']:.1f} | {c['tokens_per_step']:.2f} | {per_pos} | "
                     f"{c['ttft_ms']['mean']:.0f} | {c['tpot_ms']['mean']:.2f} |")
    if report.get("prefill"):
        lines += ["", "| prefill input | tok/s | mean TTFT ms |", "|---|---|---|"]
        lines += [f"| {p['input_len']} | {p['prefill_tok_s']:.0f} | {p['mean_ttft_ms']:.0f} |"
                  for p in report["prefill"].values()]
    for note in report.get("notes", []):
        lines.append(f"\n> {note}")
    return "\n".join(lines) + "\n"


def _matplotlib():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        warnings.warn("matplotlib is not installed: no PNG written (the JSON has every figure)", stacklevel=3)
        return None
    return plt


def save_figure(fig, path: Path) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".png")
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=110)
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)


SWEEP_STACKS = {"patched": "ours (the single-user plan)", "stock": "stock vLLM 0.28.0"}


def sweep_markdown(rows: list[dict]) -> str:
    """The k sweep of a scripted run (bench/gpu/scripted_mtp.py's `sweep`) as a markdown table, one row per server,
    with its decode rate against its own stack's server without speculation and against stock's."""
    plain = {r["stack"]: r["decode_tok_s"] for r in rows if r["k"] == 0}

    def times(rate: float | None, base: float | None) -> str:
        return f"{rate / base:.2f}x" if rate and base else "-"

    lines = ["| stack | k | tokens per step | ms per step | decode tok/s | x its plain decode | x stock's plain decode |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['stack']} | {r['k']} | {r['tokens_per_step']:.2f} | {r['ms_per_step']:.2f} | "
              f"{'-' if r['decode_tok_s'] is None else format(r['decode_tok_s'], '.1f')} | "
              f"{times(r['decode_tok_s'], plain.get(r['stack']))} | {times(r['decode_tok_s'], plain.get('stock'))} |"
              for r in rows]
    return "\n".join(lines)


def plot_sweep(rows: list[dict], title: str, path: Path) -> bool:
    """Decode tok/s, tokens per step and ms per step against k, one line per stack. False without matplotlib."""
    plt = _matplotlib()
    if plt is None:
        return False
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for which in sorted({r["stack"] for r in rows}):
        mine = sorted((r for r in rows if r["stack"] == which), key=lambda r: r["k"])
        ks = [r["k"] for r in mine]
        for ax, key in zip(axes, ("decode_tok_s", "tokens_per_step", "ms_per_step"), strict=True):
            ax.plot(ks, [r[key] for r in mine], "o-", label=SWEEP_STACKS.get(which, which))
            ax.set_xlabel("k (drafts per step)")
            ax.set_ylabel(key.replace("_", " "))
    axes[0].legend()
    fig.suptitle(title)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)
    return True


def plot_report(report: dict, path: Path) -> bool:
    """Decode rate and tokens per step per cohort (and prefill rate when measured). False without matplotlib."""
    plt = _matplotlib()
    if plt is None:
        return False
    cohorts = report.get("cohorts", {})
    panels = 2 + bool(report.get("prefill"))
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 4))
    names = list(cohorts)
    axes[0].bar(names, [cohorts[n]["decode_tok_s"] for n in names], label="decode (C x 1000 / TPOT)")
    axes[0].plot(names, [cohorts[n]["e2e_output_tok_s"] for n in names], "ko-", label="end to end")
    axes[0].set_ylabel("tok/s")
    axes[0].legend()
    axes[1].bar(names, [cohorts[n]["tokens_per_step"] for n in names], color="tab:green")
    axes[1].set_ylabel("tokens per step")
    if report.get("prefill"):
        pre = report["prefill"]
        axes[2].bar(list(pre), [p["prefill_tok_s"] for p in pre.values()], color="tab:orange")
        axes[2].set_ylabel("prefill tok/s")
    fig.suptitle(f"{report['tag']} - {report['machine'].get('gpu', {}).get('name', '?')}")
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)
    return True
