"""vLLM 0.28.0's own Qwen3.5 vision tower, built and loaded on the CPU from a checkpoint, encodes one image.

    python tests/helpers/vision_encode.py MODEL_DIR HEIGHTxWIDTH...

The engine config is the one VISION=1 serves with: the VISION knob's flags (--limit-mm-per-prompt,
--mm-processor-kwargs max_pixels) parsed by vLLM's own parser, so the tower is built, not skipped. The
checkpoint's preprocessor_config.json turns each random HEIGHT x WIDTH RGB image into patches through
transformers' Qwen3-VL processor, with the knob's max_pixels. vLLM's `embed_multimodal` then runs the
tower's module code: Conv3d patch embed, interpolated position embeddings, blocks (LayerNorm, fused qkv,
2D RoPE, encoder attention on the CPU platform's torch SDPA backend, GELU MLP), 2 x 2 merger. One piece
Two pieces are replaced: the bf16 linears' GEMM (`cpu_linear`, which the CPU platform sets in
process_weights_after_loading, not run here) is F.linear; the Triton position-embedding interpolation
(NaN under TRITON_INTERPRET here) gives way to vLLM's own torch path, the one it takes without Triton.
Prints RESULT {...}: per image the encoder output's shape, finiteness and patch grid; the tensors loaded.
"""

import json
import sys
from pathlib import Path

from qwen_serving.engine import cpu_compat

cpu_compat.install()
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

cpu_compat.inspect_models_in_process()
from transformers import AutoProcessor  # noqa: E402
from vllm.config import set_current_vllm_config  # noqa: E402
from vllm.forward_context import set_forward_context  # noqa: E402
from vllm.model_executor.models import qwen3_vl  # noqa: E402

from qwen_serving import knobs  # noqa: E402
from qwen_serving.checkpoint import synth  # noqa: E402
from tests.helpers.vllm_cpu_models import engine_config, load_models, start_cpu_world  # noqa: E402


def main() -> None:
    path = Path(sys.argv[1])
    vision_argv = list(knobs.BY_NAME["VISION"].argv(1, None, None))
    config = engine_config(path, num_speculative_tokens=1, max_model_len=4096, vision_argv=vision_argv)
    start_cpu_world(config)
    stored = dict(synth.iter_checkpoint(path))
    loaded, target = load_models(config, stored.items)["Qwen3_5ForConditionalGeneration"]
    processor_kwargs = config.model_config.multimodal_config.mm_processor_kwargs
    processor = AutoProcessor.from_pretrained(str(path), **processor_kwargs)
    rng = np.random.default_rng(0)
    images = []
    qwen3_vl.HAS_TRITON = False  # the position-embedding interpolation: vLLM's torch path, not the Triton kernel
    with set_current_vllm_config(config):
        for module in target.visual.modules():
            if type(getattr(module, "quant_method", None)).__name__.startswith("Unquantized"):
                module.cpu_linear = F.linear
        for size in sys.argv[2:]:
            height, width = (int(x) for x in size.split("x"))
            image = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
            inputs = processor.image_processor(images=[image], return_tensors="pt", **processor_kwargs)
            with torch.no_grad(), set_forward_context(None, config):
                (embeds,) = target.embed_multimodal(pixel_values=inputs["pixel_values"],
                                                    image_grid_thw=inputs["image_grid_thw"])
            images.append({"shape": list(embeds.shape), "dtype": str(embeds.dtype),
                           "finite": bool(torch.isfinite(embeds).all()), "std": float(embeds.float().std()),
                           "grid_thw": inputs["image_grid_thw"].tolist()[0], "patches": list(inputs["pixel_values"].shape)})
    visual_loaded = [n for n in stored if n.startswith(synth.VISUAL)]
    print("RESULT " + json.dumps({
        "images": images, "tower_tensors": len(visual_loaded), "loaded": loaded, "tower": type(target.visual).__name__,
        "limit_mm_per_prompt": {k: getattr(v, "count", v) for k, v in
                                config.model_config.multimodal_config.limit_per_prompt.items()},
        "max_pixels": processor_kwargs.get("max_pixels"),
    }))


if __name__ == "__main__":
    main()
