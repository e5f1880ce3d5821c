"""vLLM 0.28.0's own DFlash2 drafter run on the CPU over a scripted drafter; writes its blocks as JSON.

    python tests/helpers/scripted_dflash2_vllm.py [--blocks-only] TARGET_DIR ANCHOR,ANCHOR,... DRAFTER_DIR OUT.json \
        [DRAFTER_DIR OUT.json ...]

Several drafters share one process (vLLM's import and the CPU world are most of a run's fixed cost).
--blocks-only writes "blocks" and "candidates" alone: the greedy walk after the first context, no sampled walks.

vLLM builds DFlash2Qwen3ForCausalLM from the drafter's config.json (the engine config that
`--speculative-config '{"method": "dflash", "model": DRAFTER_DIR, "num_speculative_tokens": 7}'`
makes) and loads the directory with its DefaultModelLoader (name mapping, fused qkv / gate_up,
the unfilled-parameter check). The target's embedding and lm_head are then shared into it, as
load_dflash_model does. Per anchor, vLLM's code runs: combine_hidden_states (fc) over a random
context of target aux hidden states, precompute_and_store_context_kv, the forward over the query
block [anchor, mask x 7] (grouped convs, attention, MLP, norms), compute_candidates (top-K of the
lm_head), the CandidateSelector's edge scores, and the V2 speculator's `_selector_walk_kernel`
(Triton, in the interpreter) at temperature 0 and, Gumbel-noised as with probabilistic drafts, at
SAMPLED_TEMPERATURES. Replaced, having no CPU kernel in this build:
- `vllm._custom_ops.rms_norm` / `rotary_embedding` (the context-KV precompute's fused ops): torch;
- libdevice's log1p in the walk's Gumbel noise (no interpreter implementation): log(1 + x);
- the Attention kernel: softmax attention of the block's queries over the stored context K/V and
  the block's own K/V (causal, as the drafter's sliding layers are).
Writes per drafter {"blocks": {anchor: [7 drafts]}, "blocks_other_context": {...}, "blocks_sampled": {anchor: [one block
per temperature and context]}, "blocks_flattened_scores": {...}, "candidates": K}.
"""

import json
import sys
from pathlib import Path

from qwen_serving.engine import cpu_compat

cpu_compat.install()
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

cpu_compat.inspect_models_in_process()
from safetensors import safe_open  # noqa: E402
from vllm import _custom_ops  # noqa: E402
from vllm.config import set_current_vllm_config  # noqa: E402
from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.forward_context import set_forward_context  # noqa: E402
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader  # noqa: E402
from vllm.model_executor.model_loader.utils import initialize_model  # noqa: E402
from vllm.triton_utils import tl  # noqa: E402
from vllm.utils.torch_utils import set_default_torch_dtype  # noqa: E402
from vllm.v1.worker.gpu.sample import gumbel  # noqa: E402
from vllm.v1.worker.gpu.spec_decode.dflash2.speculator import _selector_walk_kernel  # noqa: E402

from tests.helpers.vllm_cpu_models import start_cpu_world  # noqa: E402

DRAFTS = 7
SAMPLED_TEMPERATURES = (0.6, 1.0, 2.0)  # the walk Gumbel-noised, as with draft_sample_method probabilistic


def rms_norm(out, x, weight, eps):
    """ops.rms_norm; a 2-D weight is one row per outermost index (the precompute's grouped k-norm)."""
    y = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        w = weight.float()
        y = y * (w.view(w.shape[0], *([1] * (x.dim() - 2)), w.shape[1]) if w.dim() == 2 else w)
    out.copy_(y.to(out.dtype))


def rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox, *args):
    """ops.rotary_embedding, in place, neox or interleaved, on [N, heads * head_size]."""
    for x in (query, key):
        if x is None:
            continue
        rot = cos_sin_cache.shape[-1]
        cos, sin = cos_sin_cache[positions].float().chunk(2, dim=-1)
        v = x.view(x.shape[0], -1, head_size).float()
        part = v[..., :rot]
        if is_neox:
            x1, x2 = part[..., : rot // 2], part[..., rot // 2 :]
        else:
            x1, x2 = part[..., 0::2], part[..., 1::2]
        c, s = cos[:, None, :], sin[:, None, :]
        r1, r2 = x1 * c - x2 * s, x2 * c + x1 * s
        new = torch.cat([r1, r2], -1) if is_neox else torch.stack([r1, r2], -1).flatten(-2)
        v[..., :rot] = new
        x.copy_(v.view_as(x).to(x.dtype))


class InterpretedLibdevice:
    """gumbel_noised_argmax's one libdevice call, which Triton's interpreter does not implement."""

    @staticmethod
    def log1p(x):
        return tl.log(1.0 + x)


class ContextWriter:
    """The attention impl's cache write, as the precompute calls it: keeps the layer's context K/V."""

    context: tuple[torch.Tensor, torch.Tensor]

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        self.context = (key.float(), value.float())


class ContextAttention(torch.nn.Module):
    """Stands in for Attention: keeps the context K/V the precompute writes, attends the block to it."""

    def __init__(self, heads: int, kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.scale = heads, kv_heads, head_dim, scale
        self.kv_cache = None
        self.impl = ContextWriter()



    def forward(self, q, k, v):
        n, hd = q.shape[0], self.head_dim
        ck, cv = self.impl.context
        keys = torch.cat([ck, k.view(n, self.kv_heads, hd).float()])
        values = torch.cat([cv, v.view(n, self.kv_heads, hd).float()])
        group = self.heads // self.kv_heads
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q.view(n, self.heads, hd).float(), keys) * self.scale
        context = ck.shape[0]
        allowed = torch.ones(n, context + n, dtype=torch.bool).tril(context)  # causal within the block
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        return torch.einsum("hqk,khd->qhd", probs, values).reshape(n, self.heads * hd).to(q.dtype)


def target_tensor(target: Path, name: str) -> torch.Tensor:
    index = json.loads((target / "model.safetensors.index.json").read_text())["weight_map"]
    with safe_open(str(target / index[name]), framework="pt") as f:
        return f.get_tensor(name)


def load_drafter_on_cpu(config, draft_config, target: Path):
    """vLLM's DFlash2 drafter built and loaded as its engine would (inside set_current_vllm_config), with the
    target's embedding and lm_head shared in as load_dflash_model does (the drafter ships neither), the
    attention kernel swapped for ContextAttention, and the model in float32."""
    with set_default_torch_dtype(draft_config.dtype), torch.device("cpu"):
        model = initialize_model(vllm_config=config, model_config=draft_config)
    DefaultModelLoader(config.load_config).load_weights(model, draft_config)
    lm = "model.language_model."
    model.model.embed_tokens.weight.data.copy_(target_tensor(target, f"{lm}embed_tokens.weight"))
    model.lm_head.weight.data.copy_(target_tensor(target, "lm_head.weight"))
    for layer in model.model.layers:
        attn = layer.self_attn
        attn.attn = ContextAttention(attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.scaling)
    model.float()
    model.model._build_fused_kv_buffers()  # the precompute's fused copies, now of the float32 weights
    for module in model.modules():
        if type(module).__name__ == "LogitsProcessor":  # else the lm_head casts back to bf16
            module.head_dtype = None
        if type(getattr(module, "quant_method", None)).__name__.startswith("Unquantized"):
            module.cpu_linear = F.linear  # what process_weights_after_loading sets on the CPU
    return model


def walk(scores: torch.Tensor, candidates: torch.Tensor, position: int, temperature: float = 0.0,
         seed: int = 0) -> list[int]:
    """vLLM's _selector_walk_kernel for one request: plain argmax at temperature 0, else Gumbel-max over
    scores / temperature keyed by (seed, position, candidate id), as the V2 speculator runs it with
    probabilistic drafts."""
    steps, top_k = candidates.shape[1], candidates.shape[2]
    tokens = torch.zeros(steps, dtype=torch.int64)
    realized = torch.zeros(1, steps, top_k, dtype=torch.float32)
    _selector_walk_kernel[(1,)](
        scores.float().contiguous(), candidates.contiguous(), torch.arange(steps) + position,
        torch.zeros(steps, dtype=torch.int32), torch.tensor([temperature], dtype=torch.float32),
        torch.tensor([seed], dtype=torch.int64), tokens, realized, num_steps=steps, top_k=top_k,
        BLOCK_K=1 << (top_k - 1).bit_length(), SAMPLE_PROBABILISTIC=temperature > 0, USE_FP64=False)
    return tokens.tolist()


def engine_config(target: Path, drafter: Path):
    return EngineArgs(model=str(target), language_model_only=True, max_model_len=512, enforce_eager=True,
                      speculative_config={"method": "dflash", "model": str(drafter),
                                          "num_speculative_tokens": DRAFTS}).create_engine_config()


def drafter_blocks(config, target: Path, anchors: list[int], blocks_only: bool = False) -> dict:
    """One drafter's JSON record (the module docstring's keys), the drafter being config's speculative model."""
    draft_config = config.speculative_config.draft_model_config
    with set_current_vllm_config(config):
        model = load_drafter_on_cpu(config, draft_config, target)
        hf = draft_config.hf_config
        mask = int(hf.dflash_config["mask_token_id"])
        gen = torch.Generator().manual_seed(0)
        feature = model.model.fc.input_size
        result = {"candidates": int(hf.dflash_config["selector_top_k"])}
        sampled: dict[int, list[list[int]]] = {}
        control: dict[int, list[list[int]]] = {}
        for key, context_len in (("blocks", 24),) if blocks_only else (("blocks", 24), ("blocks_other_context", 40)):
            blocks = {}
            for anchor in anchors:
                context = torch.randn(context_len, feature, generator=gen)
                with torch.no_grad(), set_forward_context(None, config):
                    states = model.combine_hidden_states(context)
                    model.precompute_and_store_context_kv(states, torch.arange(context_len),
                                                          torch.arange(context_len))
                    ids = torch.tensor([anchor] + [mask] * DRAFTS)
                    positions = torch.arange(context_len, context_len + 1 + DRAFTS)
                    hidden = model(input_ids=ids, positions=positions)[1:]
                    candidates, unary = model.compute_candidates(hidden)
                    scores = model.model.candidate_selector(candidates[None], unary[None], hidden[None],
                                                            torch.tensor([anchor]))
                blocks[anchor] = walk(scores, candidates[None], context_len + 1)
                if blocks_only:
                    continue
                sampled.setdefault(anchor, []).extend(
                    walk(scores, candidates[None], context_len + 1, temperature, seed=anchor + i)
                    for i, temperature in enumerate(SAMPLED_TEMPERATURES))
                # control: the same walk over scores shrunk 1000-fold (margin < 0.1) must wander; one walk per
                # anchor and context is enough, every one of three per context wandered when there were three
                control.setdefault(anchor, []).append(walk(scores * 1e-3, candidates[None], context_len + 1, 1.0,
                                                           seed=anchor))
            result[key] = blocks
    if not blocks_only:
        result["blocks_sampled"], result["blocks_flattened_scores"] = sampled, control
    return result


def main() -> None:
    args = sys.argv[1:]
    blocks_only = args[:1] == ["--blocks-only"]
    args = args[blocks_only:]
    if len(args) < 4 or len(args) % 2:
        sys.exit("usage: scripted_dflash2_vllm.py [--blocks-only] TARGET ANCHOR,... DRAFTER OUT.json [DRAFTER OUT.json ...]")
    target, anchors, pairs = Path(args[0]), [int(t) for t in args[1].split(",")], args[2:]
    configs = [engine_config(target, Path(drafter)) for drafter in pairs[::2]]
    start_cpu_world(configs[0])
    _custom_ops.rms_norm = rms_norm
    _custom_ops.rotary_embedding = rotary_embedding
    gumbel.tldevice = InterpretedLibdevice
    for config, out_path in zip(configs, pairs[1::2], strict=True):
        Path(out_path).write_text(json.dumps(drafter_blocks(config, target, anchors, blocks_only)))


if __name__ == "__main__":
    main()
