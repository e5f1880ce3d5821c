"""A scripted DFlash2 drafter: vLLM 0.28.0's `qwen3_dflash2` format, proposals chosen in advance.

    python -m qwen_serving.checkpoint.scripted_dflash2 TARGET_DIR --out DRAFTER_DIR --agree Q --seed S

TARGET_DIR is a scripted checkpoint (`synth --behaviour scripted`). The drafter proposes, after an
anchor token a (the token the target last emitted), the walk f(a), f(f(a)), ... where f(t) is the
target's chain successor sigma(t) for a share Q of the active tokens (the "agreeing" ones) and a
token the target gives ~0 probability after t otherwise. docs/scripted-dflash2.md has the
construction and its maths; in short:
- every residual branch of the 5 layers (o_proj, down_proj) is zero, so each mask slot's final
  hidden is the normed embedding of `mask_token_id`, whatever the context;
- `selector_top_k` is the size of the active vocabulary: the lm_head's top-K of that hidden is
  exactly the active vocabulary (every other row sits 18 logits lower);
- the selector's edge score a -> c is EDGE_GAIN * code(a) . sum_{t: f(t) = c} code(t) / R with
  random +-1 codes of rank R: EDGE_GAIN on the designed edge, a few tens below it elsewhere, far
  above the unary logits' 14-logit spread. The walk is f, greedy or Gumbel-sampled alike.

`DraftReference` computes the proposals from the written tensors (drafter + target) and
`predicted_acceptance` the per-position acceptance vLLM's metric averages over a generation.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from qwen_serving import model
from qwen_serving.checkpoint import synth
from qwen_serving.checkpoint.scripted import Design
from qwen_serving.checkpoint.scripted_reference import (
    LM,
    Reference,
    Sampling,
    markov_acceptance,
    sampling_probs,
)

DESIGN_FILE = "scripted-dflash2.json"
DESIGN_FORMAT = "qwen-serving scripted dflash2 v1"
LAYERS = 5
BLOCK = 8  # the anchor plus 7 mask slots: num_speculative_tokens 7
DRAFTS = BLOCK - 1
REAL_TARGET_LAYERS = (5, 19, 33, 47, 61)  # the shipped drafter's taps on the 64-layer target
EDGE_GAIN = 128.0  # the designed edge's score; the unary logits span 14 (chain 2 .. background -12)
CONV_KERNEL = 4
CONV_GROUP = 64
WINDOW = model.DRAFTER_WINDOW
INIT_STD = 0.02  # the random (inert) projections: q/k/v, gate/up, fc, conv kernels


@dataclass(frozen=True)
class DrafterDims:
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    rank: int  # selector_rank


DIMS = {
    "tiny": DrafterDims(heads=4, kv_heads=2, head_dim=64, intermediate=512, rank=256),
    # the shipped drafter's KV geometry (model.py): 8 KV heads x 128, sliding window 2048
    "real": DrafterDims(heads=32, kv_heads=model.DRAFTER_KV_HEADS, head_dim=model.DRAFTER_HEAD_DIM,
                        intermediate=model.INTERMEDIATE, rank=512),
}


@dataclass(frozen=True)
class DrafterDesign:
    """What the drafter was built to do; lists are indexed like the target design's `active`."""

    agree: float
    seed: int
    target_seed: int
    mask_token_id: int
    target_layer_ids: list[int]
    follow: list[int]  # f(active[i])
    agreeing: list[int]  # the tokens t with f(t) = sigma(t)

    def to_json(self) -> dict:
        return {"format": DESIGN_FORMAT, **asdict(self), "edge_gain": EDGE_GAIN, "block_size": BLOCK}

    @classmethod
    def read(cls, drafter_dir: str | Path) -> DrafterDesign:
        path = Path(drafter_dir) / DESIGN_FILE
        if not path.is_file():
            raise ValueError(f"{drafter_dir}: no {DESIGN_FILE}, not a scripted DFlash2 drafter")
        data = json.loads(path.read_text())
        if data.get("format") != DESIGN_FORMAT:
            raise ValueError(f"{path}: not a scripted DFlash2 design")
        return cls(**{k: data[k] for k in cls.__dataclass_fields__})


