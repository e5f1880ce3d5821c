"""Scripted checkpoints: synth's on-disk format, with a next-token distribution chosen in advance.

    python -m qwen_serving.checkpoint.synth --size tiny --out DIR --seed S --behaviour scripted \
        [--mtp-agree Q] [--draft-coverage R]
    python -m qwen_serving.checkpoint.scripted redial DIR --mtp-agree Q --out DIR2   (DIR's target, another MTP dial)

The design (docs/scripted-model.md has the maths):
- an "active" vocabulary of tokenizer tokens with exactly orthonormal directions u_t, plus one shared
  direction u_0; embed_tokens row t = sqrt(H/2) (u_t + u_0), so the final norm of a bare embedding
  is n_t = sqrt(H/2) (u_t + u_0). Every other row aliases an active token's embedding.
- lm_head row j = sqrt(2/H) (sum_t L[t, j] u_t + b_j u_0): the logit of j after t is L[t, j] + b_j.
  Each active token has a chain successor (CHAIN_LOGIT) and three alternatives (ALT_LOGITS), the
  rest of the active vocabulary sits at BACKGROUND_LOGIT and inactive rows at INACTIVE_LOGIT.
- the int4 body is synth's random body with each residual branch (GDN, attention, MLP) made
  BRANCH_SCALE times smaller, two of its matrices scaled by sqrt(BRANCH_SCALE) each: the recurrent
  state and the KV cache move the logits a little, never the argmax.
- the MTP module maps the embedding of t to n_{pi(t)}: pi(t) = t for a share q of the active tokens
  (it proposes the chain successor), else a token whose chain successor the target rules out. Its
  hidden-state half of `fc` and its layer's o_proj / down_proj are zero, so drafts depend on the
  input token only.
- the draft vocabulary (prepare/build_draft_vocab.py --ids DIR/scripted-draft-ids.json) holds the
  "core" tokens (where every alternative lives) plus a chosen share of the other active tokens.

`scripted.json` in the checkpoint records the design; qwen_serving/checkpoint/scripted_reference.py
computes the exact distributions from the written weights.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from functools import cached_property
from pathlib import Path

import torch

from qwen_serving.checkpoint import synth
from qwen_serving.checkpoint.int4 import negate_groups, pack_int4
from qwen_serving.checkpoint.synth_tokenizer import special_token_ids, tokenizer_size

CHAIN_LOGIT = 2.0
ALT_LOGITS = (0.5, -0.5, -2.0)  # logits centred near 0: bf16 rounds them by <= 0.008
BACKGROUND_LOGIT = -12.0
INACTIVE_LOGIT = -30.0
# Each residual branch is made BRANCH_SCALE times smaller than synth's by scaling two of its
# matrices by sqrt(BRANCH_SCALE) each: its output is linear in both (attention in v, the MLP in up,
# the GDN's gated norm in silu(z) ~ z / 2 for small z). One matrix scaled by 0.01 would need fp16
# group scales below fp16's smallest normal number (6.1e-5) at full size, which no real checkpoint has.
BRANCH_SCALE = 0.01
BRANCH_MODULES = ("linear_attn.in_proj_z", "linear_attn.out_proj", "self_attn.v_proj", "self_attn.o_proj",
                  "mlp.up_proj", "mlp.down_proj")
CORE_SHARE = 8  # one active token in 8 is "core": alternatives are drawn from the core
DESIGN_FILE = "scripted.json"
DRAFT_IDS_FILE = "scripted-draft-ids.json"
MTP_ZERO = ("mtp.layers.0.self_attn.o_proj.weight", "mtp.layers.0.mlp.down_proj.weight")


@dataclass(frozen=True)
class Design:
    """The scripted behaviour, in token ids. Lists are indexed like `active`."""

    hidden: int
    vocab: int
    seed: int
    mtp_agree: float
    active: list[int]
    chain: list[int]  # chain successor of active[i]
    alternatives: list[list[int]]  # the three alternative successors of active[i]
    mtp_source: list[int]  # pi(active[i]): the MTP's output looks like this token's embedding
    core: list[int]
    draft_ids: list[int] | None

    def successors(self, token: int) -> list[tuple[int, float]]:
        i = self.index[token]
        return [(self.chain[i], CHAIN_LOGIT), *zip(self.alternatives[i], ALT_LOGITS, strict=True)]

    @cached_property
    def index(self) -> dict[int, int]:
        return {t: i for i, t in enumerate(self.active)}

    def next_in_chain(self, token: int) -> int:
        return self.chain[self.index[token]]

    def mtp_proposal(self, token: int) -> int:
        """The MTP's argmax after `token` over the full vocabulary."""
        return self.next_in_chain(self.mtp_source[self.index[token]])

    def walk(self, start: int, steps: int) -> list[int]:
        """start, then `steps` chain successors."""
        out = [start]
        for _ in range(steps):
            out.append(self.next_in_chain(out[-1]))
        return out

    def to_json(self) -> dict:
        return {"format": "qwen-serving scripted design v1", **asdict(self),
                "logits": {"chain": CHAIN_LOGIT, "alternatives": list(ALT_LOGITS),
                           "background": BACKGROUND_LOGIT, "inactive": INACTIVE_LOGIT}}

    @classmethod
    def read(cls, model_dir: str | Path) -> Design:
        data = json.loads((Path(model_dir) / DESIGN_FILE).read_text())
        if data.get("format") != "qwen-serving scripted design v1":
            raise ValueError(f"{model_dir}: {DESIGN_FILE} is not a scripted design")
        return cls(**{k: data[k] for k in cls.__dataclass_fields__})


