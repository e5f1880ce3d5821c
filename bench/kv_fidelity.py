"""Issue #20 item 2, fidelity half: attention output through a KVarN (4-bit K / 2-bit V) cache and through vLLM
0.28.0's int4 per-token-head cache, against 16-bit K and V, on layers of Qwen3.8-27B's attention shape
(24 query heads over 4 KV heads of 256) at 8k / 64k / 200k tokens of context.

    python bench/kv_fidelity.py                                  # GPU: 8k/64k/200k, 4 layers, Triton KVarN
    python bench/kv_fidelity.py --device cpu --impl reference --contexts 2048,8192 --layers 2   # CPU, small
    python bench/kv_fidelity.py --kv-file captured.pt            # K/V/q captured from a real model instead

Writes bench/results/kv-fidelity-<cpu | gpu name>.json (--out, --name): date, machine facts, versions, the
bytes per token of each cache, one row per (context, layer, mode, query kind) and a per-context summary.

Data. Without --kv-file the layers are synthetic, with the statistics that make quantizing K and V hard: keys
with log-normal channel scales, a few 8x outlier channels and a per-channel offset, RoPE on the first 64 of
256 dims (partial_rotary_factor 0.25, theta 1e7) at their true positions; values of rank 32 plus noise, with
log-normal channel scales. Queries sit right after the context: `diffuse` ones are Gaussian, `retrieval` ones
are scaled copies of one earlier key of their KV head (the needle case: one token's V dominates the output).
Synthetic figures are not the model's: a GPU run on captured activations is what decides CTX=huge.
--kv-file takes a torch.save'd list of {"q": [rows, 24, 256], "k": [tokens, 4, 256], "v": same} (one per
layer; the tokens are cut to each --contexts length, rows taken as `captured`).

Every cache keeps what it keeps in serving: KVarN its first tile (the attention sink) and the partial last
tile 16-bit, int4 per-token-head nothing.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.metadata
import math
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.harness import machine_facts  # noqa: E402
from bench.serving import write_json_atomic  # noqa: E402
from qwen_serving import model  # noqa: E402

ROTARY_DIMS = int(model.HEAD_DIM * 0.25)  # partial_rotary_factor
ROPE_THETA = 1e7
VALUE_RANK = 32
OUTLIER_CHANNELS = 4
RETRIEVAL_LOGIT = 12.0  # the needle's logit above an average key's: a peaked but not one-hot softmax
DEFAULT_CONTEXTS = (8192, 65536, 200_000)


def say(msg: str) -> None:
    print(f"[kv_fidelity +{time.monotonic() - T0:6.1f}s] {msg}", flush=True)


T0 = time.monotonic()


def rope(x, positions):
    """Neox-style rotary embedding on the first ROTARY_DIMS dims of [tokens, heads, D]."""
    import torch

    half = ROTARY_DIMS // 2
    inv = ROPE_THETA ** (-torch.arange(half, device=x.device, dtype=torch.float64) / half)
    ang = (positions.double()[:, None] * inv[None, :]).float()
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    a, b = x[..., :half], x[..., half:ROTARY_DIMS]
    return torch.cat([a * cos - b * sin, b * cos + a * sin, x[..., ROTARY_DIMS:]], -1)


def synthetic_layer(tokens: int, rows: int, seed: int, device: str) -> dict:
    import torch

    g = torch.Generator(device="cpu").manual_seed(seed)
    hkv, hq, d = model.KV_HEADS, model.Q_HEADS, model.HEAD_DIM

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(device)

    scale = (randn(1, hkv, d) * 0.8).exp()
    scale[..., torch.randperm(d, generator=g)[:OUTLIER_CHANNELS].to(device)] *= 8.0
    k = randn(tokens, hkv, d) * scale + randn(1, hkv, d) * 0.5 * scale
    k = rope(k, torch.arange(tokens, device=device)).bfloat16()
    basis = randn(hkv, VALUE_RANK, d) / math.sqrt(VALUE_RANK)
    v = torch.einsum("thr,hrd->thd", randn(tokens, hkv, VALUE_RANK), basis) + 0.5 * randn(tokens, hkv, d)
    v = (v * (randn(1, hkv, d) * 0.3).exp()).bfloat16()
    group = hq // hkv
    diffuse = randn(rows, hq, d)
    pick = torch.randint(0, tokens, (rows, hkv), generator=g).to(device)
    needle = k.float()[pick, torch.arange(hkv, device=device)[None, :]]  # [rows, hkv, d]
    typical = k.float().norm(dim=-1).mean()
    alpha = RETRIEVAL_LOGIT * math.sqrt(d) / typical ** 2
    retrieval = (needle * alpha).repeat_interleave(group, 1) + 0.05 * diffuse
    return {"diffuse": diffuse.bfloat16(), "retrieval": retrieval.bfloat16(), "k": k, "v": v}


def captured_layers(path: Path, tokens: int, device: str) -> list[dict]:
    import torch

    layers = torch.load(path, map_location=device)
    out = []
    for i, layer in enumerate(layers):
        if layer["k"].shape[0] < tokens:
            raise SystemExit(f"{path}: layer {i} holds {layer['k'].shape[0]} tokens, fewer than {tokens}")
        out.append({"captured": layer["q"].bfloat16(), "k": layer["k"][:tokens].bfloat16(),
                    "v": layer["v"][:tokens].bfloat16()})
    return out


def measure_layer(layer: dict, impl: str) -> list[dict]:
    from qwen_serving.engine.kernels import kv_fidelity as fid

    k, v = layer["k"], layer["v"]
    kinds = {name: q for name, q in layer.items() if name not in ("k", "v")}
    refs = {name: fid.attention(q, k, v) for name, q in kinds.items()}
    rows = []
    for mode in fid.MODES[1:]:
        start = time.monotonic()
        kq, vq = fid.roundtrip(mode, k, v, impl=impl)
        quant_s = time.monotonic() - start
        cache_err = {"k_rel_rms_err": ((kq - k.float()).norm() / k.float().norm()).item(),
                     "v_rel_rms_err": ((vq - v.float()).norm() / v.float().norm()).item()}
        for name, q in kinds.items():
            rows.append({"mode": mode, "queries": name, **fid.fidelity(fid.attention(q, kq, vq), refs[name]),
                         **cache_err, "roundtrip_s": round(quant_s, 3)})
        del kq, vq
    return rows


def summarize(rows: list[dict]) -> dict:
    out: dict = {}
    for r in rows:
        s = out.setdefault(str(r["context"]), {}).setdefault(r["mode"], {}).setdefault(r["queries"], {
            "cos_min": 1.0, "cos_mean": [], "max_abs_err": 0.0, "rel_rms_err": 0.0})
        s["cos_min"] = min(s["cos_min"], r["cos_min"])
        s["cos_mean"].append(r["cos_mean"])
        s["max_abs_err"] = max(s["max_abs_err"], r["max_abs_err"])
        s["rel_rms_err"] = max(s["rel_rms_err"], r["rel_rms_err"])
    for per_mode in out.values():
        for per_kind in per_mode.values():
            for s in per_kind.values():
                s["cos_mean"] = sum(s["cos_mean"]) / len(s["cos_mean"])
    return out


def versions() -> dict:
    out = {}
    for name in ("torch", "triton", "vllm"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def cache_bytes() -> dict:
    from qwen_serving import memory

    return {mode: memory.kv_bytes_per_token_layer(mode) for mode in ("auto", "int4_per_token_head", "kvarn")}


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default=",".join(map(str, DEFAULT_CONTEXTS)),
                    help="comma-separated context lengths in tokens")
    ap.add_argument("--layers", type=int, default=4, help="synthetic layers per context (seeds 0..n-1)")
    ap.add_argument("--queries", type=int, default=8, help="query rows of each kind per layer")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda when there is one)")
    ap.add_argument("--impl", choices=("triton", "reference"), default=None,
                    help="KVarN quantizer: the Triton kernels (default on GPU) or the torch reference (default on CPU)")
    ap.add_argument("--kv-file", type=Path, help="captured layers (torch.save'd list of {q, k, v}) instead of synthetic")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    ap.add_argument("--name", help="result file name without .json (default kv-fidelity-<cpu | gpu>)")
    args = ap.parse_args(argv)
    try:
        args.contexts = [int(c) for c in args.contexts.split(",") if c]
    except ValueError:
        ap.error(f"--contexts takes comma-separated integers, got {args.contexts!r}")
    if not args.contexts or min(args.contexts) < 1 or args.layers < 1 or args.queries < 1:
        ap.error("--contexts, --layers and --queries must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from qwen_serving.engine import cpu_compat

    cpu_compat.install()  # a no-op on a CUDA machine; on CPU it lets Triton run in the interpreter
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    impl = args.impl or ("triton" if device == "cuda" else "reference")
    facts = machine_facts()
    tag = "cpu" if device == "cpu" else facts["gpu"].get("name", "gpu").split()[-1].lower()
    report = {"date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "device": device,
              "impl": impl, "machine": facts, "versions": versions(),
              "data": str(args.kv_file) if args.kv_file else "synthetic (see bench/kv_fidelity.py)",
              "shape": {"q_heads": model.Q_HEADS, "kv_heads": model.KV_HEADS, "head_dim": model.HEAD_DIM},
              "kv_bytes_per_token_layer": cache_bytes(), "rows": []}
    if device == "cpu":
        report["note"] = "CPU run at small context: a check of the measurement, not a GPU figure"
    for context in args.contexts:
        layers = (captured_layers(args.kv_file, context, device) if args.kv_file else
                  [synthetic_layer(context, args.queries, seed, device) for seed in range(args.layers)])
        for i, layer in enumerate(layers):
            for row in measure_layer(layer, impl):
                report["rows"].append({"context": context, "layer": i, **row})
                say(f"ctx {context:>7} layer {i} {row['mode']:8} {row['queries']:9} cos min {row['cos_min']:.5f} "
                    f"mean {row['cos_mean']:.5f} max err {row['max_abs_err']:.4g}")
            del layer
            if device == "cuda":
                torch.cuda.empty_cache()
    report["summary"] = summarize(report["rows"])
    path = args.out / f"{args.name or f'kv-fidelity-{tag}'}.json"
    write_json_atomic(path, report)
    say(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
