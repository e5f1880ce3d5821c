"""The prepared tiny checkpoint in the patched engine (H200): int8 embed_tokens / lm_head / MTP.

Self-contained: synthesises the tiny checkpoint, prepares a copy with prepare/quant_lm_head.py,
quant_embed.py, quant_mtp.py and build_draft_vocab.py, then starts two offline engines at once
(this file run as a child script): the unprepared checkpoint without speculation, and the prepared
one with MTP speculation (so the int8 MTP module and its int8 draft head must load and run too). Each child reports which quantization method
vLLM built for lm_head and embed_tokens, and greedy continuations with raw logits; the prepared
engine's greedy output must match the unprepared one's except at measured near-ties (smoke_lib's
comparison, with the tie tolerance taken from the measured int8 noise, see below). Writes one
file, prepared-gpu.json, into $QS_GPU_RESULTS (engine logs: their tails in it, or in the failure).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
import smoke_lib as lib  # noqa: E402

from bench import serving  # noqa: E402

PROMPTS, PROMPT_LEN, NEW_TOKENS = 8, 24, 24
ENGINE_TIMEOUT_S = 900  # a first start of a config is ~200 s (Triton JIT of the GDN kernels)
STEPS = ("quant_lm_head", "quant_embed", "quant_mtp")
MAX_LOGIT_NOISE = 0.5  # expected ~0.08 (max over the compared positions); garbage is several units


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(0, 3800) for _ in range(PROMPT_LEN)] for _ in range(PROMPTS)]


def _run(argv: list[str], env: dict, timeout: float) -> None:
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    if done.returncode != 0:
        raise AssertionError(f"{' '.join(argv[1:3])} failed (rc {done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")


@pytest.mark.gpu
def test_prepared_checkpoint_uses_int8_and_matches_greedy(tmp_path):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (tests/gpu/README.md)")
    results = Path(os.environ.get("QS_GPU_RESULTS", tmp_path))
    results.mkdir(parents=True, exist_ok=True)
    env = lib.child_env(os.environ)

    base = tmp_path / "tiny"
    _run([sys.executable, "-m", "qwen_serving.checkpoint.synth", "--size", "tiny", "--out", str(base), "--seed", "0"], env, 600)
    prepared = tmp_path / "tiny-prepared"
    shutil.copytree(base, prepared)
    for step in STEPS:
        _run([sys.executable, str(REPO / "prepare" / f"{step}.py"), str(prepared)], env, 300)
    ids = tmp_path / "draft_ids.json"
    ids.write_text(json.dumps(list(range(0, 4096, 2))))  # half the tiny vocabulary (+ the stop ids)
    _run([sys.executable, str(REPO / "prepare" / "build_draft_vocab.py"), str(prepared), "--ids", str(ids)], env, 300)
    _run([sys.executable, "-m", "qwen_serving.checkpoint.prepare_status", str(prepared), "--strict"], env, 120)

    children = {
        name: ([sys.executable, str(Path(__file__)), str(model), str(tmp_path / f"{name}.json"),
                "1" if speculate else "0"], tmp_path / f"{name}.json", tmp_path / f"{name}.log")
        for name, model, speculate in (("base", base, False), ("prepared", prepared, True))}
    runs = lib.run_json_children(children, env, ENGINE_TIMEOUT_S)
    for name, run in runs.items():
        assert run.rc == 0 and run.record, f"{name} engine failed (rc {run.rc}):\n{run.log[-4000:]}"
    reports = {name: run.record for name, run in runs.items()}

    modules = reports["prepared"]["modules"]
    assert modules["lm_head_scheme"] == "CompressedTensorsWNA16" and modules["lm_head_bits"] == 8, modules
    assert modules["embed_method"] == "CompressedTensorsEmbeddingWNA16Int" and modules["embed_bits"] == 8, modules
    assert reports["base"]["modules"]["embed_method"] != "CompressedTensorsEmbeddingWNA16Int"

    traces = {
        name: [lib.GreedyTrace.from_record(t) for t in r["traces"]]
        for name, r in reports.items()
    }
    comparison = lib.compare_greedy(traces["base"], traces["prepared"])
    # smoke_lib's rule caps a tie at 0.1 logits, sized for bf16 noise between two runs of one
    # checkpoint. int8 moves every logit by ~0.02-0.03 (measured on CPU for this checkpoint's
    # lm_head and embedding), so here the tolerance is the measured noise alone, and the noise
    # itself must stay at quantization size: a wrong scale or packing moves logits by whole units.
    def tolerance(d: lib.Divergence) -> float:
        return max(lib.NOISE_FACTOR * comparison.noise, lib.ULP_FACTOR * lib.bf16_ulp(d.top_logit_b))

    unexplained = [
        d for d in comparison.divergences if d.gap_a is None or d.gap_b is None or max(d.gap_a, d.gap_b) > tolerance(d)
    ]
    summary = {**comparison.summary(), "rule_here": "both gaps <= max(2*noise, 2*bf16_ulp(top logit)), no 0.1 cap",
               "max_logit_noise": MAX_LOGIT_NOISE, "unexplained_here": [d.__dict__ for d in unexplained]}
    serving.write_json_atomic(results / "prepared-gpu.json", {
        "modules": {name: r["modules"] for name, r in reports.items()},
        "comparison": summary,
        "prompts": PROMPTS,
        "new_tokens": NEW_TOKENS,
        "engine_log_tails": {name: (tmp_path / f"{name}.log").read_text()[-3000:] for name in reports},
    })
    assert comparison.noise <= MAX_LOGIT_NOISE, summary
    assert comparison.compared_positions >= 4 * PROMPTS, summary
    assert not unexplained, summary


# ---------------------------------------------------------------- child: one offline engine


def describe(model) -> dict:
    """Which quantization method vLLM built for the lm_head and the embedding (runs in the worker)."""
    lm = getattr(model, "language_model", model)
    head, embed = lm.lm_head, lm.model.embed_tokens
    scheme = getattr(head, "scheme", None)
    return {
        "lm_head_method": type(head.quant_method).__name__,
        "lm_head_scheme": type(scheme).__name__ if scheme is not None else None,
        "lm_head_bits": getattr(scheme, "num_bits", None),
        "lm_head_kernel": type(getattr(scheme, "kernel", None)).__name__,
        "embed_method": type(embed.quant_method).__name__,
        "embed_bits": getattr(embed.quant_method, "num_bits", None),
    }


def child(model: str, out: str, speculate: bool) -> None:
    os.environ.update({"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
                       "VLLM_DISABLED_KERNELS": "MacheteLinearKernel"})  # Marlin, the kernel an RTX 3090 runs
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=model, language_model_only=True, gdn_prefill_backend="triton", enforce_eager=True,
        max_model_len=512, max_num_seqs=PROMPTS, gpu_memory_utilization=0.1, kv_cache_memory_bytes=1 << 30,
        logprobs_mode="raw_logits", seed=0,
        speculative_config={"method": "mtp", "num_speculative_tokens": 2} if speculate else None,
    )
    modules = llm.apply_model(describe)[0]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, logprobs=lib.TIE_TOP_K, ignore_eos=True)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in _prompts()], params)
    traces = []
    for output in outputs:
        completion = output.outputs[0]
        ids = list(completion.token_ids)
        steps = completion.logprobs
        traces.append({
            "token_ids": ids,
            "chosen": [steps[i][t].logprob for i, t in enumerate(ids)],
            "top": [[[int(k), v.logprob] for k, v in step.items()] for step in steps],  # JSON keys would be str
        })
    serving.write_json_atomic(Path(out), {"modules": modules, "traces": traces})


if __name__ == "__main__":
    child(sys.argv[1], sys.argv[2], sys.argv[3] == "1")
