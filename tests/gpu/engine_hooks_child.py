"""One offline MTP engine over the tiny checkpoint, for tests/gpu/test_engine_hooks_gpu.py (own process).

    python tests/gpu/engine_hooks_child.py MODEL_DIR OUT_JSON HOOKS(0|1)

HOOKS=1 sets VLLM_SPEC_DECODE_ATTN=1 and VLLM_PREFILL_INT8_ATTN=1, 0 sets both to 0. Two greedy runs with their
raw logits (smoke_lib.GreedyTrace fields): one long prompt alone (its chunks are single-request prefills, after
0, 512 and 1024 tokens of context), then a batch of short prompts decoded together (uniform verify batches).
Also how often the FlashAttention backend took each kernel. The engine core runs in this process
(VLLM_ENABLE_V1_MULTIPROCESSING=0) so the routing decisions can be counted here.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from pathlib import Path

BATCH = 4
NEW_TOKENS = 48
TOP = 20  # as smoke_lib.TIE_TOP_K: near-tied tokens of a random model are often outside a top-5


def main() -> int:
    model, out, hooks = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_SPEC_DECODE_ATTN"] = os.environ["VLLM_PREFILL_INT8_ATTN"] = hooks

    from qwen_serving import attn_routing

    routed = {"verify": 0, "prefill": 0}
    for kind in routed:
        decide = getattr(attn_routing, f"takes_{kind}_path")

        def counting(*args, _decide=decide, _kind=kind, **kwargs):
            taken = _decide(*args, **kwargs)
            routed[_kind] += taken
            return taken

        setattr(attn_routing, f"takes_{kind}_path", counting)

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
        max_num_seqs=BATCH,
        max_num_batched_tokens=512,  # the long prompt prefills in chunks
        kv_cache_memory_bytes=1 << 30,
        gpu_memory_utilization=0.1,  # two engines share the GPU
        speculative_config={"method": "mtp", "num_speculative_tokens": 4},
        logprobs_mode="raw_logits",
        seed=0,
    )
    start_s = time.monotonic() - t0
    rng = random.Random(0)

    def prompt(length: int) -> TokensPrompt:
        return TokensPrompt(prompt_token_ids=[rng.randrange(10, 4000) for _ in range(length)])

    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=TOP)
    record = {"hooks": hooks, "start_s": round(start_s, 1), "routed": {}, "traces": {}}
    runs = {"single": [prompt(1500)], "batch": [prompt(rng.randrange(20, 300)) for _ in range(BATCH)]}
    for name, prompts in runs.items():
        before = dict(routed)  # start-up runs dummy batches: count each run's own steps
        traces = []
        for result in llm.generate(prompts, params):
            completion = result.outputs[0]
            ids = list(completion.token_ids)
            tops = [{int(t): float(lp.logprob) for t, lp in entry.items()} for entry in completion.logprobs]
            traces.append({"token_ids": ids, "chosen": [top[t] for t, top in zip(ids, tops, strict=True)],
                           "top": tops})
        record["traces"][name] = traces
        record["routed"][name] = {k: routed[k] - before[k] for k in routed}
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    tmp.rename(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