def read_target_design(target_dir: Path) -> Design:
    """The scripted target's design, or a clear error for anything else."""
    if not (target_dir / "config.json").is_file():
        raise ValueError(f"{target_dir}: no config.json, not a checkpoint directory")
    try:
        return Design.read(target_dir)
    except FileNotFoundError:
        raise ValueError(f"{target_dir}: no scripted.json; make the target with `synth --behaviour scripted`") from None
    except (ValueError, KeyError, TypeError, json.JSONDecodeError) as e:
        raise ValueError(f"{target_dir}: scripted.json unreadable ({e})") from None


def map_target_layers(num_layers: int) -> list[int]:
    """REAL_TARGET_LAYERS spread over a target of `num_layers` layers (identity at 64). DFlash's id t
    reads the residual stream after layer t, so ids are 0..num_layers-1 and must be distinct."""
    if num_layers < len(REAL_TARGET_LAYERS):
        raise ValueError(f"the target has {num_layers} layers; DFlash2 taps {len(REAL_TARGET_LAYERS)} distinct ones "
                         f"(generate it with --layers 8 or more)")
    ids: list[int] = []
    for real in REAL_TARGET_LAYERS:
        mapped = min(max(round((real + 1) * num_layers / model.LAYERS) - 1, 0), num_layers - 1)
        ids.append(max(mapped, ids[-1] + 1) if ids else mapped)
    if ids[-1] >= num_layers:  # pushed past the end by the distinctness rule: pack from the top
        ids = [min(t, num_layers - len(ids) + i) for i, t in enumerate(ids)]
    return ids


def _rng(seed: int, what: str) -> torch.Generator:
    gen = torch.Generator()
    gen.manual_seed(synth.tensor_seed(seed, f"scripted-dflash2/{what}"))
    return gen


def _mask_token(target: Design) -> int:
    """A token outside the active vocabulary (its embedding aliases an active one: any id works)."""
    active = set(target.active)
    return next(t for t in range(target.vocab - 1, -1, -1) if t not in active)


def make_design(target: Design, num_layers: int, agree: float, seed: int) -> DrafterDesign:
    if not 0.0 <= agree <= 1.0:
        raise ValueError(f"--agree must be in [0, 1], got {agree}")
    n = len(target.active)
    gen = _rng(seed, "agree")
    core = set(target.core)
    agreeing: set[int] = set()
    # a share q of the core and of the rest, like the MTP's dial: steps after a rejection start on the core
    for part in (target.core, [t for t in target.active if t not in core]):
        agreeing |= {part[i] for i in torch.randperm(len(part), generator=gen)[: round(agree * len(part))].tolist()}
    follow: dict[int, int] = {t: target.next_in_chain(t) for t in agreeing}
    used = set(follow.values())
    for i in torch.randperm(n, generator=gen).tolist():
        t = target.active[i]
        if t in agreeing:
            continue
        banned = {t, *(s for s, _ in target.successors(t))}
        fresh = [c for c in target.active if c not in banned and c not in used]
        pool = fresh or [c for c in target.active if c not in banned]  # distinct images while they last
        choice = pool[int(torch.randint(len(pool), (1,), generator=gen))]
        follow[t] = choice
        used.add(choice)
    return DrafterDesign(agree=agree, seed=seed, target_seed=target.seed, mask_token_id=_mask_token(target),
                         target_layer_ids=map_target_layers(num_layers), follow=[follow[t] for t in target.active],
                         agreeing=sorted(agreeing))


# ---------------------------------------------------------------- tensors and config


def _dims(target: Design) -> DrafterDims:
    return DIMS["tiny" if target.hidden == synth.TINY.hidden else "real"]


def drafter_config(target: Design, target_config: dict, design: DrafterDesign) -> dict:
    d, text = _dims(target), target_config["text_config"]
    return {
        "architectures": ["DFlash2DraftModel"],
        "model_type": "qwen3",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "head_dim": d.head_dim,
        "hidden_act": "silu",
        "hidden_size": target.hidden,
        "intermediate_size": d.intermediate,
        "layer_types": ["sliding_attention"] * LAYERS,
        "max_position_embeddings": text["max_position_embeddings"],
        "num_attention_heads": d.heads,
        "num_hidden_layers": LAYERS,
        "num_key_value_heads": d.kv_heads,
        "rms_norm_eps": 1e-06,
        "rope_parameters": {"rope_theta": 1000000, "rope_type": "default"},
        "sliding_window": WINDOW,
        "use_sliding_window": True,  # else transformers' Qwen3Config drops sliding_window
        "max_window_layers": 0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "vocab_size": target.vocab,
        "dflash_config": {
            "block_size": BLOCK,
            "mask_token_id": design.mask_token_id,
            "target_layer_ids": design.target_layer_ids,
            "conv_kernel_size": CONV_KERNEL,
            "conv_group_size": CONV_GROUP,
            "selector_rank": d.rank,
            "selector_top_k": len(target.active),
        },
    }


