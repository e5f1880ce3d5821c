"""One offline engine over a synthetic checkpoint, for tests/gpu/test_engine_gpu.py (runs in its own process).

    python tests/gpu/engine_w4a8_child.py MODEL_DIR OUT_JSON {w4a16,w4a8,w4a8-nofold} [INCLUDE_RE]

Writes the prompt logprobs of a fixed text, its perplexity and a greedy continuation. ``w4a8-nofold``
disables the sign fold of patches/marlin-int8-negative-scales.patch (everything else stays vLLM's),
which needs the engine core in this process: VLLM_ENABLE_V1_MULTIPROCESSING=0.
"""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path

from bench import serving  # the repo is on PYTHONPATH (smoke_lib.child_env)

TEXT = (
    "The lighthouse keeper wrote in the log every evening: the wind from the north-west, the sea "
    "moderate, two ships passing towards the harbour before dusk. In the morning he climbed the "
    "stairs again, cleaned the lens, trimmed the wick and counted the gulls on the rocks below."
)
GREEDY_TOKENS = 16


def main() -> int:
    model, out, mode = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_DISABLED_KERNELS"] = "MacheteLinearKernel"  # the kernel an RTX 3090 runs
    if mode.startswith("w4a8"):
        os.environ["VLLM_MARLIN_INPUT_DTYPE"] = "int8"
        os.environ["VLLM_MARLIN_INT8_INCLUDE_RE"] = sys.argv[4] if len(sys.argv) > 4 else "mlp"
    if mode == "w4a8-nofold":
        import qwen_serving.engine.marlin_int8 as marlin_int8

        marlin_int8.fold_layer_scales = lambda *args, **kwargs: None

    from vllm import LLM, SamplingParams

    t0 = time.monotonic()
    llm = LLM(
        model=model,
        language_model_only=True,
        gdn_prefill_backend="triton",
        enforce_eager=True,
        max_model_len=1024,
        max_num_seqs=2,
        kv_cache_memory_bytes=2 << 30,
        gpu_memory_utilization=0.1,  # four engines share the GPU: the start-up free-memory check is 0.1 x total
        enable_prefix_caching=False,
        seed=0,
    )
    start_s = time.monotonic() - t0
    params = SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS, prompt_logprobs=0)
    result = llm.generate([TEXT], params)[0]
    ids = list(result.prompt_token_ids)
    logprobs = [result.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))]
    record = {
        "mode": mode,
        "include_re": os.environ.get("VLLM_MARLIN_INT8_INCLUDE_RE"),
        "start_s": round(start_s, 1),
        "prompt_tokens": len(ids),
        "prompt_logprobs": logprobs,
        "perplexity": math.exp(-sum(logprobs) / len(logprobs)),
        "greedy": list(result.outputs[0].token_ids),
    }
    serving.write_json_atomic(out, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
