"""Where vLLM's GPU forward and the float32 reference part ways on a scripted checkpoint: one run, one JSON.

    python bench/gpu/scripted_layers.py MODEL_DIR --out OUT.json [--layers N] [--tokens T] [--budget-s 240] [--compiled]

On the H200, vLLM 0.28.0 serving the scripted full checkpoint answers one constant token for every prompt, as if
its final hidden state were a context-independent vector (docs/scripted-model.md). This loads vLLM in-process
(`vllm.LLM`, VLLM_ENABLE_V1_MULTIPROCESSING=0, enforce_eager, Marlin forced as on the RTX 3090:
VLLM_DISABLED_KERNELS=MacheteLinearKernel, Triton GDN prefill, bf16, no prefix caching) and compares it with
`scripted_reference.Reference` on the same files, phase by phase (OUT.json is rewritten after each):

1. `linears`: every linear module of the first N decoder layers (default 4: three GDN layers and one attention
   layer, every module kind), the embedding and the lm_head, run by vLLM on a fixed random input in the model's
   dtype, against x @ W.T with W the reference's dequantized weight (a fused vLLM module against its checkpoint
   matrices concatenated in vLLM's packed order). Per module and per fused component: relative error and output
   rms ratio; per component the weight rms, so that a branch matrix (v_proj, up_proj, in_proj_z: group scales
   x 0.1 by design) can be read against its unscaled sibling (k_proj, gate_proj, in_proj_qkv).
2. `engine`: forward hooks on every decoder layer (hidden + residual: the residual stream after it), its mixer
   (GDN / attention) and its MLP, and the final norm, over the greedy prefill of a T-token chain walk; the eager
   greedy answer against the designed chain (eager: no torch.compile, no CUDA graphs, unlike the server).
3. `layers`: the reference's per-layer states over the same ids (`Reference.layer_states`), per layer the rms of
   vLLM's and the reference's stream and of their difference, and each branch's rms ratio (vLLM / reference).
4. `logits`: the final hidden through vLLM's lm_head against the reference's logits, argmax against the chain.

`summary` names the first layer whose stream parts from the reference and the modules whose output does not
match their weights. Phases the budget cannot hold are recorded in `skipped`. `--compiled` boots as the server
does (torch.compile, CUDA graphs): the hooks then see nothing, but the linears and the answer are still checked.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from collections.abc import Mapping
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench import harness  # noqa: E402
from qwen_serving.checkpoint.scripted_reference import LM  # noqa: E402

SCHEMA = "qwen-serving scripted-layers/1"
INPUT_ROWS = 16  # rows of the random input each linear is run on
PARTED = 0.1  # stream difference / reference stream rms above which a layer has parted (bf16 drift is far below)
LINEAR_SHARE = 0.25  # of the budget left after boot, for the linears
LOGITS_RESERVE_S = 15  # the lm_head's float32 copy and two [T, V] products
MISMATCH = 0.02  # relative error above which a linear does not compute its weights (bf16 rounding: ~0.003)
ENGINE_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine core in this process: hooks and apply_model reach the model
    "VLLM_DISABLED_KERNELS": "MacheteLinearKernel",  # Marlin, the RTX 3090's int4 kernel, also on sm90
    "VLLM_USE_FLASHINFER_SAMPLER": "0",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}
# The designed branch matrices and the unscaled matrix of the same shape and distribution beside them
BRANCH_SIBLINGS = {"self_attn.v_proj": "self_attn.k_proj", "mlp.up_proj": "mlp.gate_proj",
                   "linear_attn.in_proj_z": "linear_attn.in_proj_qkv"}
_LAYER_LINEAR = re.compile(r"(?:^|\.)layers\.(\d+)\.(.+)\.([^.]+)$")
_CAPTURED = [("stream", re.compile(r"(?:^|\.)layers\.(\d+)$")),
             ("mixer", re.compile(r"(?:^|\.)layers\.(\d+)\.(?:linear_attn|self_attn)$")),
             ("mlp", re.compile(r"(?:^|\.)layers\.(\d+)\.mlp$"))]
_GEMM_INPUTS = [("mixer_in", re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn\.o_proj|linear_attn\.out_proj)$")),
                ("mlp_in", re.compile(r"(?:^|\.)layers\.(\d+)\.mlp\.down_proj$"))]
_BRANCH_INPUTS = [("mixer_norm_in", re.compile(r"(?:^|\.)layers\.(\d+)\.(?:linear_attn|self_attn)$")),
                  ("mlp_norm_in", re.compile(r"(?:^|\.)layers\.(\d+)\.mlp$"))]
BRANCH_NORM = {"mixer": "input_layernorm", "mlp": "post_attention_layernorm"}
OUTPUT_GEMM = {"full_attention": "self_attn.o_proj", "linear_attention": "linear_attn.out_proj"}


# ---------------------------------------------------------------- comparison maths


def rms(x: torch.Tensor) -> float:
    return float(x.double().pow(2).mean().sqrt())


def compare(out: torch.Tensor, expected: torch.Tensor) -> dict:
    """rms of each, `rel_err` = rms(out - expected) / rms(expected), `ratio` = rms(out) / rms(expected)."""
    out, expected = out.double(), expected.double().to(out.device)
    reference = rms(expected)
    mine = rms(out)
    return {"rms": mine, "rms_ref": reference, "rel_err": rms(out - expected) / reference if reference else None,
            "ratio": mine / reference if reference else None}


# ---------------------------------------------------------------- linears


def checkpoint_components(vllm_name: str, packed: Mapping[str, list[str]]) -> list[str]:
    """The checkpoint matrices behind a vLLM decoder-layer linear, in vLLM's packed order: language_model.model.
    layers.3.self_attn.qkv_proj -> model.language_model.layers.3.self_attn.{q,k,v}_proj."""
    match = _LAYER_LINEAR.search(vllm_name)
    if match is None:
        raise ValueError(f"{vllm_name} is not a decoder-layer module")
    layer, parent, leaf = match.groups()
    return [f"{LM}layers.{layer}.{parent}.{part}" for part in packed.get(leaf, [leaf])]


def decoder_linears(model: torch.nn.Module, layers: int) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of the linears of decoder layers 0 .. layers - 1. The GDN's conv1d is a linear module whose
    weight only the conv kernel reads: not a GEMM, left out."""
    out = []
    for name, module in model.named_modules():
        match = _LAYER_LINEAR.search(name)
        if (match and int(match.group(1)) < layers and not name.endswith("conv1d")
                and hasattr(module, "quant_method") and hasattr(module, "input_size")):
            out.append((name, module))
    return out