def _codes(target: Design, rank: int, seed: int) -> torch.Tensor:
    """[n, rank] random +-1 codes (exact in bf16), one per active token."""
    bits = torch.randint(2, (len(target.active), rank), generator=_rng(seed, "codes"))
    return bits.float() * 2 - 1


def designed_tensors(target: Design, target_dir: Path, design: DrafterDesign) -> dict[str, torch.Tensor]:
    """Every tensor of the drafter (bf16, CPU), named as the checkpoint stores them."""
    d, h, vocab = _dims(target), target.hidden, target.vocab
    gen = _rng(design.seed, "body")

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * INIT_STD).to(torch.bfloat16)

    def ones(size: int) -> torch.Tensor:
        return torch.ones(size, dtype=torch.bfloat16)

    groups = h // CONV_GROUP
    out = {"fc.weight": rand(h, len(design.target_layer_ids) * h), "hidden_norm.weight": ones(h), "norm.weight": ones(h)}
    for i in range(LAYERS):
        p = f"layers.{i}."
        out |= {
            p + "input_layernorm.weight": ones(h),
            p + "post_attention_layernorm.weight": ones(h),
            p + "self_attn.q_proj.weight": rand(d.heads * d.head_dim, h),
            p + "self_attn.k_proj.weight": rand(d.kv_heads * d.head_dim, h),
            p + "self_attn.v_proj.weight": rand(d.kv_heads * d.head_dim, h),
            # zero residual branches: the mask slots' hidden is their embedding, whatever the context
            p + "self_attn.o_proj.weight": torch.zeros(h, d.heads * d.head_dim, dtype=torch.bfloat16),
            p + "self_attn.q_norm.weight": ones(d.head_dim),
            p + "self_attn.k_norm.weight": ones(d.head_dim),
            p + "mlp.gate_proj.weight": rand(d.intermediate, h),
            p + "mlp.up_proj.weight": rand(d.intermediate, h),
            p + "mlp.down_proj.weight": torch.zeros(h, d.intermediate, dtype=torch.bfloat16),
        }
        for conv in ("attention_conv", "mlp_conv"):
            out[p + f"{conv}.base_kernel"] = (1.0 / CONV_KERNEL + torch.randn(2, CONV_KERNEL, h, generator=gen)
                                              * INIT_STD).to(torch.bfloat16)
            out[p + f"{conv}.kernel_projection.weight"] = rand(2 * CONV_KERNEL * groups, h)

    codes = _codes(target, d.rank, design.seed)
    rows = torch.tensor(target.active)
    predecessor = torch.zeros(vocab, d.rank)
    predecessor[rows] = codes
    successor = torch.zeros(vocab, d.rank)
    for i, image in enumerate(design.follow):
        successor[image] += codes[i]  # several tokens may share an image: their codes add up
    mask_hidden = _mask_hidden(target_dir, design.mask_token_id)
    # hidden_projection(h_mask) = (EDGE_GAIN / R) * ones: the edge a -> c is EDGE_GAIN * code_a . S_c / R
    projection = (EDGE_GAIN / d.rank) * mask_hidden / mask_hidden.dot(mask_hidden)
    out |= {
        "candidate_selector.predecessor_codebook": predecessor.to(torch.bfloat16),
        "candidate_selector.successor_codebook": successor.to(torch.bfloat16),
        "candidate_selector.hidden_projection.weight": projection.expand(d.rank, h).to(torch.bfloat16).contiguous(),
    }
    return out


