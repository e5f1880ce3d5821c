"""vLLM 0.28.0's DFlash2 context-KV precompute on the CPU over given rows; writes the K/V it caches.

    python tests/helpers/dflash2_context_kv.py TARGET_DIR STATES.safetensors DRAFTER_DIR OUT.safetensors DTYPE \
        [DRAFTER_DIR OUT.safetensors DTYPE ...]

Each drafter in turn, in one process (vLLM's import and the CPU world are most of a run's fixed cost), with its own
engine config; DTYPE: auto (the drafter's) or float32.

Whichever vLLM is importable (the pristine venv copy or the patched tree, by PYTHONPATH) builds and loads the
drafter as tests/helpers/dflash2_vllm_load.py does (the engine config of `--speculative-config {"method":
"dflash", ...}`, WNA16 forced to Marlin, DefaultModelLoader.load_weights, which ends in the drafter's own
_build_fused_kv_buffers), at the drafter's dtype (bf16, DTYPE auto) or the engine's dtype float32. Then
precompute_and_store_context_kv runs over STATES' `states` [N, H] (the rows after fc) at positions 0..N-1.
CPU stand-ins, having no CPU kernel in this build: the fused rms_norm / rotary ops and the Attention layer
(tests/helpers/scripted_dflash2_vllm.py; its impl keeps the K/V the precompute writes), and the body of
MarlinLinearKernel.apply_weights, the CUDA GEMM an int4 linear's quant method ends in (CompressedTensorsLinearMethod
-> CompressedTensorsWNA16 -> the kernel, all vLLM's): vLLM's loaded weight_packed / weight_scale dequantized in
float32, then F.linear (tests/helpers/scripted_vllm_forward.py's DequantizedInt4). Marlin's repacking
(process_weights_after_loading) is not run: its ops are CUDA-only too, and the stand-in reads the loaded layout.
OUT: `k.{i}` / `v.{i}` [N, kv_heads, head_dim] float32 per layer, as written to the cache; the fused buffers the
load built (`fused_kv_weight`, `fused_kv_bias` where they exist, `k_norm_weights`); `marlin_calls`, the layer
index of every call that reached Marlin's apply_weights during the precompute.
"""

import sys
from pathlib import Path

from qwen_serving.engine import cpu_compat

cpu_compat.install()
import torch  # noqa: E402

cpu_compat.inspect_models_in_process()
import vllm.model_executor.layers.quantization.compressed_tensors.schemes.compressed_tensors_wNa16 as wna16  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from vllm import _custom_ops  # noqa: E402
from vllm.config import set_current_vllm_config  # noqa: E402
from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.forward_context import set_forward_context  # noqa: E402
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader  # noqa: E402
from vllm.model_executor.model_loader.utils import initialize_model  # noqa: E402
from vllm.utils.torch_utils import set_default_torch_dtype  # noqa: E402

from tests.helpers.scripted_dflash2_vllm import ContextAttention, rms_norm, rotary_embedding  # noqa: E402
from tests.helpers.scripted_vllm_forward import DequantizedInt4  # noqa: E402
from tests.helpers.vllm_cpu_models import start_cpu_world  # noqa: E402

MARLIN_CALLS: list[str] = []


def marlin_on_cpu(kernel, layer, x, bias=None):
    """MarlinLinearKernel.apply_weights on the CPU: the layer's int4 weights dequantized, then F.linear."""
    MARLIN_CALLS.append(layer.prefix)
    return torch.nn.functional.linear(x, DequantizedInt4(layer).weight.to(x.dtype), bias)


def engine_config(target: Path, drafter: Path, dtype: str):
    return EngineArgs(model=str(target), language_model_only=True, max_model_len=512, enforce_eager=True, dtype=dtype,
                      speculative_config={"method": "dflash", "model": str(drafter),
                                          "num_speculative_tokens": 7}).create_engine_config()


def context_kv(config, states: torch.Tensor) -> dict[str, torch.Tensor]:
    """OUT's tensors (the module docstring's) for config's speculative model."""
    MARLIN_CALLS.clear()
    draft_config = config.speculative_config.draft_model_config
    with set_current_vllm_config(config):
        with set_default_torch_dtype(draft_config.dtype), torch.device("cpu"):
            model = initialize_model(vllm_config=config, model_config=draft_config)
        DefaultModelLoader(config.load_config).load_weights(model, draft_config)
        inner = model.model
        out = {"k_norm_weights": inner._k_norm_weights.float()}
        for name in ("fused_kv_weight", "fused_kv_bias"):  # as the load built them
            buffer = getattr(inner, f"_{name}", None)
            if buffer is not None:
                out[name] = buffer.clone()
        for layer in model.model.layers:
            attn = layer.self_attn
            attn.attn = ContextAttention(attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.scaling)
        inner._build_fused_kv_buffers()  # again, for the cache writes to reach the stand-in layers
        n = len(states)
        with torch.no_grad(), set_forward_context(None, config):
            model.precompute_and_store_context_kv(states.to(draft_config.dtype), torch.arange(n), torch.arange(n))
    layer_of = {layer.self_attn.qkv_proj.prefix: i for i, layer in enumerate(inner.layers)}
    out["marlin_calls"] = torch.tensor([layer_of.get(prefix, -1) for prefix in MARLIN_CALLS], dtype=torch.int64)
    for i, layer in enumerate(inner.layers):
        out[f"k.{i}"], out[f"v.{i}"] = layer.self_attn.attn.impl.context
    return {k: v.contiguous() for k, v in out.items()}


def main() -> None:
    target, states_path, jobs = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
    if not jobs or len(jobs) % 3 or not set(jobs[2::3]) <= {"auto", "float32"}:
        sys.exit("usage: dflash2_context_kv.py TARGET STATES DRAFTER OUT {auto,float32} [DRAFTER OUT DTYPE ...]")
    states = load_file(str(states_path))["states"]
    wna16.choose_mp_linear_kernel = lambda config: wna16.MarlinLinearKernel
    wna16.MarlinLinearKernel.apply_weights = marlin_on_cpu
    _custom_ops.rms_norm = rms_norm
    _custom_ops.rotary_embedding = rotary_embedding
    configs = [engine_config(target, Path(drafter), dtype) for drafter, dtype in zip(jobs[::3], jobs[2::3], strict=True)]
    start_cpu_world(configs[0])
    for config, out_path in zip(configs, jobs[1::3], strict=True):
        save_file(context_kv(config, states), out_path)


if __name__ == "__main__":
    main()
