"""patches/vision-offload.patch in vLLM 0.28.0's own loader: a checkpoint with the vision tower loaded through
DefaultModelLoader.load_model (BaseModelLoader's, the patched one) with VLLM_VISION_OFFLOAD=0, then =1, and one
image's patches encoded by each model's `embed_multimodal`.

    python tests/helpers/vision_offload_load.py MODEL_DIR BUDGET_GIB

The engine config is VISION=1's (tests/helpers/vllm_cpu_models.py). process_weights_after_loading gets a CPU
stand-in, as in tests/helpers/vision_encode.py: the bf16 linears on F.linear (the CPU platform's packing needs
vllm._C), the int4 text layers left as loaded (nothing here runs them). The stand-in records the storage of each
tower weight when it ran; a weight whose storage differs by the end of load_model was moved to a host buffer
after process_weights_after_loading.
Prints RESULT {...}: per run the tower modules so moved, whether any moved weight is pinned; whether the two
encodings are bit-identical.
"""

import json
import os
import sys
from pathlib import Path

from qwen_serving.engine import cpu_compat

cpu_compat.install()
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

cpu_compat.inspect_models_in_process()
from vllm.config import set_current_vllm_config  # noqa: E402
from vllm.forward_context import set_forward_context  # noqa: E402
from vllm.model_executor.model_loader import base_loader  # noqa: E402
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader  # noqa: E402
from vllm.model_executor.models import qwen3_vl  # noqa: E402

from qwen_serving import knobs  # noqa: E402
from qwen_serving.engine import vision_offload  # noqa: E402
from tests.helpers.vllm_cpu_models import engine_config, start_cpu_world  # noqa: E402

GRID = [1, 8, 12]  # 96 patches


def storages(tower: torch.nn.Module) -> dict[str, int]:
    return {name: t.untyped_storage().data_ptr() for name, t in (*tower.named_parameters(), *tower.named_buffers())}


def main() -> None:
    path, budget_gib = Path(sys.argv[1]), sys.argv[2]
    def vision_config():  # one per load: a model's layers register their names in it
        return engine_config(path, num_speculative_tokens=1, max_model_len=4096,
                             vision_argv=list(knobs.BY_NAME["VISION"].argv(1, None, None)))

    start_cpu_world(vision_config())
    qwen3_vl.HAS_TRITON = False  # vLLM's torch path for the position-embedding interpolation
    seen: dict = {}

    def processed_on_cpu(model, model_config, target_device):
        for module in model.modules():
            if type(getattr(module, "quant_method", None)).__name__.startswith("Unquantized"):
                module.cpu_linear = F.linear
        seen["storages"] = storages(model.visual)

    base_loader.process_weights_after_loading = processed_on_cpu
    out, runs = {}, {}
    for run, flag in (("off", "0"), ("on", "1")):
        os.environ.update({"VLLM_VISION_OFFLOAD": flag, "VLLM_VISION_OFFLOAD_GIB": budget_gib})
        config = vision_config()
        with set_current_vllm_config(config):
            target = DefaultModelLoader(config.load_config).load_model(vllm_config=config,
                                                                       model_config=config.model_config)
        tower = target.visual
        after = storages(tower)
        moved = {name for name, ptr in after.items() if seen["storages"][name] != ptr}
        units = vision_offload.units(tower)
        runs[run] = {
            "moved": [name for name, _ in units if any(m.startswith(name + ".") for m in moved)],
            "pinned": any(t.is_pinned() for name, t in tower.named_parameters() if name in moved),
        }
        pixels = torch.randn(GRID[0] * GRID[1] * GRID[2], 3 * tower.temporal_patch_size * tower.patch_size ** 2,
                             generator=torch.Generator().manual_seed(0))
        with torch.inference_mode(), set_current_vllm_config(config), set_forward_context(None, config):
            (out[run],) = target.embed_multimodal(pixel_values=pixels, image_grid_thw=torch.tensor([GRID]))
    print("RESULT " + json.dumps({**runs, "bit_exact": bool(torch.equal(out["off"], out["on"])),
                                  "shape": list(out["on"].shape)}))


if __name__ == "__main__":
    main()