def _rms(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def embedding_row(target: Reference, token: int) -> torch.Tensor:
    """One row of the target's embedding as float32 (a bf16 slice; else the dequantized table)."""
    name = f"{LM}embed_tokens.weight"
    if target.w.has(name):
        return target.w._files[target.w._where[name]].get_slice(name)[token : token + 1][0].float().to(target.w.device)
    return target.embed([token])[0].float()


def _mask_hidden(target_dir: Path, mask_token_id: int) -> torch.Tensor:
    """The mask slots' final hidden: the normed target embedding of the mask token (norm weights 1)."""
    return _rms(embedding_row(Reference(target_dir), mask_token_id))


def live_body(tensors: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """The same drafter with acting layers: random o_proj / down_proj (std INIT_STD) and norm weights
    1 + N(0, 0.1), so every layer changes the residual stream and every norm weight matters. Its
    proposals are no longer the design's; drafter/ (GPTQ of the drafter) tests and measures on it."""
    gen = _rng(seed, "live-body")
    out = dict(tensors)
    for name, tensor in tensors.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            out[name] = (torch.randn(*tensor.shape, generator=gen) * INIT_STD).to(torch.bfloat16)
        elif name.endswith("norm.weight"):
            out[name] = (1 + 0.1 * torch.randn(*tensor.shape, generator=gen)).to(torch.bfloat16)
    return out


def write_drafter(target_dir: Path, out: Path, agree: float, seed: int, live: bool = False) -> DrafterDesign:
    """Write the drafter beside `out` and rename it into place: no half-written directory. `live`: with
    `live_body` (no design file then: the proposals are not the design's)."""
    from safetensors.torch import save_file

    target_dir, out = Path(target_dir).resolve(), Path(out).resolve()
    target = read_target_design(target_dir)
    target_config = json.loads((target_dir / "config.json").read_text())
    design = make_design(target, target_config["text_config"]["num_hidden_layers"], agree, seed)
    staged = out.parent / f".{out.name}.new-{os.getpid()}"
    out.parent.mkdir(parents=True, exist_ok=True)
    staged.mkdir()
    try:
        tensors = designed_tensors(target, target_dir, design)
        save_file(live_body(tensors, seed) if live else tensors, str(staged / "model.safetensors"),
                  metadata={"format": "pt"})
        (staged / "config.json").write_text(json.dumps(drafter_config(target, target_config, design), indent=2) + "\n")
        if not live:
            (staged / DESIGN_FILE).write_text(json.dumps(design.to_json()) + "\n")
        if out.exists():
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            out.rename(old)
            staged.rename(out)
            shutil.rmtree(old)
        else:
            staged.rename(out)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    return design


# ---------------------------------------------------------------- reference


class DraftReference:
    """The drafter's proposals from its written tensors and the target's (embedding, lm_head).

    Relies on the body being inert (every o_proj / down_proj zero, checked): then each mask slot's
    final hidden is norm(embed(mask_token_id)) and the block depends on the anchor alone. The rest is
    vLLM's computation: top-K of the lm_head over it (unary logits), edge scores
    unary[c] + predecessor[prev] . (hidden_projection(h) * successor[c]), the best path from the anchor.
    """

    def __init__(self, drafter_dir: str | Path, target_dir: str | Path, device: str = "cpu"):
        from safetensors.torch import load_file

        self.path = Path(drafter_dir)
        self.config = json.loads((self.path / "config.json").read_text())
        self.tensors = load_file(str(self.path / "model.safetensors"), device=device)
        for name, tensor in self.tensors.items():
            if name.endswith(("o_proj.weight", "down_proj.weight")) and bool(tensor.any()):
                raise ValueError(f"{drafter_dir}: {name} is not zero; the reference needs an inert body")
        self.target = Reference(target_dir, device)
        dflash = self.config["dflash_config"]
        self.top_k = int(dflash["selector_top_k"])
        self.scale = float(dflash.get("output_multiplier", 1.0))
        hidden = _rms(embedding_row(self.target, int(dflash["mask_token_id"])), self.config["rms_norm_eps"])
        self.hidden = hidden * self.tensors["norm.weight"].float()
        logits = self.target.w.linear("lm_head") @ self.hidden
        unary, self.candidates = logits.topk(self.top_k)
        self.unary = unary * self.scale
        weights = self.tensors["candidate_selector.hidden_projection.weight"].float()
        self.edge_weight = weights @ self.hidden
        self.predecessor = self.tensors["candidate_selector.predecessor_codebook"].float()
        self.successor = self.tensors["candidate_selector.successor_codebook"].float()[self.candidates]

    def scores(self, previous: torch.Tensor) -> torch.Tensor:
        """[len(previous), K]: the score of each candidate after each previous token."""
        return self.unary + (self.predecessor[previous] * self.edge_weight) @ self.successor.T

    def block(self, anchor: int, drafts: int = DRAFTS) -> list[int]:
        """The greedy walk after `anchor` (at any temperature the walk's margin makes it the same)."""
        out, prev = [], anchor
        for _ in range(drafts):
            prev = int(self.candidates[self.scores(torch.tensor([prev])).argmax()])
            out.append(prev)
        return out

    def follow_map(self, tokens: list[int]) -> tuple[list[int], float]:
        """(the walk's next token after each of `tokens`, the smallest score margin over them)."""
        s = self.scores(torch.tensor(tokens))
        top = s.topk(2, dim=-1)
        return self.candidates[top.indices[:, 0]].tolist(), float((top.values[:, 0] - top.values[:, 1]).min())


def predicted_acceptance(drafter: DraftReference, active: list[int], sampling: Sampling,
                         drafts: int = DRAFTS, steps: int = 4000) -> list[float]:
    """Per-position acceptance averaged over the step starts of a long generation, from the tensors:
    the context-free target rows and the drafter's follow map (its drafts are a point mass: q(d) = 1
    up to exp(-margin / T), so vLLM's min(1, p/q) is p(d), as for a greedy draft). `steps`: the
    generation length the average runs over, from a uniform start (markov_acceptance)."""
    index = {t: i for i, t in enumerate(active)}
    ref = drafter.target
    columns = torch.tensor(active, device=ref.w.device)
    transition = sampling_probs(ref.context_free_logits(active)[:, columns], sampling)
    follow, _ = drafter.follow_map(active)
    propose = torch.tensor([index.get(t, -1) for t in follow], device=transition.device)
    return markov_acceptance(transition, propose, drafts, steps)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m qwen_serving.checkpoint.scripted_dflash2",
        description="Write a scripted DFlash2 drafter (vLLM qwen3_dflash2 format) for a scripted target.")
    parser.add_argument("target_dir", type=Path, help="a checkpoint from `synth --behaviour scripted`")
    parser.add_argument("--out", type=Path, required=True, help="drafter directory to create")
    parser.add_argument("--agree", type=float, required=True, help="share of active tokens the walk follows the chain after")
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--force", action="store_true", help="replace --out if it exists")
    parser.add_argument("--live-body", action="store_true",
                        help="random o_proj/down_proj and norm weights: layers that act (for drafter/ GPTQ); "
                             "the proposals are then not the design's, and --predict is refused")
    parser.add_argument("--predict", action="store_true",
                        help="also print the predicted acceptance per position (greedy and generation_config sampling)")
    args = parser.parse_args(argv)
    if args.out.exists() and not args.force:
        parser.error(f"{args.out} exists; pass --force to replace it")
    if args.seed < 0:
        parser.error("--seed must be >= 0")
    if args.live_body and args.predict:
        parser.error("--predict needs the designed (inert) body; leave out --live-body")
    try:
        design = write_drafter(args.target_dir, args.out, args.agree, args.seed, args.live_body)
    except ValueError as e:
        parser.error(str(e))
    report = {"drafter": str(args.out), "agree": design.agree, "target_layer_ids": design.target_layer_ids}
    if args.predict:
        report |= prediction_report(args.out, args.target_dir)
    print(json.dumps(report))
    return 0


def prediction_report(drafter_dir: Path, target_dir: Path, device: str = "cpu") -> dict:
    from qwen_serving.checkpoint.scripted_reference import DEFAULT_SAMPLING, GREEDY

    target = read_target_design(Path(target_dir))
    drafter = DraftReference(drafter_dir, target_dir, device)
    _, margin = drafter.follow_map(target.active)
    out = {"selector_margin": margin}
    for name, sampling in (("greedy", GREEDY), ("default_sampling", DEFAULT_SAMPLING)):
        acceptance = predicted_acceptance(drafter, target.active, sampling)
        out[name] = {"acceptance_per_position": acceptance, "tokens_per_step": 1 + sum(acceptance)}
    return out


if __name__ == "__main__":
    raise SystemExit(main())

