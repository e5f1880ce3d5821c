"""vLLM 0.28.0's own model code run forward on the CPU over a (tiny) checkpoint; prints the logits as JSON.

    python tests/helpers/scripted_vllm_forward.py MODEL_DIR OUT.pt TOKEN_ID...

vLLM builds Qwen3_5ForConditionalGeneration and Qwen3_5MTP and loads the checkpoint as the engine
does (name mapping, fused projections, ignore list, parameter dtypes). Its module code then runs
forward, except for the three pieces that have no CPU kernel here, replaced by plain torch:
- int4 linears: vLLM's *loaded* weight_packed / weight_scale dequantized, then F.linear (the Marlin
  GEMM is CUDA-only); bf16 linears run vLLM's own unquantized path down to its CPU GEMM, F.linear;
- the attention kernel (`Attention` after q/k norm and RoPE, before the output gate): causal GQA
  softmax attention;
- the GDN core op (causal conv1d + gating + gated delta rule, vllm.cpu_gdn_attention_core):
  F.conv1d with the layer's loaded conv weights, the gating formula of vLLM's fused_gdn_gating,
  and transformers' torch_recurrent_gated_delta_rule (independent of the reference's recurrence).
Everything else is vLLM's: embedding, (1 + w) RMSNorms and residual fusion, q/gate split, q/k
norms, mRoPE, sigmoid output gate, GDN projections split and RMSNormGated, MLP, final norm,
logits, and the MTP's norms / fc concat / decoder layer. Run in float32 (vLLM's modules cast up
after loading) so the comparison is not lost in bf16 rounding.
Writes {"target": [T, V] logits, "mtp": [T - 1, V] logits of the MTP rows (ids[i + 1], hidden[i])}.
"""

import sys
from pathlib import Path

from qwen_serving.engine import cpu_compat

cpu_compat.install()
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

cpu_compat.inspect_models_in_process()
from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule  # noqa: E402
from vllm.config import set_current_vllm_config  # noqa: E402
from vllm.forward_context import set_forward_context  # noqa: E402

from qwen_serving.checkpoint import synth  # noqa: E402
from qwen_serving.checkpoint.int4 import unpack_int4  # noqa: E402
from tests.helpers.vllm_cpu_models import engine_config, load_models, start_cpu_world  # noqa: E402


class DequantizedInt4:
    """Stands in for CompressedTensorsLinearMethod at apply time: vLLM's loaded int4 params, dequantized."""

    def __init__(self, layer):
        rows, cols = layer.weight_packed.shape[0], layer.weight_packed.shape[1] * 8
        codes = unpack_int4(layer.weight_packed.data, cols).float()
        scales = layer.weight_scale.data.float()
        self.weight = (codes.view(rows, scales.shape[1], -1) * scales[..., None]).view(rows, cols)

    def apply(self, layer, x, bias=None):
        return F.linear(x, self.weight, bias)


class CausalAttention(torch.nn.Module):
    def __init__(self, heads: int, kv_heads: int, head_dim: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim

    def forward(self, q, k, v):
        n = q.shape[0]
        q = q.view(n, self.heads, self.head_dim).transpose(0, 1)
        k = k.view(n, self.kv_heads, self.head_dim).transpose(0, 1).repeat_interleave(self.heads // self.kv_heads, 0)
        v = v.view(n, self.kv_heads, self.head_dim).transpose(0, 1).repeat_interleave(self.heads // self.kv_heads, 0)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return out.transpose(0, 1).reshape(n, self.heads * self.head_dim)


GDN_LAYERS = {}


def gdn_core(mixed_qkv, b, a, core_attn_out, layer_name):
    layer = GDN_LAYERS[getattr(layer_name, "value", layer_name)]  # a str or vLLM's LayerName wrapper
    n = mixed_qkv.shape[0]
    weight = layer.conv1d.weight.view(layer.conv1d.weight.shape[0], -1)
    kernel = weight.shape[1]
    x = F.conv1d(F.pad(mixed_qkv.T[None], (kernel - 1, 0)), weight[:, None, :], groups=weight.shape[0])[0].T
    x = F.silu(x)
    q, k, v = x.split([layer.key_dim, layer.key_dim, layer.value_dim], dim=-1)
    g = -layer.A_log.float().exp() * F.softplus(a.float() + layer.dt_bias.float())
    beta = b.float().sigmoid()
    out, _ = torch_recurrent_gated_delta_rule(
        q.reshape(1, n, -1, layer.head_k_dim), k.reshape(1, n, -1, layer.head_k_dim),
        v.reshape(1, n, -1, layer.head_v_dim), g[None], beta[None], use_qk_l2norm_in_kernel=True,
    )
    core_attn_out.copy_(out[0].to(core_attn_out.dtype))


def cpu_models(path: Path):
    """(engine config, {class name: model}): the target and the MTP drafter loaded from `path`, with the three
    CPU stand-ins above installed and cast to float32. Shared with tests/helpers/scripted_layers_cpu.py."""
    config = engine_config(path, num_speculative_tokens=1, max_model_len=512)
    start_cpu_world(config)
    stored = dict(synth.iter_checkpoint(path))
    models = {name: model for name, (_, model) in load_models(config, stored.items).items()}
    with set_current_vllm_config(config):
        text = config.model_config.hf_text_config
        for model in models.values():
            for module in model.modules():
                method = type(getattr(module, "quant_method", None)).__name__
                if method == "CompressedTensorsLinearMethod":
                    module.quant_method = DequantizedInt4(module)
                elif method.startswith("Unquantized"):  # what process_weights_after_loading sets on CPU
                    module.cpu_linear = F.linear
                if hasattr(module, "attn") and hasattr(module, "q_norm"):
                    module.attn = CausalAttention(text.num_attention_heads, text.num_key_value_heads, text.head_dim)
                if type(module).__name__ == "QwenGatedDeltaNetAttention":
                    GDN_LAYERS[module.prefix] = module
            model.float()
            for module in model.modules():  # else the lm_head casts back to the config's bf16
                if type(module).__name__ == "LogitsProcessor":
                    module.head_dtype = None
        torch.ops.vllm.cpu_gdn_attention_core = gdn_core
    return config, models


def main() -> None:
    path, out_path, ids = Path(sys.argv[1]), Path(sys.argv[2]), [int(t) for t in sys.argv[3:]]
    config, models = cpu_models(path)
    with set_current_vllm_config(config):
        target, drafter = models["Qwen3_5ForConditionalGeneration"], models["Qwen3_5MTP"]
        input_ids = torch.tensor(ids)
        positions = torch.arange(len(ids))
        with torch.no_grad(), set_forward_context(None, config):
            hidden = target(input_ids=input_ids, positions=positions.expand(3, -1))
            logits = target.compute_logits(hidden)
            mtp_hidden = drafter(input_ids=input_ids[1:], positions=positions[1:].expand(3, -1),
                                 hidden_states=hidden[:-1])
            mtp_logits = drafter.compute_logits(mtp_hidden)
    torch.save({"target": logits.float(), "mtp": mtp_logits.float(), "hidden": hidden.float()}, out_path)


if __name__ == "__main__":
    main()