def _kernel(module: torch.nn.Module) -> str:
    scheme = getattr(module, "scheme", None)
    kernel = getattr(scheme, "kernel", None)
    return type(kernel or scheme or module.quant_method).__name__


def _input(rows: int, cols: int, dtype: torch.dtype, device: torch.device, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=gen).to(device=device, dtype=dtype)


def check_linear(name: str, module: torch.nn.Module, weights, packed: Mapping[str, list[str]],
                 dtype: torch.dtype, device: torch.device, seed: int = 0) -> dict:
    """vLLM's module on a random input against x @ W.T, whole and per fused component."""
    parts = checkpoint_components(name, packed)
    matrices = [weights.linear(part).to(device) for part in parts]
    x = _input(INPUT_ROWS, matrices[0].shape[1], dtype, device, seed)
    with torch.no_grad():
        out = module(x)
    out = (out[0] if isinstance(out, tuple) else out).float()
    expected = x.float() @ torch.cat(matrices).T
    row = {"module": name, "kernel": _kernel(module), "out_cols": out.shape[-1], "ref_cols": expected.shape[-1],
           "components": []}
    out = out[:, : expected.shape[-1]]
    row.update(compare(out, expected))
    start = 0
    for part, matrix in zip(parts, matrices, strict=True):
        stop = start + matrix.shape[0]
        row["components"].append({"name": part, "shape": list(matrix.shape), "weight_rms": rms(matrix),
                                  **compare(out[:, start:stop], expected[:, start:stop])})
        start = stop
    return row


def check_embedding(model: torch.nn.Module, ref, ids: list[int], device: torch.device) -> dict:
    embed = _module(model, "embed_tokens")
    with torch.no_grad():
        out = embed(torch.tensor(ids, device=device)).float()
    return {"module": "embed_tokens", "kernel": _kernel(embed), **compare(out, ref.embed(ids).to(device))}


