"""Capture the drafter's own linear inputs over a prompt set: per-linear Hessian statistics for GPTQ.

The target checkpoint runs forward in float32 on the CPU (or any torch device) through
`scripted_reference.Reference`, the repo's forward of a qwen3_5 checkpoint from its tensors (int4 /
int8 linears dequantized as vLLM holds them). Its `observe` hook sees the input of every MTP
linear; the lm_head's inputs are the rows the lm_head reads when serving: the target's final
hidden states and the MTP module's output (its first draft, rows (ids[i + 1], hidden[i]), as vLLM
feeds it). For each linear the capture keeps sum(x^T x) in float64 and the row count (all GPTQ
needs), except on held-out prompts (every `held_out_every`-th), whose rows are kept raw, up to a
cap, for the error table and never enter the Hessian.

The DFlash2 drafter (`capture_dflash2`): the target's forward gives its residual stream after each of
the drafter's `target_layer_ids`; `dflash2_reference.Dflash2Forward` runs the drafter over it as vLLM
does, observing its 36 matrices: `fc` over every token's target states, each layer's k_proj / v_proj
over every token's normed context row (the context-KV precompute) and over the query blocks, and q/k/v,
o, gate/up, down over one block [token p, mask x 7] per anchor position p (every `anchor_every`-th
token; serving runs one block per step, ~3 tokens apart at the spec's acceptance) attending to the
context before p. Same statistics, held-out rule, file and resume as the fast variant's.

The state is written after every `save_every` prompts into a temp file beside the output and
renamed over it (never half a file); a re-run resumes after the last saved prompt, and refuses a
state made from another checkpoint or another prompt set.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from qwen_serving.checkpoint.console import say
from qwen_serving.checkpoint.draft_vocab import expand_prompt_set, is_held_out, read_prompts
from qwen_serving.checkpoint.model_dir import CheckpointError

FORMAT = 1
DRAFT_HEAD = "mtp.draft_lm_head"  # rows of the lm_head: the fast variant replaces the lm_head, not it
DEFAULT_PROMPTS = Path(__file__).resolve().parents[2] / "prepare" / "calibration_prompts.json"


def fast_variant_modules(weight_map: dict[str, str]) -> list[str]:
    """The fast variant's matrices: the lm_head and every MTP linear (float `.weight` or packed)."""
    modules = set()
    for name in weight_map:
        module, _, leaf = name.rpartition(".")
        if leaf in ("weight", "weight_packed") and (module == "lm_head" or _is_mtp_linear(module)):
            modules.add(module)
    return sorted(modules)


def _is_mtp_linear(module: str) -> bool:
    # the MTP's norms (mtp.norm, q_norm, ...) also have a `.weight`; its linears are `fc` and the `*_proj`s
    leaf = module.rsplit(".", 1)[-1]
    return module.startswith("mtp.") and not module.startswith(DRAFT_HEAD) and (leaf == "fc" or leaf.endswith("_proj"))


# ---------------------------------------------------------------- prompts


def load_prompt_items(path: str | Path | None) -> list[dict]:
    """A prompt set: the templated set (prepare/calibration_prompts.json's shape) or a JSONL of prompts."""
    path = Path(path) if path else DEFAULT_PROMPTS
    if path.suffix == ".json":
        return expand_prompt_set(json.loads(path.read_text()))
    return read_prompts(path)


