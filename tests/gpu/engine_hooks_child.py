"""One offline MTP engine over the tiny checkpoint, for tests/gpu/test_engine_hooks_gpu.py (own process).

    python tests/gpu/engine_hooks_child.py MODEL_DIR OUT_JSON SPEC_DECODE_ATTN(0|1)

Greedy continuations of fixed token prompts with their raw logits (smoke_lib.GreedyTrace fields), and how
often the FlashAttention backend took the verify kernel. The engine core runs in this process
(VLLM_ENABLE_V1_MULTIPROCESSING=0) so the routing calls can be counted here.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from pathlib import Path

PROMPTS = 4
NEW_TOKENS = 48
TOP = 5


def main() -> int:
    model, out, spec_attn = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_SPEC_DECODE_ATTN"] = spec_attn

    from qwen_serving import attn_routing

    routed = {"verify": 0, "flash_attention": 0}
    decide = attn_routing.takes_verify_path

    def counting(*args, **kwargs):
        taken = decide(*args, **kwargs)
        routed["verify" if taken else "flash_attention"] += 1
        return taken

    attn_routing.takes_verify_path = counting

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.monotonic()
    llm = LLM(
        model=model,
        language_model_only=True,
        gdn_prefill_backend="triton",
        attention_backend="FLASH_ATTN",
        enforce_eager=True,
        max_model_len=2048,
        max_num_seqs=PROMPTS,
        kv_cache_memory_bytes=1 << 30,
        gpu_memory_utilization=0.1,  # two engines share the GPU
        speculative_config={"method": "mtp", "num_speculative_tokens": 4},
        logprobs_mode="raw_logits",
        seed=0,
    )
    start_s = time.monotonic() - t0
    rng = random.Random(0)
    prompts = [TokensPrompt(prompt_token_ids=[rng.randrange(10, 4000) for _ in range(rng.randrange(20, 300))])
               for _ in range(PROMPTS)]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=TOP)
    routed_before = dict(routed)  # start-up runs dummy batches; count the requests' steps only
    results = llm.generate(prompts, params)
    traces = []
    for result in results:
        completion = result.outputs[0]
        ids = list(completion.token_ids)
        tops = [{int(t): float(lp.logprob) for t, lp in entry.items()} for entry in completion.logprobs]
        traces.append({"token_ids": ids, "chosen": [top[t] for t, top in zip(ids, tops, strict=True)], "top": tops})
    record = {
        "spec_decode_attn": spec_attn,
        "start_s": round(start_s, 1),
        "routed": {k: routed[k] - routed_before[k] for k in routed},
        "traces": traces,
    }
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    tmp.rename(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
