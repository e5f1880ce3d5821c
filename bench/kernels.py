"""The four Triton kernels against their stock counterparts, on one GPU, at the real model's shapes.

    python bench/kernels.py [--out DIR] [--quick]          # writes DIR/kernels-h200.json and .png
    python bench/kernels.py --plot-only DIR/kernels-h200.json   # PNG from an earlier run (needs matplotlib)
    python bench/kernels.py --only lookup [--out DIR]       # some sections: DIR/kernels-h200-lookup.json, no PNG

- spec_attn (verify step, 24/4 heads, head_dim 256, bf16 paged KV, batch 1) vs vLLM's FlashAttention
  (vllm.vllm_flash_attn.flash_attn_varlen_func, fa_version=2 = the RTX 3090's path, 3 = the H200's default)
  over context lengths, plus the bandwidth our kernel reaches on its KV read.
- topk_topp (5 rows x 248,320, k=20, p=0.95 -> probabilities) vs vLLM's apply_top_k_top_p + softmax, and
  against one read of the logits; and the multi-block softmax alone vs torch's (rows 1, 5, 8 x 248,320: the
  verify step's target rows, where torch gives each row one block), measured before anything calls it.
- lookup (64k-token histories, batch 8) vs a torch unfold search.
- prefill_int8_attn (causal, 24/4 heads, head_dim 256) vs FlashAttention 2 and 3 from 4k tokens up; our time is
  the best of a few tile shapes (every shape's time is in the JSON; m64_n64_w4 is the kernel's default).
Every time is triton.testing.do_bench's median, with inputs rotated across calls so caches do not flatter
anything; the HBM bandwidth is measured in the same run by a large device copy. No network needed.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.report import save_figure  # noqa: E402
from bench.serving import write_json_atomic  # noqa: E402
from qwen_serving import model  # noqa: E402

HQ, HKV, HEAD_DIM, VOCAB = model.Q_HEADS, model.KV_HEADS, model.HEAD_DIM, model.VOCAB
PAGE = 16
PREFILL_CONFIGS = [(64, 64, 4), (64, 64, 8), (128, 64, 8), (128, 32, 8), (64, 32, 4)]  # block_m, block_n, warps
ROTATE_BYTES = 256 << 20  # enough distinct inputs to stream past the L2 cache
RESULT_NAME = "kernels-h200"


def say(msg: str) -> None:
    print(f"[bench/kernels +{time.monotonic() - T0:6.1f}s] {msg}", flush=True)


T0 = time.monotonic()


def median_us(fn_for, copies: int) -> float:
    """Median time of fn_for(i) in microseconds, i cycling over `copies` prepared inputs."""
    import triton.testing

    state = {"i": 0}

    def call():
        fn_for(state["i"] % copies)
        state["i"] += 1

    return triton.testing.do_bench(call, warmup=50, rep=300, return_mode="median") * 1e3


def copies_for(nbytes: int) -> int:
    return max(2, min(32, math.ceil(ROTATE_BYTES / max(nbytes, 1))))


def hbm_bandwidth_gbs() -> float:
    import torch

    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = median_us(lambda i: dst.copy_(src), 1)
    return 2 * src.numel() / (us * 1e-6) / 1e9


def flash_attn():
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    return flash_attn_varlen_func


# ---- spec_attn ------------------------------------------------------------------------------------------------


def spec_attn_point(attn, fa, ctx: int, q_len: int, hbm_gbs: float) -> dict:
    import torch

    scale = HEAD_DIM**-0.5
    pages = -(-ctx // PAGE)
    kv_bytes = ctx * HKV * HEAD_DIM * 2 * 2
    n = copies_for(kv_bytes)
    caches = [torch.randn(pages, PAGE, HKV, 2 * HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(n)]
    qs = [torch.randn(q_len, HQ, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(n)]
    block_table = torch.arange(pages, dtype=torch.int32, device="cuda")[None]
    seq_lens = torch.tensor([ctx], dtype=torch.int32, device="cuda")
    qsl = torch.tensor([0, q_len], dtype=torch.int32, device="cuda")
    out = torch.empty_like(qs[0])

    def ours(i):
        kv = caches[i]  # vLLM 0.28.0 FlashAttention layout: K|V packed per head
        attn(qs[i], kv[..., :HEAD_DIM], kv[..., HEAD_DIM:], block_table, seq_lens, qsl, q_len, scale, out=out)

    def stock(version):
        def run(i):
            kv = caches[i]
            fa(qs[i], kv[..., :HEAD_DIM], kv[..., HEAD_DIM:], max_seqlen_q=q_len, cu_seqlens_q=qsl,
               max_seqlen_k=ctx, seqused_k=seq_lens, softmax_scale=scale, causal=True, block_table=block_table,
               out=out, fa_version=version)

        return run

    row = {"context": ctx, "q_len": q_len, "batch": 1, "kv_bytes": kv_bytes, "ours_us": median_us(ours, n)}
    for version in (2, 3):
        try:
            row[f"fa{version}_us"] = median_us(stock(version), n)
            row[f"speedup_vs_fa{version}"] = row[f"fa{version}_us"] / row["ours_us"]
        except Exception as err:  # FA3 needs sm90; report, do not hide
            row[f"fa{version}_error"] = repr(err)[:300]
    row["ours_kv_gbs"] = kv_bytes / (row["ours_us"] * 1e-6) / 1e9
    row["ours_kv_fraction_of_hbm"] = row["ours_kv_gbs"] / hbm_gbs
    say(f"spec_attn ctx {ctx} q{q_len}: ours {row['ours_us']:.1f} us, FA2 {row.get('fa2_us', float('nan')):.1f},"
        f" FA3 {row.get('fa3_us', float('nan')):.1f}; KV read {row['ours_kv_gbs']:.0f} GB/s")
    return row


def bench_spec_attn(points: list[tuple[int, int]], hbm_gbs: float) -> list[dict]:
    from qwen_serving.engine.kernels.spec_attn import SpecAttention

    attn = SpecAttention(HQ, HKV, HEAD_DIM, max_batch=1, max_query_len=16, max_splits=64, device="cuda")
    return [spec_attn_point(attn, flash_attn(), ctx, q_len, hbm_gbs) for ctx, q_len in points]


# ---- topk_topp ------------------------------------------------------------------------------------------------


def bench_topk_topp() -> dict:
    import torch

    from qwen_serving.engine.kernels.topk_topp import top_k_top_p_probs

    rows = 5
    n = copies_for(rows * VOCAB * 4)
    logits = [torch.randn(rows, VOCAB, device="cuda") * 3 for _ in range(n)]
    k = torch.full((rows,), 20, dtype=torch.int32, device="cuda")
    p = torch.full((rows,), 0.95, device="cuda")
    probs = torch.empty(rows, VOCAB, device="cuda")
    result = {"rows": rows, "vocab": VOCAB, "k": 20, "p": 0.95}
    result["logits_read_us"] = median_us(lambda i: torch.amax(logits[i], dim=-1), n)
    result["ours_us"] = median_us(lambda i: top_k_top_p_probs(logits[i], k, p, 20, out=probs), n)
    result["ours_over_read"] = result["ours_us"] / result["logits_read_us"]
    try:
        from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

        work = [x.clone() for x in logits]

        def stock(i):
            work[i].copy_(logits[i])  # vLLM masks in place
            apply_top_k_top_p(work[i], k, p).softmax(dim=-1)

        result["vllm_us"] = median_us(stock, n) - median_us(lambda i: work[i].copy_(logits[i]), n)
        result["speedup_vs_vllm"] = result["vllm_us"] / result["ours_us"]
    except Exception as err:
        result["vllm_error"] = repr(err)[:300]
    say(f"topk_topp: ours {result['ours_us']:.1f} us = {result['ours_over_read']:.1f}x one logits read "
        f"({result['logits_read_us']:.1f} us); vLLM {result.get('vllm_us', float('nan')):.1f} us")
    return result


def softmax_point(rows: int) -> dict:
    import torch

    from qwen_serving.engine.kernels.topk_topp import softmax

    n = copies_for(rows * VOCAB * 4)
    logits = [torch.randn(rows, VOCAB, device="cuda") * 3 for _ in range(n)]
    probs = torch.empty(rows, VOCAB, device="cuda")
    row = {"rows": rows, "vocab": VOCAB,
           "ours_us": median_us(lambda i: softmax(logits[i], out=probs), n),
           "torch_us": median_us(lambda i: torch.softmax(logits[i], dim=-1, out=probs), n),
           "max_abs_diff": float((softmax(logits[0]) - logits[0].softmax(-1)).abs().max())}
    row["speedup_vs_torch"] = row["torch_us"] / row["ours_us"]
    say(f"softmax {rows} x {VOCAB}: ours {row['ours_us']:.1f} us, torch {row['torch_us']:.1f} us")
    return row


def bench_softmax() -> list[dict]:
    return [softmax_point(rows) for rows in (1, 5, 8)]


# ---- lookup ---------------------------------------------------------------------------------------------------


def torch_lookup(history, lengths, num_draft: int, nmin: int = 6, nmax: int = 12):
    """The stock way: for each suffix length, compare every window (torch unfold) and keep the last hit."""
    import torch

    batch, width = history.shape
    positions = torch.arange(width, device=history.device)
    best_cont = torch.zeros(batch, dtype=torch.long, device=history.device)
    best_len = torch.zeros(batch, dtype=torch.long, device=history.device)
    for n in range(nmax, nmin - 1, -1):
        suffix = history.gather(1, (lengths[:, None] - n + positions[:n]).clamp(min=0))
        hits = (history.unfold(1, n, 1) == suffix[:, None, :]).all(dim=-1)
        hits &= positions[: width - n + 1][None] <= (lengths - n - 1)[:, None]
        last = torch.where(hits, positions[: width - n + 1][None], -1).amax(dim=1)
        take = (best_len == 0) & (last >= 0)
        best_cont = torch.where(take, last + n, best_cont)
        best_len = torch.where(take, n, best_len)
    return history.gather(1, (best_cont[:, None] + positions[:num_draft]).clamp(max=width - 1)), best_len


def bench_lookup() -> dict:
    import torch

    from qwen_serving.engine.kernels.lookup import DEFAULT_BLOCK, LookupDraft, lookup_draft, lookup_scratch

    batch, width, draft = 8, 65536, 8
    n = copies_for(batch * width * 4)
    histories = []
    for _ in range(n):
        h = torch.randint(0, VOCAB, (batch, width), dtype=torch.int32, device="cuda")
        h[:4, -40:] = h[:4, 1000:1040]  # half the batch quotes its own context
        histories.append(h)
    lengths = torch.full((batch,), width, dtype=torch.int32, device="cuda")
    result = {"history": width, "batch": batch, "num_draft": draft}
    # the buffers preallocated, as the engine's ContextLookup holds them: the kernels' time, not allocations
    slots = torch.arange(batch, dtype=torch.int32, device="cuda")
    out = LookupDraft(torch.empty(batch, draft, dtype=torch.int64, device="cuda"),
                      torch.empty(batch, dtype=torch.int32, device="cuda"), torch.empty(batch, dtype=torch.int32, device="cuda"))

    def timed(block: int) -> float:
        scratch = lookup_scratch(batch, width, block, "cuda")
        return median_us(lambda i: lookup_draft(histories[i], lengths, draft, slots=slots, out=out, block=block,
                                                scratch=scratch), n)

    result["ours_us"] = timed(DEFAULT_BLOCK)
    result["ours_us_by_block"] = {block: timed(block) for block in (1024, 2048, 4096, 8192)}  # candidates a program
    result["torch_unfold_us"] = median_us(lambda i: torch_lookup(histories[i], lengths, draft), n)
    result["speedup_vs_torch"] = result["torch_unfold_us"] / result["ours_us"]
    say(f"lookup 64k x 8: ours {result['ours_us']:.1f} us, torch unfold {result['torch_unfold_us']:.1f} us")
    return result


# ---- prefill_int8_attn ----------------------------------------------------------------------------------------


def prefill_point(fa, tokens: int) -> dict:
    import torch

    from qwen_serving.engine.kernels.prefill_int8_attn import prefill_int8_attention

    q = torch.randn(tokens, HQ, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(tokens, HKV, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(tokens, HKV, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    cu = torch.tensor([0, tokens], dtype=torch.int32, device="cuda")
    flops = 4 * tokens * tokens / 2 * HQ * HEAD_DIM  # causal: half of QK^T and of PV
    # one input set: at these sizes the work is compute-bound and far larger than the L2 cache
    row: dict = {"tokens": tokens, "configs": {}}
    for block_m, block_n, warps in PREFILL_CONFIGS:
        name = f"m{block_m}_n{block_n}_w{warps}"
        try:
            row["configs"][name] = median_us(
                lambda i, bm=block_m, bn=block_n, w=warps: prefill_int8_attention(
                    q, k, v, out=out, block_m=bm, block_n=bn, num_warps=w), 1)
        except Exception as err:  # e.g. out of shared memory for a tile shape
            row["configs"][name] = repr(err)[:200]
    timed = {name: us for name, us in row["configs"].items() if isinstance(us, float)}
    row["best_config"] = min(timed, key=timed.get)
    row["ours_us"] = timed[row["best_config"]]
    row["default_config_us"] = timed.get("m64_n64_w4")
    row["ours_tflops"] = flops / (row["ours_us"] * 1e-6) / 1e12
    for version in (2, 3):
        try:
            row[f"fa{version}_us"] = median_us(
                lambda i, ver=version: fa(q, k, v, max_seqlen_q=tokens, cu_seqlens_q=cu, max_seqlen_k=tokens,
                                          cu_seqlens_k=cu, causal=True, out=out, fa_version=ver), 1)
            row[f"speedup_vs_fa{version}"] = row[f"fa{version}_us"] / row["ours_us"]
        except Exception as err:
            row[f"fa{version}_error"] = repr(err)[:300]
    say(f"prefill {tokens}: ours {row['ours_us'] / 1e3:.2f} ms ({row['best_config']}, {row['ours_tflops']:.0f} TFLOPS), "
        f"FA2 {row.get('fa2_us', float('nan')) / 1e3:.2f} ms, FA3 {row.get('fa3_us', float('nan')) / 1e3:.2f} ms")
    return row


def bench_prefill(lengths: list[int]) -> list[dict]:
    return [prefill_point(flash_attn(), tokens) for tokens in lengths]


# ---- report ---------------------------------------------------------------------------------------------------


def machine() -> dict:
    import torch
    import triton

    info = {"host": platform.node(), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__, "cuda": torch.version.cuda}
    try:
        import vllm

        info["vllm"] = vllm.__version__
    except Exception as err:
        info["vllm"] = f"not importable: {err!r}"[:200]
    return info


def targets(report: dict) -> dict:
    spec = {(r["context"], r["q_len"]): r for r in report.get("spec_attn", [])}
    at16 = spec.get((16384, 5), {})
    pre = [r for r in report.get("prefill_int8_attn", []) if r["tokens"] >= 4096 and "speedup_vs_fa2" in r]
    checks = {
        "spec_attn_5x_fa2_at_16k_q5": at16.get("speedup_vs_fa2", 0) >= 5,
        "spec_attn_70pct_hbm_at_16k_q5": at16.get("ours_kv_fraction_of_hbm", 0) >= 0.7,
        "topk_topp_within_2x_logits_read": report.get("topk_topp", {}).get("ours_over_read", math.inf) <= 2,
        "lookup_within_20us": report.get("lookup", {}).get("ours_us", math.inf) <= 20,
        "prefill_faster_than_fa2_from_4k": bool(pre) and all(r["speedup_vs_fa2"] > 1 for r in pre),
    }
    return checks


def plot(report: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        say("matplotlib is not installed: no PNG (render it later: bench/kernels.py --plot-only JSON)")
        return False
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, xkey, title in ((axes[0], "spec_attn", "context", "verify attention, 5 query tokens"),
                                 (axes[1], "prefill_int8_attn", "tokens", "int8-QK causal prefill")):
        rows = [r for r in report.get(key, []) if r.get("q_len", 5) == 5]
        for version, style in ((2, "o-"), (3, "s--")):
            pts = [(r[xkey], r[f"speedup_vs_fa{version}"]) for r in rows if f"speedup_vs_fa{version}" in r]
            if pts:
                ax.plot(*zip(*pts, strict=True), style, label=f"FlashAttention-{version} time / ours")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context tokens")
        ax.set_ylabel("speedup")
        ax.set_title(title)
        ax.legend()
    fig.suptitle(f"qwen_serving kernels vs stock, {report['machine'].get('gpu', '?')}")
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)
    return True


SECTIONS = ("spec_attn", "topk_topp", "softmax", "lookup", "prefill_int8_attn")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results", help="folder for the JSON and PNG")
    parser.add_argument("--quick", action="store_true", help="fewer lengths (a smoke run)")
    parser.add_argument("--plot-only", type=Path, help="render the PNG of an existing JSON and exit")
    parser.add_argument("--only", metavar="NAME[,NAME]", type=lambda s: [n for n in s.split(",") if n],
                        help=f"these sections alone ({', '.join(SECTIONS)}), into their own JSON")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.only or ()) - set(SECTIONS))
    if unknown:
        parser.error(f"--only: no section {', '.join(unknown)} (there are {', '.join(SECTIONS)})")
    if args.plot_only:
        import json

        report = json.loads(args.plot_only.read_text())
        return 0 if plot(report, args.plot_only.with_suffix(".png")) else 1

    import torch

    if not torch.cuda.is_available():
        print("bench/kernels.py needs a CUDA GPU", file=sys.stderr)
        return 2
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    contexts = [1536, 16384] if args.quick else [1536, 4096, 8192, 16384, 32768, 65536]
    prefill_lengths = [4096] if args.quick else [4096, 8192, 16384, 32768, 51200]
    report: dict = {"machine": machine(), "errors": {}}
    say(f"machine: {report['machine']}")
    report["hbm_bandwidth_gbs"] = hbm_bandwidth_gbs()
    say(f"HBM bandwidth (device copy): {report['hbm_bandwidth_gbs']:.0f} GB/s")
    sections = {
        "spec_attn": lambda: bench_spec_attn([(c, 5) for c in contexts] + [(16384, 16)], report["hbm_bandwidth_gbs"]),
        "topk_topp": bench_topk_topp,
        "softmax": bench_softmax,
        "lookup": bench_lookup,
        "prefill_int8_attn": lambda: bench_prefill(prefill_lengths),
    }
    assert tuple(sections) == SECTIONS
    for name, run in sections.items():
        if args.only and name not in args.only:
            continue
        try:
            report[name] = run()
        except Exception:  # one broken section must not cost the others their numbers
            report["errors"][name] = traceback.format_exc()[-3000:]
            say(f"{name} FAILED:\n{report['errors'][name]}")
        torch.cuda.empty_cache()
    at16 = next((r for r in report.get("spec_attn", []) if r["context"] == 16384 and r["q_len"] == 5), {})
    report["spec_attn_speedup_16k_q5"] = at16.get("speedup_vs_fa2")
    report["spec_attn_speedup_vs_fa3_16k_q5"] = at16.get("speedup_vs_fa3")
    report["spec_attn_hbm_fraction_16k_q5"] = at16.get("ours_kv_fraction_of_hbm")
    report["targets_met"] = {k: v for k, v in targets(report).items()  # a section's targets start with its first word
                             if not args.only or any(k.startswith(s.split("_")[0]) for s in args.only)}
    path = args.out / (f"{RESULT_NAME}-{'-'.join(args.only)}.json" if args.only else f"{RESULT_NAME}.json")
    write_json_atomic(path, report)
    say(f"wrote {path}; targets met: {report['targets_met']}")
    if not args.only:  # the figure draws every section
        plot(report, path.with_suffix(".png"))
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