def tokenize(model_dir: Path, items: list[dict], max_tokens: int) -> list[list[int]]:
    """Token ids of each prompt: chat items through the checkpoint's chat template, completions as text."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    out = []
    for item in items:
        if "messages" in item:
            text = tokenizer.apply_chat_template(item["messages"], tools=item.get("tools"), tokenize=False,
                                                 add_generation_prompt=True)
        else:
            text = item["prompt"]
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][:max_tokens]
        if len(ids) >= 2:  # the MTP rows need a next token
            out.append(ids)
    if not out:
        raise CheckpointError("no prompt has two or more tokens")
    return out


def prompt_set_digest(prompts: list[list[int]], held_out_every: int) -> str:
    return hashlib.sha256(json.dumps([held_out_every, prompts]).encode()).hexdigest()[:16]


def model_digest(model_dir: Path) -> str:
    """The checkpoint's identity: its config and index, or a single-file checkpoint's safetensors header
    (names, shapes, offsets: a capture belongs to one set of weights)."""
    h = hashlib.sha256((model_dir / "config.json").read_bytes())
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        h.update(index.read_bytes())
    else:
        with open(model_dir / "model.safetensors", "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            h.update(f.read(size))
    return h.hexdigest()[:16]


# ---------------------------------------------------------------- statistics


@dataclass
class Stats:
    """Per-linear sum(x^T x) (float64) and rows over calibration prompts; raw held-out rows up to a cap."""

    modules: list[str]
    held_out_cap: int
    hessian: dict[str, torch.Tensor] = field(default_factory=dict)
    rows: dict[str, int] = field(default_factory=dict)
    held_out: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    meta: dict = field(default_factory=dict)

    def add(self, module: str, x: torch.Tensor, held_out: bool) -> None:
        x = x.reshape(-1, x.shape[-1]).detach()
        if held_out:
            kept = sum(len(r) for r in self.held_out.get(module, []))
            if kept < self.held_out_cap:
                self.held_out.setdefault(module, []).append(x[: self.held_out_cap - kept].float().cpu().clone())
            return
        x64 = x.double().cpu()
        if module not in self.hessian:
            self.hessian[module] = torch.zeros(x.shape[-1], x.shape[-1], dtype=torch.float64)
        self.hessian[module].addmm_(x64.T, x64)
        self.rows[module] = self.rows.get(module, 0) + len(x64)

    def held_out_rows(self, module: str) -> torch.Tensor:
        parts = self.held_out.get(module, [])
        return torch.cat(parts) if parts else torch.zeros(0, 0)

    # -- on disk: one safetensors file, the bookkeeping in its metadata

    def save(self, path: Path) -> None:
        from safetensors.torch import save_file

        tensors = {f"hessian/{m}": h.contiguous() for m, h in self.hessian.items()}
        tensors |= {f"held_out/{m}": self.held_out_rows(m).contiguous() for m in self.held_out}
        meta = {**self.meta, "format": FORMAT, "modules": self.modules, "rows": self.rows,
                "held_out_cap": self.held_out_cap}
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            save_file(tensors, str(tmp), metadata={"capture": json.dumps(meta)})
            os.chmod(tmp, 0o644)  # as the checkpoint's own files (the library creates it 0600)
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    @classmethod
    def load(cls, path: Path) -> Stats:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            meta = json.loads((f.metadata() or {}).get("capture", "{}"))
            if meta.get("format") != FORMAT:
                raise CheckpointError(f"{path}: not a drafter capture (format {meta.get('format')!r})")
            stats = cls(meta["modules"], meta["held_out_cap"], rows=dict(meta["rows"]))
            for name in f.keys():
                kind, module = name.split("/", 1)
                if kind == "hessian":
                    stats.hessian[module] = f.get_tensor(name)
                else:
                    stats.held_out[module] = [f.get_tensor(name)]
        stats.meta = {k: v for k, v in meta.items() if k not in ("format", "modules", "rows", "held_out_cap")}
        return stats


# ---------------------------------------------------------------- the run


def observe_prompt(ref, ids: list[int], stats: Stats, held_out: bool) -> None:
    """One prompt's forward: the target, then the MTP over rows (ids[i + 1], hidden[i])."""
    wanted = set(stats.modules)
    try:
        with torch.no_grad():
            hidden = ref.hidden(ids)  # unobserved: the target's own linears are not the drafter's
            ref.observe = lambda module, x: stats.add(module, x, held_out) if module in wanted else None
            positions = torch.arange(1, len(ids), device=hidden.device)
            mtp_out = ref.mtp_step(ids[1:], hidden[:-1], positions)
    finally:
        ref.observe = None
    if "lm_head" in wanted:
        stats.add("lm_head", hidden, held_out)
        stats.add("lm_head", mtp_out, held_out)