def check_lm_head(model: torch.nn.Module, weights, dtype: torch.dtype, device: torch.device) -> dict:
    head = _module(model, "lm_head")
    matrix = weights.linear("lm_head").to(device)
    x = _input(INPUT_ROWS, matrix.shape[1], dtype, device, seed=1)
    with torch.no_grad():
        out = head.quant_method.apply(head, x).float()[:, : matrix.shape[0]]
    return {"module": "lm_head", "kernel": _kernel(head), "out_cols": out.shape[-1], "ref_cols": matrix.shape[0],
            **compare(out, x.float() @ matrix.T)}


def _module(model: torch.nn.Module, leaf: str) -> torch.nn.Module:
    found = [m for name, m in model.named_modules() if name.split(".")[-1] == leaf and "mtp" not in name]
    if len(found) != 1:
        raise LookupError(f"{len(found)} modules named {leaf}")
    return found[0]


def sibling_ratios(rows: list[dict]) -> list[dict]:
    """Per designed branch matrix met in `rows`: its weight rms over its sibling's (0.1 by design)."""
    weight = {c["name"]: c["weight_rms"] for row in rows for c in row.get("components", [])}
    out = []
    for name, value in weight.items():
        for branch, sibling in BRANCH_SIBLINGS.items():
            twin = name[: -len(branch)] + sibling
            if name.endswith(branch) and twin in weight:
                out.append({"branch": name, "sibling": twin, "weight_rms_ratio": value / weight[twin]})
    return out


# ---------------------------------------------------------------- per-layer states


class LayerCapture:
    """Forward hooks that keep, from the first forward over at least `tokens` rows (the prefill), every decoder
    layer's residual stream (hidden + residual: vLLM's layers return the MLP output and the stream before it),
    its mixer's and MLP's inputs (the normed stream) and outputs, the inputs of their output GEMMs (o_proj /
    out_proj, down_proj) and the final norm's output, as float32 copies on the CPU (the next layer's fused
    add-norm may work in place)."""

    def __init__(self, model: torch.nn.Module, tokens: int):
        self.tokens = tokens
        self.got: dict[tuple, torch.Tensor] = {}
        self._handles = []
        for name, module in model.named_modules():
            if "mtp" in name:
                continue
            key = ("final",) if name.endswith("model.norm") else None
            for part, pattern in _CAPTURED:
                match = pattern.search(name)
                if match:
                    key = (part, int(match.group(1)))
            if key:
                self._handles.append(module.register_forward_hook(self._hook(key)))
            for part, pattern in _GEMM_INPUTS + _BRANCH_INPUTS:
                match = pattern.search(name)
                if match:  # the input: positional, or the hidden_states keyword (vLLM calls self_attn so)
                    hook = self._hook((part, int(match.group(1))))
                    self._handles.append(module.register_forward_pre_hook(
                        lambda m, args, kwargs, hook=hook: hook(m, (), args[0] if args else kwargs["hidden_states"]),
                        with_kwargs=True))

    def _hook(self, key: tuple):
        def hook(module, args, output):
            if key in self.got:
                return
            if isinstance(output, tuple):  # (hidden, residual) of a layer, (normed, residual) of the final norm
                hidden, residual = output
                output = hidden if key[0] == "final" or residual is None else hidden.float() + residual.float()
            if output.shape[0] >= self.tokens:
                self.got[key] = output[: self.tokens].detach().to("cpu", torch.float32, copy=True)
        return hook

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def compare_layers(got: Mapping[tuple, torch.Tensor], states: dict, kinds: list[str]) -> list[dict]:
    """Per reference layer: stream, mixer and MLP of vLLM (None when not captured) against the reference."""
    rows = []
    for i, layer in enumerate(states["layers"]):
        row = {"layer": i, "kind": kinds[i]}
        for part in ("stream", "mixer", "mlp"):
            mine = got.get((part, i))
            row[part] = None if mine is None else compare(mine, layer[part].cpu())
        rows.append(row)
    return rows