def _rng(seed: int, what: str) -> torch.Generator:
    gen = torch.Generator()
    gen.manual_seed(synth.tensor_seed(seed, f"scripted/{what}"))
    return gen


def _pick(gen: torch.Generator, pool: list[int], avoid: set[int]) -> int:
    while True:
        token = pool[int(torch.randint(len(pool), (1,), generator=gen))]
        if token not in avoid:
            return token


def make_design(size: str, seed: int, mtp_agree: float, draft_coverage: float | None) -> Design:
    """The active vocabulary, chain, alternatives, MTP map and draft ids (CPU, device-independent)."""
    d = synth.SIZES[size]
    specials = set(special_token_ids().values())
    candidates = [t for t in range(tokenizer_size()) if t not in specials]
    n = min(d.hidden - 1, len(candidates))  # one direction is kept for u_0
    gen = _rng(seed, "vocabulary")
    active = sorted(candidates[i] for i in torch.randperm(len(candidates), generator=gen)[:n].tolist())
    order = [active[i] for i in torch.randperm(n, generator=gen).tolist()]
    chain_of = {order[i]: order[(i + 1) % n] for i in range(n)}  # one cycle through every active token
    core = sorted(order[: max(8, n // CORE_SHARE)])
    alternatives = []
    for t in active:
        alts: list[int] = []
        while len(alts) < len(ALT_LOGITS):
            alts.append(_pick(gen, core, {t, chain_of[t], *alts}))
        alternatives.append(alts)
    chain = [chain_of[t] for t in active]
    draft_ids = None if draft_coverage is None else _draft_ids(seed, active, core, draft_coverage)
    return Design(hidden=d.hidden, vocab=d.vocab, seed=seed, mtp_agree=mtp_agree, active=active, chain=chain,
                  alternatives=alternatives, mtp_source=_mtp_source(seed, active, chain, alternatives, core, mtp_agree),
                  core=core, draft_ids=draft_ids)


def _mtp_source(seed: int, active: list[int], chain: list[int], alternatives: list[list[int]], core: list[int],
                mtp_agree: float) -> list[int]:
    """pi(t) for each active token: t itself for the agreeing share, else a token whose successors the target
    rules out after t. Its own random stream: the target's design does not depend on the dial."""
    if not 0.0 <= mtp_agree <= 1.0:
        raise ValueError(f"--mtp-agree must be in [0, 1], got {mtp_agree}")
    chain_of = dict(zip(active, chain, strict=True))
    succ = {t: {chain_of[t], *alts} for t, alts in zip(active, alternatives, strict=True)}
    # agreeing tokens: a share q of the core and of the rest (step starts after a rejection land on the
    # core more often), chosen by seeded permutations
    agree_gen = _rng(seed, "mtp-agree")
    core_set = set(core)
    agreeing: set[int] = set()
    for part in (core, [t for t in active if t not in core_set]):
        agreeing |= {part[i] for i in torch.randperm(len(part), generator=agree_gen)[: round(mtp_agree * len(part))]}
    position = {t: j for j, t in enumerate(active)}
    mtp_source = []
    for t in active:
        if t in agreeing:
            mtp_source.append(t)
            continue
        # a token whose chain successor and alternatives the target gives ~0 probability after t
        while True:
            s = _pick(agree_gen, active, {t})
            if not ({chain_of[s], *alternatives[position[s]]} & (succ[t] | {t})):
                break
        mtp_source.append(s)
    return mtp_source


def redial_mtp(base: Path, out: Path, mtp_agree: float) -> Path:
    """A scripted checkpoint like `base` (straight from synth) whose MTP agrees at `mtp_agree`: only the MTP's
    `fc` depends on the dial, so every file but fc's shard and the design files is a hard link to base's, and the
    result equals what synth writes at that dial. Written beside `out` (which must not exist), then renamed."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from qwen_serving.checkpoint.model_dir import MANIFEST_NAME
    from qwen_serving.checkpoint.transaction import link_or_copy

    if out.exists():
        raise FileExistsError(f"{out} exists; remove it or name another")
    base_design = Design.read(base)
    meta = json.loads((base / "synth.json").read_text())
    if meta.get("behaviour") != "scripted" or (base / MANIFEST_NAME).exists():
        raise ValueError(f"{base} is not a scripted checkpoint straight from synth (redial that one, then prepare)")
    design = replace(base_design, mtp_agree=mtp_agree,
                     mtp_source=_mtp_source(base_design.seed, base_design.active, base_design.chain,
                                            base_design.alternatives, base_design.core, mtp_agree))
    fc_shard = json.loads((base / "model.safetensors.index.json").read_text())["weight_map"]["mtp.fc.weight"]
    rewritten = {fc_shard, DESIGN_FILE, DRAFT_IDS_FILE, "synth.json"}
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        for path in sorted(base.iterdir()):
            if path.name not in rewritten:
                if not path.is_file():
                    raise ValueError(f"{base}: {path.name} is not a plain file (a synth checkpoint has none)")
                link_or_copy(path, tmp / path.name)
        with safe_open(str(base / fc_shard), framework="pt") as f:
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
        tensors["mtp.fc.weight"] = _mtp_fc(design, _basis(design).float()).to(torch.bfloat16)
        save_file(tensors, str(tmp / fc_shard), metadata={"format": "pt"})
        os.chmod(tmp / fc_shard, 0o644)
        write_design_files(tmp, design)
        synth._write_json(tmp / "synth.json", {**meta, "mtp_agree": mtp_agree})
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _draft_ids(seed: int, active: list[int], core: list[int], coverage: float) -> list[int]:
    """Core tokens, a share of the other active tokens (total = coverage of the active set), stop ids."""
    floor = len(core) / len(active)
    if not floor <= coverage <= 1.0:
        raise ValueError(f"--draft-coverage must be in [{floor:.3f}, 1] (the core tokens are always in)")
    core_set = set(core)
    rest = [t for t in active if t not in core_set]
    extra = round(coverage * len(active)) - len(core)
    chosen = [rest[i] for i in torch.randperm(len(rest), generator=_rng(seed, "draft-vocab"))[:extra].tolist()]
    ids = special_token_ids()
    return sorted({*core, *chosen, ids["<|im_end|>"], ids["<|endoftext|>"]})


def draft_coverage(design: Design, ids: list[int]) -> float:
    """Share of the active vocabulary inside a draft id list."""
    inside = set(ids)
    return sum(t in inside for t in design.active) / len(design.active)


# ---------------------------------------------------------------- weights


def _basis(design: Design) -> torch.Tensor:
    """[n + 1, H] exactly orthonormal rows (float64, CPU): u_0 first, then u_t for each active token."""
    gen = _rng(design.seed, "basis")
    gauss = torch.randn(design.hidden, len(design.active) + 1, generator=gen, dtype=torch.float64)
    q, _ = torch.linalg.qr(gauss)
    return q.T.contiguous()


def _designed_tensors(design: Design) -> dict[str, torch.Tensor]:
    """embed_tokens, lm_head, final norm and the MTP's fc / norms (bf16, CPU)."""
    h, vocab, n = design.hidden, design.vocab, len(design.active)
    basis = _basis(design).float()
    u0, u = basis[0], basis[1:]
    index = design.index

    # every vocabulary row aliases an active token's embedding (active rows alias themselves);
    # built in bf16 chunks: at full size a float32 [248320, 5120] table is 5 GB
    alias = torch.randint(n, (vocab,), generator=_rng(design.seed, "alias"))
    rows = torch.tensor(design.active)
    alias[rows] = torch.arange(n)
    embed = torch.empty(vocab, h, dtype=torch.bfloat16)
    for start in range(0, vocab, 16384):
        chunk = alias[start : start + 16384]
        embed[start : start + len(chunk)] = (math.sqrt(h / 2) * (u[chunk] + u0)).to(torch.bfloat16)

    # inactive rows are all INACTIVE_LOGIT * u_0 * sqrt(2/H); active rows get their predecessors' terms
    lm_head = (INACTIVE_LOGIT * u0 * math.sqrt(2 / h)).to(torch.bfloat16).expand(vocab, h).clone()
    active_rows = BACKGROUND_LOGIT * u0.expand(n, h).clone()
    for i, t in enumerate(design.active):
        for succ, logit in design.successors(t):
            active_rows[index[succ]] += (logit - BACKGROUND_LOGIT) * u[i]
    lm_head[rows] = (active_rows * math.sqrt(2 / h)).to(torch.bfloat16)

    out = {
        f"{synth.LM}embed_tokens.weight": embed,
        "lm_head.weight": lm_head,
        "mtp.fc.weight": _mtp_fc(design, basis).to(torch.bfloat16),
    }
    # (1 + w) norms with w = 0: plain RMS normalisation, so the designed directions stay exact
    for norm in (f"{synth.LM}norm", "mtp.pre_fc_norm_embedding", "mtp.pre_fc_norm_hidden", "mtp.norm"):
        out[f"{norm}.weight"] = torch.zeros(h, dtype=torch.bfloat16)
    return out


def _mtp_fc(design: Design, basis: torch.Tensor) -> torch.Tensor:
    """The MTP's fc, float32: [F_e, 0] with F_e (u_t + u_0) = u_pi(t) + u_0 (the hidden-state half is zero)."""
    u0, u = basis[0], basis[1:]
    source = torch.tensor([design.index[s] for s in design.mtp_source])
    f_e = u[source].T @ u + torch.outer(u0, u0)
    return torch.cat([f_e, torch.zeros(design.hidden, design.hidden)], dim=1)


def _is_branch(module: str) -> bool:
    return module.startswith(f"{synth.LM}layers.") and module.endswith(BRANCH_MODULES)


def branch_values(seed: int, linear: synth.Int4Linear, scale: float, device: torch.device) -> dict:
    codes, scales, flip = synth.intended_int4(seed, linear, device)
    scales = (scales.float() * scale).to(torch.float16)
    codes, scales = negate_groups(codes, scales, flip)
    return {
        f"{linear.module}.weight_packed": pack_int4(codes),
        f"{linear.module}.weight_scale": scales,
        f"{linear.module}.weight_shape": torch.tensor([linear.out_features, linear.in_features], dtype=torch.int64),
    }


Values = Callable[[synth.Entry, torch.device], dict]


def values_for(design: Design, seed: int, random_values: Values) -> Values:
    """synth.write_checkpoint's per-entry values: designed tensors, scaled branches, else `random_values`."""
    designed = _designed_tensors(design)
    branch_scale = math.sqrt(BRANCH_SCALE)

    # entries are told apart by field, not class, and the random ones come from the caller:
    # `python -m ...synth` runs synth as __main__, whose Int4Linear is not this module's synth.Int4Linear
    def values(entry: synth.Entry, device: torch.device) -> dict[str, torch.Tensor]:
        module = getattr(entry, "module", None)
        if module is not None:
            if _is_branch(module):
                return branch_values(seed, entry, branch_scale, device)
            return random_values(entry, device)
        if entry.name in designed:
            return {entry.name: designed[entry.name]}
        if entry.name in MTP_ZERO:
            return {entry.name: torch.zeros(entry.shape, dtype=entry.dtype)}
        return random_values(entry, device)

    return values


def write_design_files(out_dir: Path, design: Design) -> None:
    (out_dir / DESIGN_FILE).write_text(json.dumps(design.to_json()) + "\n")
    if design.draft_ids is not None:
        coverage = round(draft_coverage(design, design.draft_ids), 6)
        (out_dir / DRAFT_IDS_FILE).write_text(json.dumps({"ids": design.draft_ids, "source": "scripted",
                                                          "active_coverage": coverage}) + "\n")


# ---------------------------------------------------------------- prompts


def quoting_prompt(design: Design, seed: int, segments: int = 6, segment_len: int = 40,
                   cue_len: int = 8) -> dict:
    """Chain segments from spaced points of the cycle, then the first `cue_len` tokens of one of them:
    the greedy continuation reproduces the rest of that segment, which sits earlier in the prompt."""
    cycle = design.walk(design.active[0], len(design.active) - 1)
    if segments * segment_len > len(cycle):
        raise ValueError(f"{segments} segments of {segment_len} tokens do not fit a {len(cycle)}-token cycle")
    if not 0 < cue_len < segment_len:
        raise ValueError("cue_len must be between 1 and segment_len - 1")
    gen = _rng(seed, "quoting-prompt")
    spacing = len(cycle) // segments
    offset = int(torch.randint(len(cycle), (1,), generator=gen))
    starts = [(offset + i * spacing) % len(cycle) for i in torch.randperm(segments, generator=gen).tolist()]
    pieces = [[cycle[(s + j) % len(cycle)] for j in range(segment_len)] for s in starts]
    quoted = int(torch.randint(segments, (1,), generator=gen))
    ids = [t for piece in pieces for t in piece] + pieces[quoted][:cue_len]
    start = quoted * segment_len + cue_len
    return {"ids": ids, "continuation": pieces[quoted][cue_len:], "quoted_span": [start, start + segment_len - cue_len]}


def free_prompt(design: Design, seed: int, length: int = 200, horizon: int = 64) -> dict:
    """A prompt whose greedy continuation (`horizon` tokens) contains no token of the prompt."""
    n = len(design.active)
    if length + horizon + 1 > n:
        raise ValueError(f"length + horizon must stay below the {n} active tokens")
    cycle = design.walk(design.active[0], n - 1)
    gen = _rng(seed, "free-prompt")
    offset = int(torch.randint(n, (1,), generator=gen))
    # the prompt is a chain walk ending at the last token; the continuation follows it on the cycle, and
    # the walk is laid out so that it comes from the part of the cycle after the continuation
    body = [cycle[(offset + horizon + 1 + j) % n] for j in range(length - 1)]
    last = cycle[offset % n]
    continuation = [cycle[(offset + 1 + j) % n] for j in range(horizon)]
    return {"ids": [*body, last], "continuation": continuation}


def depth_prompt(design: Design, seed: int, depth: int, segment_len: int, cue_len: int = 8, after: int = 256) -> dict:
    """A long prompt holding one quoted chain segment that starts at position `depth`: filler, the quote (a cue of
    `cue_len` chain tokens ending at depth - 1, then the segment), `after` more filler tokens, then the cue again.
    Greedy decoding continues the cue along the chain, so it reproduces the segment. The filler is seeded active
    tokens off the quote's arc of the cycle (and off the token before it): the segment's tokens sit in the prompt
    only at the quote, and no filler token's chain successor lies in the quote."""
    n = len(design.active)
    if not 0 < cue_len <= depth or segment_len < 1 or after < 0:
        raise ValueError(f"depth {depth}, segment {segment_len}, cue {cue_len}, after {after}: need "
                         "0 < cue <= depth, a segment of >= 1 token and after >= 0")
    if cue_len + segment_len + 2 > n:
        raise ValueError(f"a {cue_len}-token cue and a {segment_len}-token segment do not fit the {n}-token cycle")
    cycle = design.walk(design.active[0], n - 1)
    gen = _rng(seed, "depth-prompt")
    start = int(torch.randint(n, (1,), generator=gen))
    arc = [cycle[(start + j) % n] for j in range(cue_len + segment_len + 1)]  # the cue's predecessor, cue, segment
    cue, segment = arc[1:cue_len + 1], arc[cue_len + 1:]
    off_arc = set(arc)
    pool = torch.tensor([t for t in design.active if t not in off_arc])
    before = depth - cue_len
    filler = pool[torch.randint(len(pool), (before + after,), generator=gen)].tolist()
    ids = [*filler[:before], *cue, *segment, *filler[before:], *cue]
    return {"ids": ids, "continuation": segment, "quoted_span": [depth, depth + segment_len]}


def prompt_text(model_dir: str | Path, ids: list[int]) -> str:
    """The prompt as text through the synthetic tokenizer (re-encoding need not give the same ids)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json")).decode(ids, skip_special_tokens=False)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m qwen_serving.checkpoint.scripted",
                                     description="Scripted checkpoints beyond synth's.")
    sub = parser.add_subparsers(dest="command", required=True)
    redial = sub.add_parser("redial", help="a copy of a scripted checkpoint with another --mtp-agree (hard links "
                                           "for everything the dial leaves alone)")
    redial.add_argument("base", type=Path, help="a scripted checkpoint written by synth")
    redial.add_argument("--mtp-agree", type=float, required=True)
    redial.add_argument("--out", type=Path, required=True, help="the directory to create (must not exist)")
    args = parser.parse_args(argv)
    try:
        out = redial_mtp(args.base.resolve(), args.out.resolve(), args.mtp_agree)
    except (OSError, ValueError, KeyError) as err:
        parser.exit(2, f"scripted redial: {err}\n")
    print(f"scripted redial: wrote {out} (--mtp-agree {args.mtp_agree}, the target of {args.base})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