def _open_state(out: Path, meta: dict, modules, held_out_cap: int) -> Stats:
    """The saved state at `out` when it belongs to this capture (resumed), else a new one over modules()."""
    if not out.exists():
        found = modules()
        if not found:
            raise CheckpointError(f"{meta['model']}: no drafter linears to capture")
        return Stats(found, held_out_cap, meta=meta)
    stats = Stats.load(out)
    for key in ("model_digest", "prompt_set"):
        if stats.meta.get(key) != meta[key]:
            raise CheckpointError(f"{out} was captured from another {'checkpoint' if key == 'model_digest' else 'prompt set'}"
                                  f" ({key} {stats.meta.get(key)} != {meta[key]}): move it away or pass another --out")
    if stats.meta["done"] < meta["prompts"]:
        say(f"capture: resuming {out} after prompt {stats.meta['done']} of {meta['prompts']}")
    return stats


def _run(stats: Stats, token_lists: list[list[int]], make_observe, out: Path, held_out_every: int, save_every: int,
         source: Path) -> Stats:
    """observe(ids, stats, held_out) over the prompts not done yet, saving the state as it goes;
    make_observe() builds it (loads the models) only when a prompt is left."""
    if stats.meta["done"] >= len(token_lists):
        say(f"capture: {out} is complete ({stats.meta['done']} prompts); nothing to do")
        return stats
    observe = make_observe()
    from tqdm import tqdm

    start = time.monotonic()
    say(f"capture: {len(stats.modules)} linears over {len(token_lists)} prompts "
        f"(every {held_out_every}th held out) from {source}")
    for n in tqdm(range(stats.meta["done"], len(token_lists)), desc="capture", unit="prompt",
                  initial=stats.meta["done"], total=len(token_lists)):
        observe(token_lists[n], stats, is_held_out(n, held_out_every))
        stats.meta["done"] = n + 1
        if (n + 1) % save_every == 0 or n + 1 == len(token_lists):
            stats.save(out)
    first = stats.modules[0]
    say(f"capture: done in {time.monotonic() - start:.1f} s; calibration rows of {first}: "
        f"{stats.rows.get(first, 0)} -> {out}")
    return stats


def _prompt_tokens(model_dir: Path, prompts, max_prompts: int, max_tokens: int) -> list[list[int]]:
    if not (model_dir / "config.json").is_file():
        raise CheckpointError(f"model directory not found: {model_dir}")
    items = load_prompt_items(prompts)
    return tokenize(model_dir, items[:max_prompts] if max_prompts else items, max_tokens)


def capture(model_dir: str | Path, out: str | Path, *, prompts: str | Path | None = None, max_prompts: int = 0,
            max_tokens: int = 256, held_out_every: int = 5, held_out_cap: int = 2048, save_every: int = 1,
            device: str = "cpu") -> Stats:
    """Run (or resume) the fast variant's capture; returns the finished statistics (also at `out`)."""
    from qwen_serving.checkpoint.scripted_reference import Reference

    model_dir, out = Path(model_dir), Path(out)
    token_lists = _prompt_tokens(model_dir, prompts, max_prompts, max_tokens)
    meta = {"model": str(model_dir.resolve()), "model_digest": model_digest(model_dir),
            "prompt_set": prompt_set_digest(token_lists, held_out_every), "prompts": len(token_lists),
            "held_out_every": held_out_every, "done": 0}
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())["weight_map"]
    stats = _open_state(out, meta, lambda: fast_variant_modules(index), held_out_cap)

    def make_observe():
        ref = Reference(model_dir, device)
        return lambda ids, st, held: observe_prompt(ref, ids, st, held)

    return _run(stats, token_lists, make_observe, out, held_out_every, save_every, model_dir)