def in_situ(got: Mapping[tuple, torch.Tensor], states: dict, ref, layers: int, device: torch.device) -> list[dict]:
    """For the first `layers` layers, each branch on vLLM's own activations, in three pieces: `input` = vLLM's
    normed branch input against the (1 + w) RMSNorm of the reference's stream there; `output_gemm` = vLLM's branch
    output against its captured output-GEMM input times the reference's weight; `before_gemm` = that product
    against the reference's branch output (what lies between: the attention / GDN kernels, the gated norm, the
    MLP's gate_up and activation)."""
    rows = []
    for i in range(min(layers, len(states["layers"]))):
        kind, layer = ref.layer_types[i], states["layers"][i]
        before = states["embedding"] if i == 0 else states["layers"][i - 1]["stream"]
        streams = {"mixer": before, "mlp": before + layer["mixer"]}
        row = {"layer": i, "kind": kind}
        for part, module in (("mixer", OUTPUT_GEMM[kind]), ("mlp", "mlp.down_proj")):
            normed_in, gemm_in, out = (got.get((key, i)) for key in (f"{part}_norm_in", f"{part}_in", part))
            if normed_in is None or gemm_in is None or out is None:
                row[part] = None
                continue
            stream = streams[part].to(device)
            norm = 1.0 + ref.w.dense(f"{LM}layers.{i}.{BRANCH_NORM[part]}.weight").to(device)
            expected_in = stream * torch.rsqrt(stream.pow(2).mean(-1, keepdim=True) + ref.eps) * norm
            product = (gemm_in.to(device) @ ref.w.linear(f"{LM}layers.{i}.{module}").to(device).T).cpu()
            row[part] = {"input": compare(normed_in, expected_in.cpu()), "output_gemm": compare(out, product),
                         "before_gemm": compare(product, layer[part].cpu())}
        rows.append(row)
    return rows


def first_parted(rows: list[dict]) -> dict | None:
    """The first layer whose stream differs from the reference by more than PARTED of its rms."""
    for row in rows:
        stream = row["stream"]
        if stream is not None and stream["rel_err"] is not None and stream["rel_err"] > PARTED:
            return {"layer": row["layer"], "kind": row["kind"], "stream_rel_err": stream["rel_err"],
                    "mixer_ratio": (row["mixer"] or {}).get("ratio"), "mlp_ratio": (row["mlp"] or {}).get("ratio")}
    return None


def compare_logits(mine: torch.Tensor, reference: torch.Tensor, ids: list[int], chain_next: list[int]) -> dict:
    """[T, V] vLLM logits against the reference's: error, argmax agreement, argmax against the designed chain."""
    cols = reference.shape[-1]
    mine, reference = mine[:, :cols].float().cpu(), reference.float().cpu()
    top = mine[-1].topk(5)
    return {**compare(mine, reference),
            "argmax_agrees": int((mine.argmax(-1) == reference.argmax(-1)).sum()), "positions": len(ids),
            "vllm_argmax_is_chain": int((mine.argmax(-1) == torch.tensor(chain_next)).sum()),
            "reference_argmax_is_chain": int((reference.argmax(-1) == torch.tensor(chain_next)).sum()),
            "vllm_top5_last": [[int(t), round(float(v), 3)] for v, t in zip(top.values, top.indices, strict=True)],
            "reference_at_vllm_top5_last": [round(float(reference[-1, int(t)]), 3) for t in top.indices]}


def summarize(report: dict) -> dict:
    """The lines to read first: which linears miss their weights, where the stream parts, the logits."""
    bad = [row["module"] for row in report.get("linears", []) if (row.get("rel_err") or 0) > MISMATCH]
    out = {"linears_checked": len(report.get("linears", [])), "linears_off": bad,
           "branch_weight_ratios": sorted({round(r["weight_rms_ratio"], 3) for r in report.get("siblings", [])}),
           "errors": sorted(report.get("errors", {}))}
    if "layers" in report:
        out["first_parted_layer"] = first_parted(report["layers"])
        ratios = [(row["layer"], part, row[part]["ratio"]) for row in report["layers"] for part in ("mixer", "mlp")
                  if row[part] is not None and row[part]["ratio"] is not None]
        if ratios:
            out["largest_branch_ratio"] = max(ratios, key=lambda r: abs(math.log(max(r[2], 1e-30))))
    for row in report.get("in_situ", []):
        for part in ("mixer", "mlp"):
            split = row[part] or {}
            for side, limit in (("input", MISMATCH), ("output_gemm", MISMATCH), ("before_gemm", PARTED)):
                if (split.get(side, {}).get("rel_err") or 0) > limit:
                    out.setdefault("in_situ_off", []).append([row["layer"], part, side, split[side]["rel_err"]])
    if "logits" in report:
        out["logits"] = {k: report["logits"][k] for k in ("rel_err", "argmax_agrees", "vllm_argmax_is_chain",
                                                          "reference_argmax_is_chain", "positions")}
    if "engine" in report:
        out["hooks_captured"] = report["engine"]["captured"]  # 0 under --compiled: no layer rows then
        out["answer_is_chain"] = report["engine"]["answer"] == report["engine"]["chain"]
    return out


