"""The CPU (or any torch device) reference for scripted checkpoints: distributions from the weights alone.

`Reference(model_dir)` reads the written safetensors back (int4 and int8 linears dequantized as vLLM
holds them: the fp16 int4 group scales become bf16 parameters when vLLM loads them, so they are
rounded to bf16 here too) and runs Qwen3.5's forward in float32: Gated DeltaNet layers as an exact
token-by-token recurrence, gated full attention, the MTP module, the lm_head. Nothing here reads the
design file: the distributions follow from the tensors.

On top of it, vLLM's sampling and rejection rules (vllm/v1/sample/rejection_sampler.py,
ops/topk_topp_sampler.py): temperature, then top-k (ties at the k-th logit kept), then top-p (drop
the ascending-sorted tokens whose cumulative probability is <= 1 - p); a greedy draft is accepted
with probability p_target(draft), the chain stops at the first rejection, a rejected position is
resampled from p without the draft, a fully accepted chain gets a bonus token from p.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from qwen_serving.checkpoint.int4 import unpack_int4

LM = "model.language_model."


@dataclass(frozen=True)
class Sampling:
    """temperature 0 = greedy; top_k 0 / top_p 1 = off (vLLM's conventions)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


GREEDY = Sampling()
DEFAULT_SAMPLING = Sampling(0.6, 20, 0.95)  # the scripted (and synthetic) generation_config


def sampling_probs(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """[..., V] logits -> the distribution vLLM samples from (one-hot argmax when greedy)."""
    logits = logits.double()
    if sampling.greedy:
        return F.one_hot(logits.argmax(-1), logits.shape[-1]).double()
    logits = logits / sampling.temperature
    if sampling.top_k:
        kth = logits.topk(sampling.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        ordered, order = logits.sort(dim=-1)
        cumulative = ordered.softmax(-1).cumsum(-1)
        drop = cumulative <= 1 - sampling.top_p
        drop[..., -1] = False
        logits = logits.scatter(-1, order, ordered.masked_fill(drop, float("-inf")))
    return logits.softmax(-1)


def nucleus_margin(logits: torch.Tensor, sampling: Sampling) -> float:
    """How far the kept set is from changing, min over rows. With top-p: the distance of the
    ascending cumulative probability (after top-k) from 1 - top_p, in probability; a near-tie at the
    k-th logit then only swaps tokens whose probability is below this margin. Top-k alone: the gap
    between the k-th and (k+1)-th logit (after temperature)."""
    logits = logits.double() / sampling.temperature
    if sampling.top_k:
        top = logits.topk(sampling.top_k + 1, dim=-1).values
        if sampling.top_p == 1.0:
            return float((top[..., -2] - top[..., -1]).min())
        logits = logits.masked_fill(logits < top[..., -2:-1], float("-inf"))
    if sampling.top_p == 1.0:
        return float("inf")
    cumulative = logits.sort(dim=-1).values.softmax(-1).cumsum(-1)
    return float((cumulative - (1 - sampling.top_p)).abs().min())


# ---------------------------------------------------------------- weights


class Weights:
    """Tensors of a sharded safetensors checkpoint, read on demand; linears dequantized to float32."""

    CACHE_LIMIT = 4 << 30  # checkpoints below this keep their dequantized float32 weights

    def __init__(self, model_dir: str | Path, device: str | torch.device = "cpu"):
        from safetensors import safe_open

        self.path = Path(model_dir)
        self.device = torch.device(device)
        index = json.loads((self.path / "model.safetensors.index.json").read_text())
        weight_map = index["weight_map"]
        self._keep = index.get("metadata", {}).get("total_size", 0) < self.CACHE_LIMIT
        self._files = {shard: safe_open(str(self.path / shard), framework="pt") for shard in set(weight_map.values())}
        self._where = weight_map
        self._cache: dict[str, torch.Tensor] = {}

    def has(self, name: str) -> bool:
        return name in self._where

    def raw(self, name: str) -> torch.Tensor:
        return self._files[self._where[name]].get_tensor(name).to(self.device)

    def dense(self, name: str) -> torch.Tensor:
        return self.raw(name).float()

    def linear(self, module: str) -> torch.Tensor:
        """[out, in] float32: bf16 `.weight`, or int4 / int8 `weight_packed` times bf16-rounded scales."""
        if module in self._cache:
            return self._cache[module]
        if self.has(f"{module}.weight"):
            weight = self.dense(f"{module}.weight")
        else:
            packed = self.raw(f"{module}.weight_packed")
            rows, cols = self.raw(f"{module}.weight_shape").tolist()
            # unpacked where the weights go: on the CPU the full checkpoint's int4 unpack (27e9 codes through
            # an int32 intermediate) costs minutes per forward
            if packed.shape[1] * 8 == cols:
                codes = unpack_int4(packed, cols)
            elif packed.shape[1] * 4 == cols:  # int8: four codes per little-endian int32, stored + 128
                codes = packed.contiguous().view(torch.uint8).view(rows, cols).to(torch.int16) - 128
            else:
                raise ValueError(f"{module}: weight_packed {tuple(packed.shape)} fits neither int4 nor int8 of {cols}")
            scales = self.raw(f"{module}.weight_scale").to(torch.bfloat16).float()
            group = cols // scales.shape[1]
            weight = (codes.float().view(rows, -1, group) * scales[..., None]).view(rows, cols)
        if self._keep:
            self._cache[module] = weight
        return weight


# ---------------------------------------------------------------- forward pieces


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)  # FLA's l2norm, as vLLM's kernels use


def _rope(x: torch.Tensor, positions: torch.Tensor, rotary_dim: int, theta: float) -> torch.Tensor:
    """Neox-style rotary embedding on the first `rotary_dim` dims of [T, heads, head_dim]. Text-only
    positions are equal on mrope's three axes, so the interleaved sections reduce to this."""
    half = rotary_dim // 2
    inv_freq = theta ** (-torch.arange(half, dtype=torch.float64, device=x.device) * 2 / rotary_dim)
    angles = positions.double()[:, None] * inv_freq[None, :]
    cos, sin = angles.cos().float()[:, None, :], angles.sin().float()[:, None, :]
    x1, x2, rest = x[..., :half], x[..., half:rotary_dim], x[..., rotary_dim:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)


class Reference:
    """Float32 forward of a qwen3_5 checkpoint (target and MTP module) from its tensors."""

    def __init__(self, model_dir: str | Path, device: str | torch.device = "cpu"):
        self.w = Weights(model_dir, device)
        config = json.loads((self.w.path / "config.json").read_text())
        self.config = config
        t = config["text_config"]
        self.t = t
        self.eps = t["rms_norm_eps"]
        self.layer_types = t["layer_types"]
        rope = t["rope_parameters"]
        self.rotary_dim = int(t["head_dim"] * rope["partial_rotary_factor"])
        self.theta = float(rope["rope_theta"])
        self.draft_ids: list[int] | None = None
        # observe(module, x) sees the input of every attention / MLP / MTP fc linear (drafter_capture.py)
        self.observe = None
        if "draft_vocab" in config:
            record = json.loads((self.w.path / config["draft_vocab"]["ids_file"]).read_text())
            self.draft_ids = record["ids"]

    # -- building blocks

    def _linear(self, x: torch.Tensor, module: str) -> torch.Tensor:
        if self.observe is not None:
            self.observe(module, x)
        return x @ self.w.linear(module).T

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return _rms(x, self.eps) * (1.0 + self.w.dense(name))  # Qwen3.5's (1 + w) RMSNorm

    def _mlp(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        gate = self._linear(x, f"{prefix}.mlp.gate_proj")
        up = self._linear(x, f"{prefix}.mlp.up_proj")
        return self._linear(F.silu(gate) * up, f"{prefix}.mlp.down_proj")

    # the blocks take [B, T, H]: B sequences of one length, run together (each matrix is dequantized once)

    def _attention(self, x: torch.Tensor, positions: torch.Tensor, prefix: str) -> torch.Tensor:
        t = self.t
        heads, kv_heads, hd = t["num_attention_heads"], t["num_key_value_heads"], t["head_dim"]
        p = f"{prefix}.self_attn"
        b, n = x.shape[:2]
        q_gate = self._linear(x, f"{p}.q_proj").view(b, n, heads, 2 * hd)
        q, gate = q_gate[..., :hd], q_gate[..., hd:]
        k = self._linear(x, f"{p}.k_proj").view(b, n, kv_heads, hd)
        v = self._linear(x, f"{p}.v_proj").view(b, n, kv_heads, hd)
        q = _rope(self._norm(q, f"{p}.q_norm.weight"), positions, self.rotary_dim, self.theta)
        k = _rope(self._norm(k, f"{p}.k_norm.weight"), positions, self.rotary_dim, self.theta)
        group = heads // kv_heads
        k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * hd**-0.5
        causal = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        out = torch.einsum("bhqk,bkhd->bqhd", probs, v) * torch.sigmoid(gate)
        return self._linear(out.reshape(b, n, heads * hd), f"{p}.o_proj")

    def _gated_deltanet(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        t = self.t
        hk, hv, dk, dv = (t["linear_num_key_heads"], t["linear_num_value_heads"],
                          t["linear_key_head_dim"], t["linear_value_head_dim"])
        p = f"{prefix}.linear_attn"
        bs, n = x.shape[:2]
        qkv = x @ self.w.linear(f"{p}.in_proj_qkv").T
        z = (x @ self.w.linear(f"{p}.in_proj_z").T).view(bs, n, hv, dv)
        b = x @ self.w.linear(f"{p}.in_proj_b").T
        a = x @ self.w.linear(f"{p}.in_proj_a").T
        conv = self.w.dense(f"{p}.conv1d.weight")  # [channels, 1, kernel], causal depthwise, then SiLU
        kernel = conv.shape[-1]
        qkv = F.silu(F.conv1d(F.pad(qkv.transpose(1, 2), (kernel - 1, 0)), conv, groups=conv.shape[0]).transpose(1, 2))
        q, k, v = qkv.split([hk * dk, hk * dk, hv * dv], dim=-1)
        q = _l2norm(q.reshape(bs, n, hk, dk)).repeat_interleave(hv // hk, dim=2) * dk**-0.5
        k = _l2norm(k.reshape(bs, n, hk, dk)).repeat_interleave(hv // hk, dim=2)
        v = v.reshape(bs, n, hv, dv)
        beta = torch.sigmoid(b)
        decay = torch.exp(-torch.exp(self.w.dense(f"{p}.A_log")) * F.softplus(a + self.w.dense(f"{p}.dt_bias")))
        state = torch.zeros(bs * hv, dk, dv, device=x.device)
        outs = []
        for i in range(n):  # S <- decay S; S += k (beta (v - S^T k))^T; o = S^T q; (sequence, head) pairs as one batch
            ki, qi = k[:, i].reshape(-1, dk), q[:, i].reshape(-1, dk)
            # in place: a fresh state per token was most of the reference's time at large batches (same values)
            state.mul_(decay[:, i].reshape(-1)[:, None, None])
            delta = (v[:, i].reshape(-1, dv) - torch.bmm(ki[:, None, :], state)[:, 0]) * beta[:, i].reshape(-1)[:, None]
            state.baddbmm_(ki[:, :, None], delta[:, None, :])
            outs.append(torch.bmm(qi[:, None, :], state)[:, 0].view(bs, hv, dv))
        core = torch.stack(outs, dim=1)
        core = _rms(core, self.eps) * self.w.dense(f"{p}.norm.weight") * F.silu(z)  # RMSNormGated: scale w
        return core.reshape(bs, n, hv * dv) @ self.w.linear(f"{p}.out_proj").T

    def _decoder(self, x: torch.Tensor, positions: torch.Tensor, prefix: str, kind: str) -> torch.Tensor:
        h = self._norm(x, f"{prefix}.input_layernorm.weight")
        mixed = self._attention(h, positions, prefix) if kind == "full_attention" else self._gated_deltanet(h, prefix)
        x = x + mixed
        return x + self._mlp(self._norm(x, f"{prefix}.post_attention_layernorm.weight"), prefix)

    # -- target

    def embed(self, ids: list[int] | torch.Tensor) -> torch.Tensor:
        ids = torch.as_tensor(ids, device=self.w.device)
        return self.w.linear(f"{LM}embed_tokens")[ids]  # bf16, or int8 after prepare/quant_embed.py

    def hidden(self, ids: list[int]) -> torch.Tensor:
        """[T, H] final-normed hidden states (what the lm_head and the MTP module read)."""
        return self.hidden_batch([ids])[0]

    def hidden_batch(self, batch: list[list[int]]) -> torch.Tensor:
        """[B, T, H]: `hidden` of B sequences of one length T in one forward."""
        if len({len(ids) for ids in batch}) != 1:
            raise ValueError("hidden_batch needs sequences of one length")
        x = self.embed(torch.tensor(batch))
        positions = torch.arange(len(batch[0]), device=x.device)
        for i, kind in enumerate(self.layer_types):
            x = self._decoder(x, positions, f"{LM}layers.{i}", kind)
        return self._norm(x, f"{LM}norm.weight")

    def logits(self, ids: list[int]) -> torch.Tensor:
        """[T, V]: row i is the next-token logits after ids[: i + 1]."""
        return self.hidden(ids) @ self.w.linear("lm_head").T

    # -- MTP drafter

    def mtp_step(self, tokens: list[int], hiddens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The MTP module over rows (token, previous hidden): [T, H] normed outputs."""
        e = self._norm(self.embed(tokens), "mtp.pre_fc_norm_embedding.weight")
        h = self._norm(hiddens, "mtp.pre_fc_norm_hidden.weight")
        x = self._linear(torch.cat([e, h], dim=-1), "mtp.fc")
        x = self._decoder(x[None], positions, "mtp.layers.0", "full_attention")[0]
        return self._norm(x, "mtp.norm.weight")

    def draft_logits(self, mtp_hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, ids): over the draft head's ids when the checkpoint has one, else the full vocabulary."""
        if self.draft_ids is not None:
            ids = torch.tensor(self.draft_ids, device=mtp_hidden.device)
            return mtp_hidden @ self.w.linear("mtp.draft_lm_head").T, ids
        logits = mtp_hidden @ self.w.linear("lm_head").T
        return logits, torch.arange(logits.shape[-1], device=logits.device)

    def mtp_drafts(self, ids: list[int], k: int) -> list[int]:
        """The k greedy MTP drafts after `ids` (whose last token the target just emitted), chained as
        vLLM chains one MTP layer: each step reads its previous draft and its own output hidden."""
        target_hidden = self.hidden(ids)
        tokens = list(ids[1:])
        hiddens = target_hidden[:-1]
        drafts: list[int] = []
        for _ in range(k):
            positions = torch.arange(1, len(tokens) + 1, device=hiddens.device)
            out = self.mtp_step(tokens, hiddens, positions)
            logits, vocab = self.draft_logits(out[-1:])
            drafts.append(int(vocab[logits[0].argmax()]))
            tokens.append(drafts[-1])
            hiddens = torch.cat([hiddens, out[-1:]])
        return drafts

    def context_free_logits(self, tokens: list[int]) -> torch.Tensor:
        """[n, V] logits with every residual branch removed: lm_head(norm(embed(t))). The Markov
        transition the design builds; the full forward differs from it by the branches' wobble."""
        return self._norm(self.embed(tokens), f"{LM}norm.weight") @ self.w.linear("lm_head").T

    # -- per-layer states (bench/gpu/scripted_layers.py compares an engine's forward with them, layer by layer)

    def layer_states(self, ids: list[int], layers: int | None = None) -> dict:
        """The target's forward over one sequence, kept at every layer: {"embedding": [T, H], "layers": one
        {"mixer", "mlp", "stream"} per decoder layer (its attention / GDN branch output, its MLP branch
        output, the residual stream after it: what vLLM's layer returns as hidden + residual), "final": [T, H]
        the final-normed hidden (= `hidden(ids)`)}. `layers` stops after that many layers ("final" None)."""
        x = self.embed(torch.tensor([ids]))
        positions = torch.arange(len(ids), device=x.device)
        states = {"embedding": x[0], "layers": [], "final": None}
        kinds = self.layer_types if layers is None else self.layer_types[:layers]
        for i, kind in enumerate(kinds):
            prefix = f"{LM}layers.{i}"
            h = self._norm(x, f"{prefix}.input_layernorm.weight")
            mixer = self._attention(h, positions, prefix) if kind == "full_attention" else self._gated_deltanet(h, prefix)
            x = x + mixer
            mlp = self._mlp(self._norm(x, f"{prefix}.post_attention_layernorm.weight"), prefix)
            x = x + mlp
            states["layers"].append({"mixer": mixer[0], "mlp": mlp[0], "stream": x[0]})
        if len(kinds) == len(self.layer_types):
            states["final"] = self._norm(x, f"{LM}norm.weight")[0]
        return states


# ---------------------------------------------------------------- acceptance


def step_acceptance(ref: Reference, ids: list[int], drafts: list[int], sampling: Sampling) -> list[float]:
    """Per-position acceptance of one verify step after `ids`: a_i = prod_{j<=i} p(d_j | ids, d_<j)."""
    rows = sampling_probs(ref.logits([*ids, *drafts])[len(ids) - 1 : len(ids) - 1 + len(drafts)], sampling)
    accept = rows[torch.arange(len(drafts)), torch.tensor(drafts, device=rows.device)]
    return accept.cumprod(0).tolist()


def simulate_step(rows: torch.Tensor, drafts: list[int], gen: torch.Generator) -> tuple[int, int]:
    """vLLM's rejection rule on one step: (accepted drafts, emitted token after them). rows[j] is the
    target's sampling distribution at draft j (rows[k] the bonus position)."""
    for j, draft in enumerate(drafts):
        p = rows[j]
        if torch.rand((), generator=gen, dtype=torch.float64) < p[draft]:
            continue
        residual = p.clone()
        residual[draft] = 0.0
        return j, int(torch.multinomial(residual / residual.sum(), 1, generator=gen))
    return len(drafts), int(torch.multinomial(rows[len(drafts)], 1, generator=gen))


def markov_acceptance(transition: torch.Tensor, propose: torch.Tensor, k: int, steps: int = 4000) -> list[float]:
    """Per-position acceptance of MTP with k drafts, averaged over step starts of a long generation,
    for a Markov target: transition[x] = sampling distribution of the next token's index after x,
    propose[x] = the drafter's proposal index after x (or -1: a token outside the active set, never
    accepted). Step starts form their own Markov chain (where each step's emitted token lands); its
    Cesaro-averaged distribution from a uniform start weights each start's acceptance profile."""
    n = transition.shape[0]
    transition = transition.double()
    drafts = [torch.arange(n, device=transition.device)]
    for _ in range(k):
        drafts.append(propose[drafts[-1].clamp(min=0)].where(drafts[-1] >= 0, drafts[-1]))
    index = torch.arange(n, device=transition.device)
    accept_step = []
    for j in range(1, k + 1):
        prev, d = drafts[j - 1], drafts[j]
        p = transition[prev.clamp(min=0)]
        ok = (prev >= 0) & (d >= 0)
        accept_step.append(torch.where(ok, p[index, d.clamp(min=0)], torch.zeros_like(p[:, 0])))
    survive = torch.ones(n, dtype=torch.float64, device=transition.device)
    profile, start_next = [], torch.zeros(n, n, dtype=torch.float64, device=transition.device)
    for j in range(k):
        p = transition[drafts[j].clamp(min=0)]
        residual = p.clone()
        residual[index, drafts[j + 1].clamp(min=0)] -= accept_step[j]
        reject = survive * (1 - accept_step[j])
        start_next += reject[:, None] * residual / (1 - accept_step[j]).clamp(min=1e-300)[:, None]
        survive = survive * accept_step[j]
        profile.append(survive)
    start_next += survive[:, None] * transition[drafts[k].clamp(min=0)]
    mu = torch.full((n,), 1.0 / n, dtype=torch.float64, device=transition.device)
    average = torch.zeros_like(mu)
    for _ in range(steps):
        average += mu
        mu = mu @ start_next
    average /= steps
    return [float(average @ a) for a in profile]


def markov_inputs(ref: Reference, active: list[int], sampling: Sampling) -> tuple[torch.Tensor, torch.Tensor]:
    """(transition, propose) of markov_acceptance from the weights: the context-free target rows
    over the active tokens, and the MTP module's (draft-head-aware) proposal after each of them, as
    an active index or -1. The MTP reads its input token only (zero hidden half of fc, zero o_proj /
    down_proj), so a zero hidden stands for any."""
    index = {t: i for i, t in enumerate(active)}
    columns = torch.tensor(active, device=ref.w.device)
    transition = sampling_probs(ref.context_free_logits(active)[:, columns], sampling)
    hidden = torch.zeros(len(active), ref.t["hidden_size"], device=ref.w.device)
    logits, vocab = ref.draft_logits(ref.mtp_step(active, hidden, torch.arange(len(active), device=ref.w.device)))
    propose = torch.tensor([index.get(int(t), -1) for t in vocab[logits.argmax(-1)].tolist()], device=logits.device)
    return transition, propose


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m qwen_serving.checkpoint.scripted_reference",
        description="Predicted MTP acceptance per draft position for a scripted checkpoint (JSON on stdout).",
    )
    parser.add_argument("model_dir")
    parser.add_argument("--k", type=int, default=7, help="drafts per step")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    from qwen_serving.checkpoint.scripted import Design

    design = Design.read(args.model_dir)
    sampling = Sampling(args.temperature, args.top_k, args.top_p)
    ref = Reference(args.model_dir, args.device)
    acceptance = markov_acceptance(*markov_inputs(ref, design.active, sampling), args.k)
    print(json.dumps({"sampling": vars(sampling), "k": args.k, "acceptance_per_position": acceptance,
                      "tokens_per_step": 1 + sum(acceptance)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
