"""One offline engine over the tiny checkpoint, for tests/gpu/test_engine_hooks_gpu.py (own process).

    python tests/gpu/engine_hooks_child.py MODEL_DIR OUT_JSON HOOKS(0|1) [SPEC(mtp|none)]

HOOKS=1 sets VLLM_SPEC_DECODE_ATTN=1 and VLLM_PREFILL_INT8_ATTN=1, 0 sets both to 0. SPEC=mtp (default) runs MTP
k=4, none runs without speculation (the control for the MTP engine itself). Two greedy runs with their raw logits
(smoke_lib.GreedyTrace fields): one long prompt alone (its block-aligned prefill chunks are single-request
prefills), then a batch of short prompts decoded together (uniform verify batches).

Per run, how often the FlashAttention backend took each kernel, and a shadow check of every paged attention call
(our kernels and flash_attn_varlen_func alike): its output rows against fp32 causal attention over the same paged
cache, computed right after the call from the device metadata (seq_lens, query_start_loc, block_table). The worst
call of each kind is kept with its metadata, so a kernel that is wrong for one request at one step shows up here
even when the tiny model hides it in the tokens. The engine core runs in this process
(VLLM_ENABLE_V1_MULTIPROCESSING=0) so the calls can be wrapped and counted here.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from pathlib import Path

from bench import serving  # the repo is on PYTHONPATH (smoke_lib.child_env)

BATCH = 4
NEW_TOKENS = 48
TOP = 20  # as smoke_lib.TIE_TOP_K: near-tied tokens of a random model are often outside a top-5
BAD_RELATIVE_ERROR = 0.1  # max |error| / max |exact| of one call: bf16 noise is ~1e-2, a wrong row ~1


class ShadowCheck:
    """Worst error of each kind of attention call against exact attention, with the metadata of that call."""

    def __init__(self) -> None:
        self.stats: dict[str, dict] = {}

    def check(self, kind, query, key_cache, value_cache, block_table, seq_lens, query_start_loc, scale, output,
              host: dict) -> None:
        from qwen_serving.engine.kernels.spec_attn import spec_attention_reference

        tokens = int(query_start_loc[-1])
        want = spec_attention_reference(query[:tokens], key_cache, value_cache, block_table, seq_lens,
                                        query_start_loc, scale)
        error = (output[:tokens].float() - want).abs().flatten(1).amax(dim=1)  # per query token
        worst_abs = error.max().item() if tokens else 0.0
        relative = worst_abs / max(want.abs().max().item() if tokens else 0.0, 1e-6)
        entry = self.stats.setdefault(kind, {"calls": 0, "bad_calls": 0, "worst_relative": 0.0})
        entry["calls"] += 1
        entry["bad_calls"] += relative > BAD_RELATIVE_ERROR
        if relative >= entry["worst_relative"]:
            qsl = [int(x) for x in query_start_loc]
            per_request = [round(error[a:b].max().item(), 5) if b > a else None
                           for a, b in zip(qsl[:-1], qsl[1:], strict=True)]
            entry.update(worst_relative=relative, worst_abs=worst_abs, worst_call={
                **host, "query_start_loc": qsl, "seq_lens": [int(x) for x in seq_lens[: len(qsl) - 1]],
                "max_abs_error_per_request": per_request, "call_index": entry["calls"] - 1})

    def snapshot(self) -> dict:
        return json.loads(json.dumps(self.stats))


def install_shadow(shadow: ShadowCheck | None, routed: dict) -> None:
    """Wrap the routing decisions (counted), our two kernels and flash_attn_varlen_func (checked; not with
    shadow None: under CUDA graphs the wrappers run only while a graph is captured, where the check's host
    reads are not allowed)."""
    import torch
    from vllm.v1.attention.backends import flash_attn as fa

    from qwen_serving.engine import attn_routing

    for kind in routed:
        decide = getattr(attn_routing, f"takes_{kind}_path")

        def counting(*args, _decide=decide, _kind=kind, **kwargs):
            taken = _decide(*args, **kwargs)
            routed[_kind] += taken
            return taken

        setattr(attn_routing, f"takes_{kind}_path", counting)
    if shadow is None:
        return

    def host(md) -> dict:
        return {"num_actual_tokens": md.num_actual_tokens, "max_query_len": md.max_query_len,
                "max_seq_len": md.max_seq_len}

    run_verify, run_prefill = attn_routing.run_verify, attn_routing.run_prefill

    def verify(spec_attn, query, key_cache, value_cache, md, output, scale):
        result = run_verify(spec_attn, query, key_cache, value_cache, md, output, scale)
        if key_cache.dtype in (torch.bfloat16, torch.float16):
            shadow.check("verify_kernel", query, key_cache, value_cache, md.block_table, md.seq_lens,
                         md.query_start_loc, scale, output, host(md))
        return result

    def prefill(query, key_cache, value_cache, md, output, scale):
        result = run_prefill(query, key_cache, value_cache, md, output, scale)
        shadow.check("prefill_int8_kernel", query, key_cache, value_cache, md.block_table, md.seq_lens,
                     md.query_start_loc, scale, output, host(md))
        return result

    attn_routing.run_verify, attn_routing.run_prefill = verify, prefill
    varlen = fa.flash_attn_varlen_func

    def flash(*args, **kw):
        result = varlen(*args, **kw)
        plain = (not args and kw.get("block_table") is not None and kw.get("causal") is True
                 and kw.get("window_size") in (None, [-1, -1], (-1, -1)) and not kw.get("softcap")
                 and kw.get("s_aux") is None and kw.get("mask_mod") is None and kw.get("alibi_slopes") is None
                 and kw["k"].dtype in (torch.bfloat16, torch.float16))
        if plain:
            q_len = kw["max_seqlen_q"]
            kind = "flash_attn_decode" if q_len == 1 else "flash_attn_verify" if q_len <= 16 else "flash_attn_prefill"
            shadow.check(kind, kw["q"], kw["k"], kw["v"], kw["block_table"], kw["seqused_k"], kw["cu_seqlens_q"],
                         kw["softmax_scale"], kw["out"], {"max_query_len": q_len, "max_seq_len": kw["max_seqlen_k"]})
        return result

    fa.flash_attn_varlen_func = flash


def main() -> int:
    model, out, hooks = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    spec = sys.argv[4] if len(sys.argv) > 4 else "mtp"
    graphs = (sys.argv[5] if len(sys.argv) > 5 else "eager") == "graphs"  # torch.compile + CUDA graphs, as served
    if hooks not in ("0", "1") or spec not in ("mtp", "none") or sys.argv[5:6] not in ([], ["eager"], ["graphs"]):
        raise SystemExit(f"usage: {sys.argv[0]} MODEL_DIR OUT_JSON HOOKS(0|1) [SPEC(mtp|none)] [eager|graphs]")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_SPEC_DECODE_ATTN"] = os.environ["VLLM_PREFILL_INT8_ATTN"] = hooks

    routed = {"verify": 0, "prefill": 0}
    shadow = None if graphs else ShadowCheck()
    install_shadow(shadow, routed)

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.monotonic()
    llm = LLM(
        model=model,
        language_model_only=True,
        gdn_prefill_backend="triton",
        attention_backend="FLASH_ATTN",
        attention_config={"flash_attn_version": 2},  # a 3090's FlashAttention: on FA3 (sm90) the hooks stand aside
        enforce_eager=not graphs,
        max_model_len=2048,
        max_num_seqs=BATCH,
        max_num_batched_tokens=512,  # the long prompt prefills in chunks
        kv_cache_memory_bytes=1 << 30,
        gpu_memory_utilization=0.1,  # the engines share the GPU
        speculative_config={"method": "mtp", "num_speculative_tokens": 4} if spec == "mtp" else None,
        logprobs_mode="raw_logits",
        seed=0,
    )
    start_s = time.monotonic() - t0
    rng = random.Random(0)

    def prompt(length: int) -> TokensPrompt:
        return TokensPrompt(prompt_token_ids=[rng.randrange(10, 4000) for _ in range(length)])

    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=TOP)
    record = {"hooks": hooks, "spec": spec, "graphs": graphs, "start_s": round(start_s, 1),
              "routed_at_start": dict(routed), "routed": {}, "shadow": {}, "traces": {}}
    runs = {"single": [prompt(1500)], "batch": [prompt(rng.randrange(20, 300)) for _ in range(BATCH)]}
    for name, prompts in runs.items():
        before = dict(routed)  # start-up runs dummy batches: count and check each run's own steps
        if shadow:
            shadow.stats.clear()
        traces = []
        for result in llm.generate(prompts, params):
            completion = result.outputs[0]
            ids = list(completion.token_ids)
            tops = [{int(t): float(lp.logprob) for t, lp in entry.items()} for entry in completion.logprobs]
            traces.append({"token_ids": ids, "chosen": [top[t] for t, top in zip(ids, tops, strict=True)],
                           "top": tops})
        record["traces"][name] = traces
        record["routed"][name] = {k: routed[k] - before[k] for k in routed}
        record["shadow"][name] = shadow.snapshot() if shadow else None
        record["prompt_lens"] = {**record.get("prompt_lens", {}), name: [len(p["prompt_token_ids"]) for p in prompts]}
    serving.write_json_atomic(out, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