def table(report: dict) -> str:
    lines = [f"{'module':64} {'kernel':26} {'rel_err':>8} {'ratio':>7}"]
    for row in report.get("linears", []):
        lines.append(f"{row['module'][-64:]:64} {row['kernel'][:26]:26} {row['rel_err']:8.4f} {row['ratio']:7.3f}")
    if report.get("layers"):
        lines.append(f"{'layer':>5} {'kind':16} {'stream':>8} {'ref':>8} {'diff/ref':>8} "
                     f"{'mixer':>8} {'x ref':>8} {'mlp':>8} {'x ref':>8}")
        for row in report["layers"]:
            cells = [row[part] or {} for part in ("stream", "mixer", "mlp")]
            values = [cells[0].get("rms"), cells[0].get("rms_ref"), cells[0].get("rel_err")]
            for cell in cells[1:]:
                values += [cell.get("rms"), cell.get("ratio")]
            lines.append(f"{row['layer']:5} {row['kind']:16} " + " ".join(
                f"{float('nan') if v is None else v:8.4f}" for v in values))
    lines.append("summary " + json.dumps(report.get("summary", {})))
    return "\n".join(lines)


# ---------------------------------------------------------------- the run


def patch_states(vllm_dir: Path) -> dict[str, str]:
    """Each patch of the series: applied or not to the vLLM this run imported."""
    from qwen_serving import patchset

    try:
        result = patchset.evaluate(vllm_dir, patchset.read_series(patchset.DEFAULT_SERIES))
    except patchset.PatchError as err:
        return {"error": str(err)}
    return {name: state.value for name, state in result.states.items()}


def _write(path: Path, report: dict) -> None:
    report["summary"] = summarize(report)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=1))
    tmp.replace(path)


class Run:
    """One run's report, budget and phase bookkeeping; OUT.json is rewritten after every phase."""

    def __init__(self, out: Path, budget_s: float, report: dict):
        self.out, self.budget_s, self.report = out, budget_s, report
        self.start = time.monotonic()
        out.parent.mkdir(parents=True, exist_ok=True)

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.start)

    def done(self, name: str, began: float) -> None:
        self.report["phases_s"][name] = round(time.monotonic() - began, 1)
        _write(self.out, self.report)
        print(f"[{time.monotonic() - self.start:6.1f} s] {name} done", flush=True)


def check_linears(run: Run, model, ref, ids: list[int], layers: int, device, dtype) -> tuple[int, float]:
    """Phase 1 into run.report; returns (decoder weights the reference dequantized, seconds that took)."""
    report = run.report
    packed = getattr(model, "packed_modules_mapping", {})
    stop = time.monotonic() + LINEAR_SHARE * run.left()  # the rest for the engine and reference forwards
    dequantized, dequant_s = 0, 0.0
    report["linears"] = []
    checks = [("embed_tokens", lambda: check_embedding(model, ref, ids, device)),
              ("lm_head", lambda: check_lm_head(model, ref.w, dtype, device))]
    checks += [(name, lambda name=name, module=module: check_linear(name, module, ref.w, packed, dtype, device))
               for name, module in decoder_linears(model, layers)]
    for name, check in checks:
        if time.monotonic() > stop:
            report["skipped"].append(f"linears from {name}")
            break
        began = time.monotonic()
        try:
            report["linears"].append(check())
        except Exception as exc:  # noqa: BLE001 - recorded: the other modules and phases still run
            report["errors"][name] = repr(exc)
            continue
        if "components" in report["linears"][-1]:
            dequant_s += time.monotonic() - began
            dequantized += sum(c["shape"][0] * c["shape"][1] for c in report["linears"][-1]["components"])
    report["siblings"] = sibling_ratios(report["linears"])
    return dequantized, dequant_s


