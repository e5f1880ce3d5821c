"""Capture the drafter's own linear inputs over a prompt set: per-linear Hessian statistics for GPTQ.

The target checkpoint runs forward in float32 on the CPU (or any torch device) through
`scripted_reference.Reference`, the repo's forward of a qwen3_5 checkpoint from its tensors (int4 /
int8 linears dequantized as vLLM holds them). Its `observe` hook sees the input of every MTP
linear; the lm_head's inputs are the rows the lm_head reads when serving: the target's final
hidden states and the MTP module's output (its first draft, rows (ids[i + 1], hidden[i]), as vLLM
feeds it). For each linear the capture keeps sum(x^T x) in float64 and the row count (all GPTQ
needs), except on held-out prompts (every `held_out_every`-th), whose rows are kept raw, up to a
cap, for the error table and never enter the Hessian.

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
    """The checkpoint's identity: its index and config (a capture belongs to one set of weights)."""
    h = hashlib.sha256()
    for name in ("model.safetensors.index.json", "config.json"):
        h.update((model_dir / name).read_bytes())
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


def capture(model_dir: str | Path, out: str | Path, *, prompts: str | Path | None = None, max_prompts: int = 0,
            max_tokens: int = 256, held_out_every: int = 5, held_out_cap: int = 2048, save_every: int = 1,
            device: str = "cpu") -> Stats:
    """Run (or resume) a capture; returns the finished statistics (also at `out`)."""
    from qwen_serving.checkpoint.scripted_reference import Reference

    model_dir, out = Path(model_dir), Path(out)
    if not (model_dir / "config.json").is_file():
        raise CheckpointError(f"model directory not found: {model_dir}")
    items = load_prompt_items(prompts)
    if max_prompts:
        items = items[:max_prompts]
    token_lists = tokenize(model_dir, items, max_tokens)
    meta = {"model": str(model_dir.resolve()), "model_digest": model_digest(model_dir),
            "prompt_set": prompt_set_digest(token_lists, held_out_every), "prompts": len(token_lists),
            "held_out_every": held_out_every, "done": 0}
    if out.exists():
        stats = Stats.load(out)
        for key in ("model_digest", "prompt_set"):
            if stats.meta.get(key) != meta[key]:
                raise CheckpointError(f"{out} was captured from another {'checkpoint' if key == 'model_digest' else 'prompt set'}"
                                      f" ({key} {stats.meta.get(key)} != {meta[key]}): move it away or pass another --out")
        if stats.meta["done"] >= len(token_lists):
            say(f"capture: {out} is complete ({stats.meta['done']} prompts); nothing to do")
            return stats
        say(f"capture: resuming {out} after prompt {stats.meta['done']} of {len(token_lists)}")
    else:
        index = json.loads((model_dir / "model.safetensors.index.json").read_text())["weight_map"]
        modules = fast_variant_modules(index)
        if not modules:
            raise CheckpointError(f"{model_dir}: no lm_head or MTP linears to capture")
        stats = Stats(modules, held_out_cap, meta=meta)
    ref = Reference(model_dir, device)
    from tqdm import tqdm

    start = time.monotonic()
    say(f"capture: {len(stats.modules)} linears over {len(token_lists)} prompts "
        f"(every {held_out_every}th held out) from {model_dir}")
    for n in tqdm(range(stats.meta["done"], len(token_lists)), desc="capture", unit="prompt",
                  initial=stats.meta["done"], total=len(token_lists)):
        observe_prompt(ref, token_lists[n], stats, is_held_out(n, held_out_every))
        stats.meta["done"] = n + 1
        if (n + 1) % save_every == 0 or n + 1 == len(token_lists):
            stats.save(out)
    rows = ", ".join(f"{m} {stats.rows.get(m, 0)}" for m in ("lm_head", "mtp.fc") if m in stats.modules)
    say(f"capture: done in {time.monotonic() - start:.1f} s; calibration rows: {rows} -> {out}")
    return stats
