"""vLLM 0.28.0 builds and loads a (quantized) DFlash2 drafter on the CPU; writes what each linear came up as.

    python tests/helpers/dflash2_vllm_load.py TARGET_DIR DRAFTER_DIR OUT.json [DRAFTER_DIR OUT.json ...]

Several drafters load in turn in one process (vLLM's import and the CPU world are most of a run's fixed cost), each
under its own engine config; a failed load ends that drafter's turn only.

The engine config `--speculative-config {"method": "dflash", "model": DRAFTER_DIR, ...}` makes, vLLM's
initialize_model and DefaultModelLoader.load_weights (its unfilled-parameter check and the drafter's
own _build_fused_kv_buffers included). The WNA16 linear kernel is forced to Marlin, the one a CUDA GPU
picks (the CPU platform has none; loading only needs create_weights). OUT: {"loaded": true, "layers":
{vLLM module: {"scheme", "bits", "bytes_equal"}}} (bytes_equal: weight_packed, or the bf16 weight, equal
to the checkpoint's tensors, fused parts concatenated), or {"loaded": false, "error": "..."}.
"""

import json
import sys
import traceback
from pathlib import Path

from qwen_serving.engine import cpu_compat

cpu_compat.install()
import torch  # noqa: E402

cpu_compat.inspect_models_in_process()
import vllm.model_executor.layers.quantization.compressed_tensors.schemes.compressed_tensors_wNa16 as wna16  # noqa: E402
from safetensors import safe_open  # noqa: E402
from vllm.config import set_current_vllm_config  # noqa: E402
from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader  # noqa: E402
from vllm.model_executor.model_loader.utils import initialize_model  # noqa: E402
from vllm.utils.torch_utils import set_default_torch_dtype  # noqa: E402

from tests.helpers.vllm_cpu_models import start_cpu_world  # noqa: E402

PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def stored_tensors(drafter: Path) -> dict[str, torch.Tensor]:
    index = drafter / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    out = {}
    for name in files:
        with safe_open(str(drafter / name), framework="pt") as f:
            out.update({t: f.get_tensor(t) for t in f.keys()})
    return out


def engine_config(target: Path, drafter: Path):
    return EngineArgs(model=str(target), language_model_only=True, max_model_len=512, enforce_eager=True,
                      speculative_config={"method": "dflash", "model": str(drafter),
                                          "num_speculative_tokens": 7}).create_engine_config()


def load_report(config, drafter: Path) -> dict:
    """OUT's record (the module docstring's) for config's speculative model, the drafter at `drafter`."""
    draft_config = config.speculative_config.draft_model_config
    stored = stored_tensors(drafter)
    with set_current_vllm_config(config):
        with set_default_torch_dtype(draft_config.dtype), torch.device("cpu"):
            model = initialize_model(vllm_config=config, model_config=draft_config)
        try:
            DefaultModelLoader(config.load_config).load_weights(model, draft_config)
        except Exception as e:  # the report says how it failed; the test decides
            return {"loaded": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-2000:]}
    layers = {}
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf not in ("fc", "qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            continue
        checkpoint = name[len("model."):]
        parts = [checkpoint.rsplit(".", 1)[0] + "." + p for p in PARTS[leaf]] if leaf in PARTS else [checkpoint]
        scheme = getattr(module, "scheme", None)
        if scheme is not None:
            expected = torch.cat([stored[f"{p}.weight_packed"] for p in parts])
            equal = torch.equal(module.weight_packed.data, expected)
        else:
            equal = torch.equal(module.weight.data, torch.cat([stored[f"{p}.weight"] for p in parts]))
        layers[name] = {"scheme": type(scheme).__name__ if scheme else None,
                        "bits": getattr(scheme, "num_bits", None), "bytes_equal": bool(equal)}
    return {"loaded": True, "layers": layers}


def main() -> None:
    target, pairs = Path(sys.argv[1]), sys.argv[2:]
    if not pairs or len(pairs) % 2:
        sys.exit("usage: dflash2_vllm_load.py TARGET DRAFTER OUT.json [DRAFTER OUT.json ...]")
    wna16.choose_mp_linear_kernel = lambda config: wna16.MarlinLinearKernel
    drafters = [Path(d) for d in pairs[::2]]
    configs = [engine_config(target, drafter) for drafter in drafters]
    start_cpu_world(configs[0])
    for config, drafter, out_path in zip(configs, drafters, pairs[1::2], strict=True):
        Path(out_path).write_text(json.dumps(load_report(config, drafter)))


if __name__ == "__main__":
    main()