def run_engine(llm, model, ids: list[int], chain: list[int]) -> tuple[dict, dict]:
    """Phase 2: the hooked greedy prefill (and 8 eager tokens); (report entry, captured states)."""
    import vllm

    capture = LayerCapture(model, len(ids))
    try:
        answer = llm.generate([{"prompt_token_ids": ids}],
                              vllm.SamplingParams(max_tokens=len(chain), temperature=0.0, logprobs=5, ignore_eos=True),
                              use_tqdm=False)[0].outputs[0]
    finally:
        capture.remove()
    first = (answer.logprobs or [{}])[0]
    return ({"answer": list(answer.token_ids), "chain": chain, "captured": len(capture.got),
             "first_logprobs": {str(k): round(v.logprob, 3) for k, v in first.items()}}, capture.got)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/gpu/scripted_layers.py", description=__doc__.split("\n")[0])
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layers", type=int, default=4, help="decoder layers whose linears are checked")
    parser.add_argument("--tokens", type=int, default=32, help="length of the chain-walk prompt")
    parser.add_argument("--budget-s", type=float, default=240)
    parser.add_argument("--compiled", action="store_true",
                        help="torch.compile and CUDA graphs as the server runs (no per-layer hooks fire then)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3,
                        help="vLLM's share: the reference dequantizes beside it on the same GPU")
    args = parser.parse_args(argv)
    if not (args.model_dir / "scripted.json").exists():
        parser.error(f"{args.model_dir} is not a scripted checkpoint (no scripted.json)")
    os.environ.update(ENGINE_ENV)
    import vllm
    from vllm.config import set_current_vllm_config

    from qwen_serving.checkpoint.scripted import Design
    from qwen_serving.checkpoint.scripted_reference import Reference

    design = Design.read(args.model_dir)
    ids = design.walk(design.active[len(design.active) // 3], args.tokens - 1)
    report = {"schema": SCHEMA, "model_dir": str(args.model_dir), "env": ENGINE_ENV, "ids": ids,
              "chain_next": [design.next_in_chain(t) for t in ids], "compiled": args.compiled,
              "phases_s": {}, "skipped": [], "errors": {}, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "machine": harness.machine_facts(), "patches": patch_states(Path(vllm.__file__).parent),
              "versions": {"vllm": vllm.__version__, "torch": torch.__version__}}
    run = Run(args.out, args.budget_s, report)

    began = time.monotonic()
    llm = vllm.LLM(model=str(args.model_dir), enforce_eager=not args.compiled, max_model_len=512, max_num_seqs=4,
                   enable_prefix_caching=False, language_model_only=True, gdn_prefill_backend="triton",
                   gpu_memory_utilization=args.gpu_memory_utilization, seed=0)
    model = llm.apply_model(lambda m: m)[0]  # in-process engine core: the model object itself
    embedding = _module(model, "embed_tokens").weight
    device, dtype = embedding.device, embedding.dtype  # the activations' dtype
    run.done("boot", began)
    ref = Reference(args.model_dir, device=device)

    with set_current_vllm_config(llm.llm_engine.vllm_config):  # as inside the engine, for modules run by hand
        began = time.monotonic()
        dequantized, dequant_s = check_linears(run, model, ref, ids, args.layers, device, dtype)
        run.done("linears", began)

        began = time.monotonic()
        report["engine"], got = run_engine(llm, model, ids, design.walk(ids[-1], 8)[1:])
        run.done("engine", began)

        if not got:
            report["skipped"].append("layers and logits (no hook fired: compiled)")
            _write(args.out, report)
            print(table(report))
            return 0
        began = time.monotonic()
        kinds = ref.layer_types
        # the reference's forward costs about its dequantization: fit the layers the budget holds
        body = sum(p.numel() * (8 if p.dtype == torch.int32 else 1) for n, p in model.named_parameters()
                   if "layers." in n and "mtp" not in n)
        estimate = dequant_s / max(1, dequantized) * body
        room = run.left() - LOGITS_RESERVE_S
        layers = None if estimate < room else max(1, int(len(kinds) * room / estimate))
        if layers is not None:
            report["skipped"].append(f"reference layers {layers}..{len(kinds) - 1} (estimated {estimate:.0f} s)")
        with torch.no_grad():
            states = ref.layer_states(ids, layers)
        report["layers"] = compare_layers(got, states, kinds)
        report["in_situ"] = in_situ(got, states, ref, args.layers, device)
        run.done("layers", began)

        began = time.monotonic()
        if states["final"] is not None and ("final",) in got:
            with torch.no_grad():
                mine = model.compute_logits(got[("final",)].to(device=device, dtype=dtype))
                theirs = states["final"] @ ref.w.linear("lm_head").to(device).T
            report["logits"] = compare_logits(mine, theirs, ids, report["chain_next"])
            report["final_hidden"] = compare(got[("final",)], states["final"].cpu())
        else:
            report["skipped"].append("logits (no final hidden)")
        run.done("logits", began)
    print(table(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
