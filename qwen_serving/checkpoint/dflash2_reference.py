"""Float32 forward of a DFlash2 block drafter (vLLM 0.28.0's `qwen3_dflash2`) from its tensors, for the capture.

What vLLM's V2 runner computes for one request step (docs/scripted-dflash2.md, "How one step runs"):
- context: the target's residual stream after each of `target_layer_ids` (concatenated, [N, 5 H]) goes
  through `fc`, then `hidden_norm`; every layer's `k_proj` / `v_proj` of those rows, k-norm and RoPE at
  the context positions, are the K/V the query block attends to (`precompute_and_store_context_kv`);
- query block at positions p .. p + S - 1 (S = 1 + num_speculative_tokens): [anchor, mask x (S - 1)]
  through the target's embedding, then per layer: input norm (fused residual add), the attention
  conv's `prepare` (kernel_projection -> per-row tap coefficients, grouped causal conv within the block),
  attention (q/k/v, per-head q/k norm, RoPE, softmax over the context K/V before p plus the block's own
  K/V, causal on sliding layers, inside the window), `o_proj`, the conv's `finish`, the same around the
  MLP (gate/up, SiLU, down) with `mlp_conv`; final norm.
Norms are Qwen3's RMSNorm (x * w). Many blocks run together: rows are laid out block after block, as
vLLM lays out the query tokens of several requests (its conv reads the position inside a block from
the row index modulo S, which is what the [blocks, S] layout here gives).

`observe(module, x)` sees the input of every matrix the W4A16 drafter quantizes (`fc` and each layer's
q/k/v/o, gate/up/down; checkpoint names), including the context rows that reach k_proj / v_proj; the
conv kernel projections and the candidate selector stay bf16 in vLLM (built without a quant config)
and are not observed. tests/test_drafter_dflash2.py checks this forward against vLLM's own model code
run on the CPU (tests/helpers/dflash2_vllm_forward.py): final hidden states and every observed input.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

from qwen_serving.checkpoint.dflash2_format import ARCHITECTURE, is_dflash2_drafter
from qwen_serving.checkpoint.model_dir import CheckpointError
from qwen_serving.checkpoint.scripted_reference import _rope


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class Dflash2Forward:
    """The drafter's float32 forward; `target_embed(ids)` gives the target's embedding rows (shared in vLLM)."""

    def __init__(self, drafter_dir: str | Path, device: str | torch.device = "cpu"):
        from safetensors.torch import load_file

        self.path = Path(drafter_dir)
        if not is_dflash2_drafter(self.path):
            raise CheckpointError(f"{self.path}: not a DFlash2 drafter (config.json architectures lacks {ARCHITECTURE})")
        self.config = json.loads((self.path / "config.json").read_text())
        tensors = load_file(str(self.path / "model.safetensors"), device=str(device))
        packed = sorted(n for n in tensors if n.endswith(".weight_packed"))
        if packed:
            raise CheckpointError(f"{self.path} is already quantized ({packed[0]}): capture from the bf16 drafter")
        self.w = {name: t.float() for name, t in tensors.items()}
        c, d = self.config, self.config["dflash_config"]
        self.eps = float(c["rms_norm_eps"])
        self.heads, self.kv_heads = int(c["num_attention_heads"]), int(c["num_key_value_heads"])
        self.head_dim = int(c.get("head_dim") or c["hidden_size"] // self.heads)
        self.theta = float((c.get("rope_parameters") or {}).get("rope_theta", c.get("rope_theta", 1e6)))
        self.layers = int(c["num_hidden_layers"])
        self.taps, self.group = int(d["conv_kernel_size"]), int(d["conv_group_size"])
        self.block = int(d["block_size"])
        self.mask_token_id = int(d["mask_token_id"])
        self.target_layer_ids = [int(t) for t in d["target_layer_ids"]]
        self.embedding_scale = float(d.get("input_embedding_scale", 1.0))
        types = c.get("layer_types") or ["full_attention"] * self.layers
        causal_override = d.get("causal")
        self.causal = [bool(causal_override) if causal_override is not None else t == "sliding_attention" for t in types]
        window = d.get("swa_window_size", c.get("sliding_window"))
        self.window = [int(window) if t == "sliding_attention" and window else None for t in types]
        self.observe = None

    def _linear(self, x: torch.Tensor, module: str) -> torch.Tensor:
        if self.observe is not None:
            self.observe(module, x)
        return x @ self.w[f"{module}.weight"].T

    # -- context

    def context_states(self, aux: torch.Tensor) -> torch.Tensor:
        """[N, H]: hidden_norm(fc(aux)), aux = the target's states at target_layer_ids, concatenated."""
        return _rms(self._linear(aux, "fc"), self.w["hidden_norm.weight"], self.eps)

    def context_kv(self, states: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (K, V) [N, kv_heads, head_dim] of the context rows: k-normed and rotated K, plain V."""
        out = []
        for i in range(self.layers):
            p = f"layers.{i}.self_attn"
            k = self._linear(states, f"{p}.k_proj").view(len(states), self.kv_heads, self.head_dim)
            v = self._linear(states, f"{p}.v_proj").view(len(states), self.kv_heads, self.head_dim)
            k = _rope(_rms(k, self.w[f"{p}.k_norm.weight"], self.eps), positions, self.head_dim, self.theta)
            out.append((k, v))
        return out

    # -- the query blocks

    def _conv(self, x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        """Grouped causal conv inside each block: x [B, S, H], delta [B, S, taps, groups], base [taps, H]."""
        b, s, h = x.shape
        groups = h // self.group
        coefficients = base.view(1, 1, self.taps, groups, self.group) + delta[..., None]
        blocks = x.view(b, s, groups, self.group)
        out = coefficients[:, :, 0] * blocks
        for tap in range(1, min(self.taps, s)):
            out[:, tap:] += coefficients[:, tap:, tap] * blocks[:, :-tap]
        return out.view(b, s, h)

    def _conv_prepare(self, x: torch.Tensor, prefix: str) -> tuple[torch.Tensor, torch.Tensor]:
        b, s, _ = x.shape
        coefficients = (x @ self.w[f"{prefix}.kernel_projection.weight"].T).view(b, s, 2, self.taps, -1)
        base = self.w[f"{prefix}.base_kernel"]
        return self._conv(x, coefficients[:, :, 0], base[0]), coefficients[:, :, 1]

    def _attention(self, x: torch.Tensor, positions: torch.Tensor, context: tuple[torch.Tensor, torch.Tensor],
                   anchors: torch.Tensor, i: int) -> torch.Tensor:
        b, s, _ = x.shape
        p, hd = f"layers.{i}.self_attn", self.head_dim
        rows = x.reshape(b * s, -1)
        q = self._linear(rows, f"{p}.q_proj").view(b * s, self.heads, hd)
        k = self._linear(rows, f"{p}.k_proj").view(b * s, self.kv_heads, hd)
        v = self._linear(rows, f"{p}.v_proj").view(b, s, self.kv_heads, hd)
        flat_positions = positions.reshape(-1)
        q = _rope(_rms(q, self.w[f"{p}.q_norm.weight"], self.eps), flat_positions, hd, self.theta).view(b, s, self.heads, hd)
        k = _rope(_rms(k, self.w[f"{p}.k_norm.weight"], self.eps), flat_positions, hd, self.theta).view(b, s, self.kv_heads, hd)
        ctx_k, ctx_v = context
        repeat = self.heads // self.kv_heads
        ctx_k, ctx_v = ctx_k.repeat_interleave(repeat, 1), ctx_v.repeat_interleave(repeat, 1)
        k, v = k.repeat_interleave(repeat, 2), v.repeat_interleave(repeat, 2)
        scale = hd**-0.5
        ctx_scores = torch.einsum("bqhd,nhd->bhqn", q, ctx_k) * scale
        own_scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
        # block b's queries see the context before its anchor (position anchors[b]) and, on causal layers,
        # the block's own rows up to their own; a sliding layer also drops keys a window or more behind
        ctx_pos = torch.arange(len(ctx_k), device=x.device)
        ctx_ok = ctx_pos[None, None, :] < anchors[:, None, None]
        own_ok = torch.ones(s, s, dtype=torch.bool, device=x.device)
        if self.causal[i]:
            own_ok = own_ok.tril()
        own_ok = own_ok[None].expand(b, s, s)
        if self.window[i] is not None:
            ctx_ok = ctx_ok & (ctx_pos[None, None, :] > positions[:, :, None] - self.window[i])
            own_ok = own_ok & (positions[:, None, :] > positions[:, :, None] - self.window[i])
        scores = torch.cat([ctx_scores.masked_fill(~ctx_ok[:, None], float("-inf")),
                            own_scores.masked_fill(~own_ok[:, None], float("-inf"))], -1)
        probs = scores.softmax(-1)
        n = len(ctx_v)
        out = torch.einsum("bhqn,nhd->bqhd", probs[..., :n], ctx_v) + torch.einsum("bhqk,bkhd->bqhd", probs[..., n:], v)
        return self._linear(out.reshape(b * s, self.heads * hd), f"{p}.o_proj").view(b, s, -1)

    def _mlp(self, x: torch.Tensor, i: int) -> torch.Tensor:
        b, s, _ = x.shape
        rows, p = x.reshape(b * s, -1), f"layers.{i}.mlp"
        act = F.silu(self._linear(rows, f"{p}.gate_proj")) * self._linear(rows, f"{p}.up_proj")
        return self._linear(act, f"{p}.down_proj").view(b, s, -1)

    def blocks(self, embeds: torch.Tensor, anchors: torch.Tensor,
               context: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """[B, S, H] final-normed hidden states of B query blocks; embeds [B, S, H] (anchor row first), block b
        at positions anchors[b] .. anchors[b] + S - 1 over the context rows before anchors[b]."""
        s = embeds.shape[1]
        positions = anchors[:, None] + torch.arange(s, device=embeds.device)[None]
        residual, x = None, embeds
        for i in range(self.layers):
            p = f"layers.{i}"
            residual = x if residual is None else residual + x
            h = _rms(residual, self.w[f"{p}.input_layernorm.weight"], self.eps)
            h, coefficients = self._conv_prepare(h, f"{p}.attention_conv")
            h = self._attention(h, positions, context[i], anchors, i)
            h = self._conv(h, coefficients, self.w[f"{p}.attention_conv.base_kernel"][1])
            residual = residual + h
            h = _rms(residual, self.w[f"{p}.post_attention_layernorm.weight"], self.eps)
            h, coefficients = self._conv_prepare(h, f"{p}.mlp_conv")
            x = self._conv(self._mlp(h, i), coefficients, self.w[f"{p}.mlp_conv.base_kernel"][1])
        return _rms(residual + x, self.w["norm.weight"], self.eps)

    def block_inputs(self, target_embed, ids: list[int], anchors: list[int]) -> torch.Tensor:
        """[B, S, H]: the embedded [ids[p], mask x (S - 1)] of each anchor position p."""
        s = self.block
        block_ids = torch.tensor([[ids[p]] + [self.mask_token_id] * (s - 1) for p in anchors])
        return target_embed(block_ids.view(-1)).view(len(anchors), s, -1) * self.embedding_scale
