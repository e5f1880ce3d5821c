"""vLLM 0.28.0's DFlash2 drafter on the CPU over one query block, with hooks on its linears; writes safetensors.

    python tests/helpers/dflash2_vllm_forward.py TARGET_DIR DRAFTER_DIR INPUT.safetensors OUT.safetensors

INPUT holds `aux` [N, 5 H] (the target states the drafter's fc reads) and `ids` [S] (anchor + masks).
vLLM builds and loads the drafter as tests/helpers/scripted_dflash2_vllm.py does (its engine config,
DefaultModelLoader, the target's embedding and lm_head shared in, float32, the same CPU stand-ins for
the fused rms_norm / rotary ops and the attention kernel), then runs combine_hidden_states over aux,
precompute_and_store_context_kv at positions 0..N-1 and the forward over ids at positions N..N+S-1.
OUT: `hidden` [S, H] (the final-normed block) and `in/<vLLM module>` for every fc / qkv_proj / o_proj /
gate_up_proj / down_proj input, plus `in/context_kv`, the normed context rows the precompute's fused
K/V projection multiplies (what reaches every layer's k_proj / v_proj from the context).
"""

import sys
from pathlib import Path

from qwen_serving.engine import cpu_compat

cpu_compat.install()
import torch  # noqa: E402

cpu_compat.inspect_models_in_process()
from safetensors.torch import load_file, save_file  # noqa: E402
from vllm import _custom_ops  # noqa: E402
from vllm.config import set_current_vllm_config  # noqa: E402
from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.forward_context import set_forward_context  # noqa: E402

from tests.helpers.scripted_dflash2_vllm import load_drafter_on_cpu, rms_norm, rotary_embedding  # noqa: E402
from tests.helpers.vllm_cpu_models import start_cpu_world  # noqa: E402

HOOKED = ("fc", "qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def main() -> None:
    target, drafter, inputs, out_path = (Path(a) for a in sys.argv[1:5])
    given = load_file(str(inputs))
    aux, ids = given["aux"].float(), given["ids"].long()
    config = EngineArgs(model=str(target), language_model_only=True, max_model_len=512, enforce_eager=True,
                        speculative_config={"method": "dflash", "model": str(drafter),
                                            "num_speculative_tokens": len(ids) - 1}).create_engine_config()
    start_cpu_world(config)
    draft_config = config.speculative_config.draft_model_config
    seen: dict[str, torch.Tensor] = {}

    def recording_rms_norm(out, x, weight, eps):
        rms_norm(out, x, weight, eps)
        if weight is model.model._hidden_norm_weight:  # the precompute's norm of the context rows
            seen["in/context_kv"] = out.detach().clone()

    _custom_ops.rms_norm = recording_rms_norm
    _custom_ops.rotary_embedding = rotary_embedding
    with set_current_vllm_config(config):
        model = load_drafter_on_cpu(config, draft_config, target)
        for name, module in model.named_modules():
            if name.rsplit(".", 1)[-1] in HOOKED:
                module.register_forward_hook(
                    lambda mod, args, output, name=name: seen.__setitem__(f"in/{name}", args[0].detach().clone()))
        n = len(aux)
        with torch.no_grad(), set_forward_context(None, config):
            states = model.combine_hidden_states(aux)
            model.precompute_and_store_context_kv(states, torch.arange(n), torch.arange(n))
            hidden = model(input_ids=ids, positions=torch.arange(n, n + len(ids)))
    save_file({"hidden": hidden.float().contiguous(), **{k: v.float().contiguous() for k, v in seen.items()}},
              str(out_path))


if __name__ == "__main__":
    main()