# ---------------------------------------------------------------- the DFlash2 drafter


def dflash2_anchors(length: int, every: int) -> list[int]:
    """Anchor positions of one prompt: every `every`-th token from 1 (each needs context before it)."""
    return list(range(1, length, every))


def observe_dflash2_prompt(target, drafter, ids: list[int], stats: Stats, held_out: bool, anchor_every: int) -> None:
    """One prompt through the target, then the drafter as vLLM runs it: the context K/V of every token
    (fc, then k_proj / v_proj of the normed context rows: the precompute's inputs), and one query block
    [ids[p], mask x 7] per anchor position p over the context before p (q/k/v ... down_proj)."""
    wanted = set(stats.modules)
    with torch.no_grad():
        states = target.layer_states(ids, max(drafter.target_layer_ids) + 1)  # unobserved: the target's own
        aux = torch.cat([states["layers"][t]["stream"] for t in drafter.target_layer_ids], dim=-1)
        anchors = dflash2_anchors(len(ids), anchor_every)
        try:
            drafter.observe = lambda module, x: stats.add(module, x, held_out) if module in wanted else None
            context = drafter.context_kv(drafter.context_states(aux), torch.arange(len(ids), device=aux.device))
            drafter.blocks(drafter.block_inputs(target.embed, ids, anchors),
                           torch.tensor(anchors, device=aux.device), context)
        finally:
            drafter.observe = None


def capture_dflash2(target_dir: str | Path, drafter_dir: str | Path, out: str | Path, *,
                    prompts: str | Path | None = None, max_prompts: int = 0, max_tokens: int = 256,
                    held_out_every: int = 5, held_out_cap: int = 2048, save_every: int = 1, anchor_every: int = 4,
                    device: str = "cpu") -> Stats:
    """Run (or resume) the DFlash2 drafter's capture over the target's hidden states; statistics also at `out`."""
    from qwen_serving.checkpoint.dflash2_format import is_dflash2_drafter, quantizable_modules
    from qwen_serving.checkpoint.dflash2_reference import Dflash2Forward
    from qwen_serving.checkpoint.scripted_reference import Reference

    target_dir, drafter_dir, out = Path(target_dir), Path(drafter_dir), Path(out)
    if not is_dflash2_drafter(drafter_dir):
        raise CheckpointError(f"{drafter_dir}: not a DFlash2 drafter directory (config.json with architectures "
                              f"[\"DFlash2DraftModel\"]); pass the bf16 drafter with --dflash2")
    if anchor_every < 1:
        raise ValueError("--anchor-every must be >= 1")
    token_lists = _prompt_tokens(target_dir, prompts, max_prompts, max_tokens)
    config = json.loads((drafter_dir / "config.json").read_text())
    meta = {"model": str(drafter_dir.resolve()), "model_digest": model_digest(drafter_dir),
            "target": str(target_dir.resolve()), "target_digest": model_digest(target_dir),
            "prompt_set": prompt_set_digest(token_lists, held_out_every), "prompts": len(token_lists),
            "held_out_every": held_out_every, "anchor_every": anchor_every, "done": 0}
    stats = _open_state(out, meta, lambda: quantizable_modules(config), held_out_cap)
    if stats.meta.get("target_digest") != meta["target_digest"] or stats.meta.get("anchor_every") != anchor_every:
        raise CheckpointError(f"{out} was captured over another target or --anchor-every: move it away or pass another --out")

    def make_observe():
        target, drafter = Reference(target_dir, device), Dflash2Forward(drafter_dir, device)
        return lambda ids, st, held: observe_dflash2_prompt(target, drafter, ids, st, held, anchor_every)

    return _run(stats, token_lists, make_observe, out, held_out_every, save_every, drafter_dir)
