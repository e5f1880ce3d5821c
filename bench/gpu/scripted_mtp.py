"""Speculative decoding on accepted drafts, measured on the scripted `full` checkpoint (issues #16 items 5 and 6,
#17; one GPU run; bench/gpu/README.md). The first wave (bench.fullbench.SCRIPTED_CONFIGS: stock vLLM 0.28.0
without speculation and with MTP k=4, the single-user plan without and with it) boots together while the
reference checks the written weights at full size; then the servers are measured one after the other against
what the weights predict, then the variant (SCRIPTED_VARIANTS), the k sweep (SCRIPTED_SWEEP) and the plan on the
high-agreement copy (SCRIPTED_HIGH_AGREE) boot, in waves packed by a memory estimate, each k's pair together
(SWEEP_ORDER), as far as the budget goes.
Stock serves the checkpoint as synth writes it (bf16 MTP and lm_head); the patched servers serve a prepared copy
(hard links, then prepare/'s steps: int8 lm_head, embedding and MTP, the draft head from the design's
--draft-coverage id list), as a user's single-user plan would, each judged by the prediction from its own files:

- reference: the float32 forward of the full checkpoint follows the designed chain along a prompt (the wobble and
  the smallest top-1/top-2 gap recorded), before any server's answer is judged by it;
- greedy: 8 prompts x 512 tokens, token-identical to no speculation (or measured near-ties), equal to the designed
  chain, top-20 raw logits within bf16 noise, and vLLM's per-position acceptance equal to the exact greedy walk;
- default sampling (the checkpoint's generation_config): per-position acceptance from vLLM's /metrics against
  the Markov prediction (greedy drafts for stock, vLLM's probabilistic drafts for the patched plan), within 3 points;
- chi-square (bench.scripted_chisq.rank_test): >= 1e5 tokens sampled at temperature 1, top-k 20, top-p 0.95 as
  512-token answers, MTP on and off, against the exact distribution before every sampled token (the reference over
  the sampled sequences, once the wave's servers are down; tests/test_scripted_chisq.py shows a broken rejection
  rule failing the same test);
- prefix caching: a 3,000-token prompt answered cold and from the cache, the same tokens and raw logits;
- C1: decode tok/s, tokens per step and ms per step, from streamed answers and the server's own counters; and a
  profiled C1 window (torch profiler trace, gzipped under OUT/profiles/) for the step breakdown of issue #17.

    python bench/gpu/scripted_mtp.py OUT --site SITE --patched-site PATCHED [--ckpt DIR] [--prepared-ckpt DIR]
    python bench/gpu/scripted_mtp.py OUT --only checkpoint|prepare   # the checkpoint (and its prepared copy) alone
    python bench/gpu/scripted_mtp.py --predict FILE --ckpt DIR [--device cuda]   # the prediction alone (torch)
    python bench/gpu/scripted_mtp.py OUT ... --from-run bench/results/scripted-h200-mtp-run3.json   # the rest of the run
    python bench/gpu/scripted_mtp.py OUT --rejudge   # the checks again from a run's files (CPU)
    python bench/gpu/scripted_mtp.py --plot-only REPORT   # the sweep's PNG beside REPORT, its table on stdout

OUT/scripted-h200-mtp.json is rewritten after every phase; each phase has its own time limit and the whole run
its budget (--budget-s), after which what is left is skipped and recorded as such.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "gpu"), str(Path(__file__).resolve().parent)]

import run_full  # noqa: E402
import smoke_lib  # noqa: E402

from bench import fullbench as fb  # noqa: E402
from bench import report as br  # noqa: E402
from bench import scripted_chisq as sc  # noqa: E402
from bench import serving  # noqa: E402
from qwen_serving import patchset, plan  # noqa: E402

REPORT = "scripted-h200-mtp.json"
SCHEMA = "qwen-serving scripted-mtp/1"
# --mtp-agree of the generated checkpoint: q = 0.76 puts the full checkpoint's Markov prediction (greedy drafts, T 0.6,
# top-k 20, top-p 0.95, k = 4) at 0.740 / 0.510 / 0.360 / 0.252 per position, 2.86 tokens per step, against the spec's
# measured 74 / 50 / 34 / 24 % and 2.8-2.9 (computed from the design's logit table on the CPU; the run records the
# prediction from the written weights). a_i falls like (q p_chain)^i with p_chain = 0.924 at that sampling.
DEFAULT_AGREE = 0.76
# --draft-coverage: the share of the active vocabulary the draft head keeps (the spec's calibrated list covers
# 97.5% of the real model's outputs); every chain successor outside it is a forced rejection of a greedy draft
DEFAULT_COVERAGE = 0.975
CHECKPOINT_SEED = 0
# prepare/'s steps on the patched servers' copy, in prepare/README.md's order (the draft head last: its rows come
# from the int8 lm_head)
PREPARE_STEPS = ("quant_lm_head", "quant_embed", "quant_mtp")
K = 4
K_SWEEP = range(1, 8)
ACCEPTANCE_WITHIN = 0.03  # the bar: per position, measured vs predicted
GREEDY_PROMPTS = 8  # half quoting, half free
MAX_TOKENS = 512
TOP_LOGPROBS = smoke_lib.TIE_TOP_K
SAMPLED_REQUESTS, SAMPLED_CONCURRENCY = 16, 8  # ~2,700 verify steps at k=4: per-position acceptance +- 1 point
C1_REQUESTS = 3
SEEDS = {"greedy": 0, "sampled": 1000, "c1": 2000, "chisq": 3000, "prefix": 4000}  # no prompt sent twice
TPOT = "vllm:request_time_per_output_token_seconds"
# the greedy answers each speculating server is compared with: its own stack's, on the same files, without speculation
BASELINES = {"stock": "scripted-stock", "patched": "scripted-patched-plain"}
PREDICTIONS = {"stock": "prediction", "patched": "prediction_prepared"}  # the report's key for each stack's files
# the high-agreement copy (fb.SCRIPTED_HIGH_AGREE): the same target, an MTP that proposes the chain successor after
# 90% of the active tokens (scripted.redial_mtp), so greedy identity is shown where most drafts are accepted (at
# DEFAULT_AGREE the plan accepted 54% of its greedy drafts at k=4, visit 10, under the 60%); judged against
# the plan's answers without speculation on the same target, with no prediction of its own (the target's is
# scripted-patched-plain's; the MTP's alone would need a third reference run beside the servers)
HIGH_AGREE = fb.SCRIPTED_HIGH_MTP_AGREE
HIGH_ACCEPTANCE_FLOOR = 0.6
CHISQ_TOKENS = 100_000  # the floor, as 512-token answers (196 requests), the seats full
CHISQ_ANSWER, CHISQ_CONCURRENCY = 512, 16
CHISQ_PROMPT_LEN = 24
PREFIX_SEGMENTS, PREFIX_SEGMENT_LEN, PREFIX_ANSWER = 50, 60, 32  # a 3,008-token prompt, 32 greedy tokens
PROFILE_TOKENS = 48
# trace events kept (GPU work, step and phase annotations, launches): CPU ops and Python frames stay behind
PROFILE_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset", "user_annotation", "gpu_user_annotation",
                                "cuda_runtime", "cuda_driver"})
REFERENCE_CHECK_TOKENS = 64  # the float32 reference along the first greedy prompt and its chain
PREDICT_GRACE_S = 60  # after the first wave is up, how long measuring waits for the prediction
# what each server measures beyond greedy, sampled (speculating servers) and c1
# (stock's greedy-draft rule is the CPU test's; the GPU run samples MTP off and the product's probabilistic drafts)
EXTRA_PARTS = {"scripted-stock": ("chisq", "prefix", "profile"), "scripted-stock-mtp4": ("profile", "host"),
               "scripted-patched-plain": ("profile",), "scripted-patched-mtp4": ("chisq", "prefix", "profile", "host")}
HOST_PROFILE_S = 10  # py-spy on the engine core while C1 answers stream (bench/host_profile.py)
# the first wave's tools of issue #22, while all four servers are up: the quality battery's scripted check on
# stock, real_rep on the plan without speculation, prefill_ab between the two (bench/README.md)
QUALITY_TAG = "scripted-h200"
PREFILL_AB_LENS = "1024,3072"  # within SCRIPTED_MAX_LEN
SWEEP_SERVER_S = 60  # a sweep server's greedy, sampled and C1 parts
# the sweep's boot order, by k: a budget that ends a sweep early leaves whole stock-beside-ours pairs; k=3 first
# (the drafts of CTX=long and CTX=huge), then the large pools, so that the small ones share a wave with the
# high-agreement server; k=6 last (added after visit 11 had measured the rest)
SWEEP_ORDER = (3, 5, 7, 2, 1, 6)
# servers booted together: packed by memory (waves(), under run_full.BOUND_GIB); weights as visit 10's servers
# loaded them (boot_facts: synth's files 17.63 GiB, the prepared copy's 14.97)
WEIGHTS_GIB = {"stock": 17.63, "patched": 14.97}
# what --from-run takes from an earlier run by default: the first-wave servers whose code the sampler change after
# visit 9 left alone (the single-user plan's MTP server is booted again)
FROM_RUN_SERVERS = ("scripted-stock", "scripted-stock-mtp4", "scripted-patched-plain")
CHISQ_ROWS_S = 150  # the --chisq-rows child per server: ~1e5 tokens through the float32 reference (estimate)
# time limits (s); budget: the whole run, from start to the last server stopped
LIMITS = {"synth": 420, "prepare": 420, "predict": 600, "boot": 600, "greedy": 240, "sampled": 300, "c1": 240, "chisq": 240,
          "chisq_rows": 300,
          "prefix": 120, "profile": 120, "host": 60, "quality": 120, "real_rep": 150, "prefill_ab": 180, "stop": 60}
DEFAULT_BUDGET_S = 1380  # a 30-minute session less staging (~5 min), polling and packing


def log(msg: str) -> None:
    print(f"[scripted {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------------------------------------------------------- prediction (torch; the --predict child)


def draft_acceptance(target, draft, k: int, steps: int = 4000) -> list[float]:
    """Per-position acceptance of k chained drafts over a long generation of a Markov target, for any draft
    distribution: target[x] = the target's sampling distribution after x, draft[x] = the drafter's (a one-hot row
    for greedy drafts, the MTP's temperature-only softmax for vLLM's probabilistic drafts; rows may sum to < 1, the
    rest being drafts outside the states, always rejected). vLLM's rule: a draft d after x is kept with probability
    min(1, target[x, d] / draft[x, d]), so the chain moves x -> d with min(target, draft); a rejection emits from
    max(target - draft, 0) (unnormalised: its total is the rejection probability); a full chain adds a bonus token
    from target. The step starts' Cesaro average from a uniform start weights each start's profile (as
    scripted_reference.markov_acceptance does for greedy drafts)."""
    import torch

    target, draft = target.double(), draft.double()
    n = target.shape[0]
    move = torch.minimum(target, draft)
    rejected = (target - draft).clamp(min=0)
    power = torch.eye(n, dtype=torch.float64, device=target.device)
    start_next = torch.zeros_like(target)
    survive = []
    for _ in range(k):
        start_next += power @ rejected
        power = power @ move
        survive.append(power.sum(1))
    start_next += power @ target
    mu = torch.full((n,), 1.0 / n, dtype=torch.float64, device=target.device)
    average = torch.zeros_like(mu)
    for _ in range(steps):
        average += mu
        mu = mu @ start_next
        mu /= mu.sum()  # rows of float32 inputs sum to 1 +- 1e-7: over thousands of steps that would drift
    average /= steps
    return [float(average @ s) for s in survive]


def predict(ckpt: Path, device: str) -> dict:
    """Everything the measurements are judged by, from the checkpoint's tensors (scripted_reference)."""
    import torch

    from qwen_serving.checkpoint import scripted_reference as sr
    from qwen_serving.checkpoint.scripted import Design

    t0 = time.time()
    design = Design.read(ckpt)
    default = sr.Sampling(**default_sampling(ckpt))
    ref = sr.Reference(ckpt, device)
    inputs = {"greedy": sr.markov_inputs(ref, design.active, sr.GREEDY),
              "default": sr.markov_inputs(ref, design.active, default)}
    # vLLM's probabilistic drafts: softmax(draft logits / T), no top-k / top-p (llm_base_proposer.py)
    positions = torch.arange(len(design.active), device=ref.w.device)
    hidden = torch.zeros(len(design.active), ref.t["hidden_size"], device=ref.w.device)
    # over the draft head's rows when the checkpoint has one (the patch's -inf elsewhere): an active token outside
    # its list is never proposed
    logits, vocab = ref.draft_logits(ref.mtp_step(design.active, hidden, positions))
    probs = torch.softmax(logits.float() / default.temperature, -1)
    del logits
    columns = {int(t): i for i, t in enumerate(vocab.tolist())}
    draft_probs = torch.zeros(len(design.active), len(design.active), device=probs.device)
    inside = [(j, columns[t]) for j, t in enumerate(design.active) if t in columns]
    draft_probs[:, [j for j, _ in inside]] = probs[:, [c for _, c in inside]]
    del probs
    transition, propose = inputs["default"]
    profiles: dict[str, dict[str, list[float]]] = {"greedy": {}, "default_greedy_drafts": {},
                                                   "default_probabilistic_drafts": {}}
    for k in K_SWEEP:
        profiles["greedy"][str(k)] = sr.markov_acceptance(*inputs["greedy"], k)
        profiles["default_greedy_drafts"][str(k)] = sr.markov_acceptance(transition, propose, k)
        profiles["default_probabilistic_drafts"][str(k)] = draft_acceptance(transition, draft_probs, k)
    # positions 1..i of a k-draft run against the same positions with 7 drafts: does the profile depend on k?
    k_dependence = {name: max(abs(a - b) for k, prof in by_k.items() for a, b in zip(prof, by_k[str(max(K_SWEEP))], strict=False))
                    for name, by_k in profiles.items()}
    greedy_next = inputs["greedy"][0].argmax(-1).tolist()
    proposal = inputs["greedy"][1].tolist()
    check = reference_check(ref, design)
    return {
        "checkpoint": str(ckpt), "device": device, "mtp_agree": design.mtp_agree,
        "default_sampling": vars(default), "k": K,
        "acceptance_per_position": {name: by_k[str(K)] for name, by_k in profiles.items()},
        "tokens_per_step": {name: 1 + sum(by_k[str(K)]) for name, by_k in profiles.items()},
        "by_k": profiles, "k_dependence_max_abs": k_dependence,
        # the context-free greedy successor and MTP proposal of each active token (-1: outside the active set),
        # for the exact greedy walk of the measured prompts
        "greedy_successor": {str(t): design.active[j] for t, j in zip(design.active, greedy_next, strict=True)},
        "mtp_proposal": {str(t): (design.active[j] if j >= 0 else -1)
                         for t, j in zip(design.active, proposal, strict=True)},
        "reference_check": check,
        "seconds": round(time.time() - t0, 1),
    }


def chisq_prompts(design) -> list[list[int]]:
    """Chain walks from spaced points of the cycle: the chi-square answers' prompts."""
    count = -(-CHISQ_TOKENS // CHISQ_ANSWER)
    n = len(design.active)
    return [design.walk(design.active[(SEEDS["chisq"] + i * (n // count or 1)) % n], CHISQ_PROMPT_LEN - 1)
            for i in range(count)]


def chisq_rows(ckpt: Path, samples_path: Path, device: str) -> list[list[dict[int, float]]]:
    """The exact distribution before every sampled token of a chi-square run (the --chisq-rows child)."""
    from qwen_serving.checkpoint import scripted_reference as sr

    run = json.loads(samples_path.read_text())
    return sc.position_rows(sr.Reference(ckpt, device), run["prompts"], run["samples"])


def reference_check(ref, design) -> dict:
    """The float32 forward over the first greedy prompt and the first REFERENCE_CHECK_TOKENS of its chain: does its
    argmax follow the chain, by how much do the branches move the logits (the wobble against the context-free
    table), and the smallest top-1/top-2 gap; the top-20 logits per position, to set the engine's bf16 against."""
    import torch

    prompt = prompts_for(design, "greedy", 1)[0]["ids"]
    chain = design.walk(prompt[-1], REFERENCE_CHECK_TOKENS)[1:]
    ids = [*prompt, *chain[:-1]]
    logits = ref.logits(ids)[len(prompt) - 1:]
    free = ref.context_free_logits(ids[len(prompt) - 1:])
    active = torch.tensor(design.active, device=logits.device)
    wobble = (logits - free)[:, active]
    top = logits.topk(smoke_lib.TIE_TOP_K, dim=-1)
    argmax = logits.argmax(-1).tolist()
    return {"prompt": 0, "positions": len(chain), "argmax_is_chain": sum(a == c for a, c in zip(argmax, chain, strict=True)),
            "first_off_chain": next((i for i, (a, c) in enumerate(zip(argmax, chain, strict=True)) if a != c), None),
            "wobble_std": float(wobble.std()), "wobble_max": float(wobble.abs().max()),
            "min_top_gap": float((top.values[:, 0] - top.values[:, 1]).min()),
            "top": [{str(int(t)): float(v) for t, v in zip(ti, vi, strict=True)}
                    for ti, vi in zip(top.indices.tolist(), top.values.tolist(), strict=True)]}


# ---------------------------------------------------------------- expectations (standard library)


def greedy_walk_acceptance(firsts: Sequence[int], successor: Mapping[int, int], proposal: Mapping[int, int],
                           k: int, max_tokens: int) -> dict:
    """vLLM's counters over greedy answers that start (first token, from the prefill) at each of `firsts`: every
    verify step drafts k chained proposals d_j = proposal[d_(j-1)], keeps them while d_j is the target's successor
    of the last kept token, then emits one more token; steps go on while the answer is short of max_tokens."""
    drafts, accepted = 0, [0] * k
    for first in firsts:
        current, emitted = first, 1
        while emitted < max_tokens:
            drafts += 1
            kept, draft, last = 0, current, current
            for _ in range(k):
                draft = proposal.get(draft, -1)
                if draft != successor[last]:
                    break
                last, kept = draft, kept + 1
            for j in range(kept):
                accepted[j] += 1
            emitted += kept + 1
            current = successor[last]
    return {"drafts": drafts, "acceptance_per_position": [a / drafts for a in accepted] if drafts else []}


def acceptance_floor(per_position: Sequence[float], floor: float) -> dict:
    """vLLM's draft acceptance rate (accepted / drafted: every step drafts k, so the mean over positions) >= floor."""
    rate = sum(per_position) / len(per_position) if per_position else 0.0
    return {"passed": rate >= floor, "acceptance": rate, "per_position": list(per_position), "floor": floor}


def compare_acceptance(measured: Sequence[float], predicted: Sequence[float], within: float = ACCEPTANCE_WITHIN) -> dict:
    """Per position: measured - predicted; passed when every position is within `within` (and both have k)."""
    diff = [m - p for m, p in zip(measured, predicted, strict=False)]
    ok = len(measured) == len(predicted) > 0 and all(abs(d) <= within for d in diff)
    return {"passed": ok, "measured": list(measured), "predicted": list(predicted), "difference": diff,
            "within": within}


def logit_agreement(runs_a: Sequence[smoke_lib.GreedyTrace], runs_b: Sequence[smoke_lib.GreedyTrace]) -> dict:
    """Top-20 raw logits of B against A at every position both answered from the same context, token by token
    (tokens in both lists): passed when each differs by at most smoke_lib.CEILING_ULPS bf16 steps, a step being the
    spacing at the row's top logit or at the logit's own value, whichever is wider. Why the row's: every logit of a
    row is the dot product of one bf16 hidden state with an lm_head row, and a k+1-token verify step reduces its
    GEMMs in another order than a one-token decode step, so the hidden state moves by its rounding and every logit
    by an amount on the scale of the row's largest ones, not of its own (a logit of 0.4 beside a top of 2.0 moves
    by 2.0's steps); why its own: the logit itself leaves the lm_head rounded to bf16 (0.0625 apart at -11.8)."""
    worst, worst_ulps, compared, over = 0.0, 0.0, 0, []
    for prompt, (a, b) in enumerate(zip(runs_a, runs_b, strict=True)):
        split = smoke_lib.first_divergence(a.token_ids, b.token_ids)
        for position in range(len(a.token_ids) if split is None else split):
            row_ulp = smoke_lib.bf16_ulp(max(a.top[position].values()))
            for token, value in b.top[position].items():
                if token not in a.top[position]:
                    continue
                other = a.top[position][token]
                diff = abs(value - other)
                ulp = max(row_ulp, smoke_lib.bf16_ulp(max(abs(value), abs(other))))
                compared += 1
                worst = max(worst, diff)
                worst_ulps = max(worst_ulps, diff / ulp if ulp else 0.0)
                if diff > smoke_lib.CEILING_ULPS * ulp:
                    over.append({"prompt": prompt, "position": position, "token": token, "a": other, "b": value})
    return {"passed": compared > 0 and not over, "logits_compared": compared, "max_abs_diff": worst,
            "max_diff_bf16_ulps": worst_ulps, "tolerance_ulps": smoke_lib.CEILING_ULPS,
            "rule": "|a - b| <= 4 bf16 steps at max(the row's top logit, the logit's own value)", "over": over[:20],
            "over_count": len(over)}


def chain_check(traces: Sequence[smoke_lib.GreedyTrace], expected: Sequence[Sequence[int]]) -> dict:
    """Each greedy answer against the designed chain after its prompt."""
    wrong = []
    for prompt, (trace, want) in enumerate(zip(traces, expected, strict=True)):
        at = smoke_lib.first_divergence(trace.token_ids, list(want))
        if at is not None:
            wrong.append({"prompt": prompt, "position": at})
    return {"passed": not wrong, "prompts": len(expected), "off_chain": wrong}


# ---------------------------------------------------------------- measuring one server


def metrics(client: serving.Client) -> str:
    return client.get_text("/metrics", timeout_s=30)


def histogram_mean(before: str, after: str, name: str) -> float | None:
    """Mean of one histogram's observations between two /metrics pages (sum and count deltas)."""
    def totals(page: str) -> tuple[float, float]:
        samples = serving.parse_prometheus(page)
        return (sum(s.value for s in samples if s.name == f"{name}_sum"),
                sum(s.value for s in samples if s.name == f"{name}_count"))

    (s0, c0), (s1, c1) = totals(before), totals(after)
    return (s1 - s0) / (c1 - c0) if c1 > c0 else None


def spec_delta(before: str, after: str) -> dict:
    return br.spec_figures(br.metrics_delta(br.snapshot(before), br.snapshot(after)))


def _body(model: str, prompt, sampling: Mapping[str, float], **extra) -> dict:
    """A completions request; `sampling` may also set max_tokens (default MAX_TOKENS)."""
    return {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True, **sampling, **extra}


GREEDY = {"temperature": 0.0}


def measure_greedy(client: serving.Client, model: str, prompts: Sequence[list[int]]) -> dict:
    """One request with every prompt (the server batches them), raw top-20 logits per position."""
    before = metrics(client)
    t0 = time.monotonic()
    answer = client.post_json("/v1/completions", _body(model, list(prompts), GREEDY, logprobs=TOP_LOGPROBS,
                                                       return_tokens_as_token_ids=True, return_token_ids=True),
                              timeout_s=LIMITS["greedy"])
    seconds = time.monotonic() - t0
    choices = sorted(answer["choices"], key=lambda c: c["index"])
    traces = [smoke_lib.trace_from_choice(c) for c in choices]
    return {"seconds": round(seconds, 2), "spec": spec_delta(before, metrics(client)),
            "traces": [{"token_ids": t.token_ids, "chosen": t.chosen, "top": [list(e.items()) for e in t.top]}
                       for t in traces]}


def speculative_config(cmd: fb.ServerCommand) -> dict | None:
    """The --speculative-config the server is started with (None: no speculation)."""
    if "--speculative-config" not in cmd.argv:
        return None
    return json.loads(cmd.argv[cmd.argv.index("--speculative-config") + 1])


def draft_sample(cmd: fb.ServerCommand) -> str | None:
    """The server's draft_sample_method as vLLM is told it (None: no speculation)."""
    spec = speculative_config(cmd)
    return None if spec is None else spec.get("draft_sample_method", "greedy")  # vLLM 0.28.0's default


def measure_sampled(client: serving.Client, model: str, prompts: Sequence[list[int]],
                    sampling: Mapping[str, float]) -> dict:
    before = metrics(client)
    t0 = time.monotonic()
    deadline = t0 + LIMITS["sampled"]

    def one(prompt):
        left = max(1.0, deadline - time.monotonic())
        return client.post_json("/v1/completions", _body(model, prompt, sampling), timeout_s=left)["usage"]

    with ThreadPoolExecutor(max_workers=SAMPLED_CONCURRENCY) as pool:
        usage = list(pool.map(one, prompts))
    return {"seconds": round(time.monotonic() - t0, 2), "requests": len(usage), "concurrency": SAMPLED_CONCURRENCY,
            "completion_tokens": sum(u["completion_tokens"] for u in usage), "sampling": dict(sampling),
            "spec": spec_delta(before, metrics(client))}


def stream_once(client: serving.Client, model: str, prompt: list[int], sampling: Mapping[str, float]) -> dict:
    """One streamed answer: tokens per chunk (return_token_ids) and each chunk's arrival time."""
    start = time.monotonic()
    chunks: list[tuple[float, int]] = []
    body = _body(model, prompt, sampling, stream=True, return_token_ids=True)
    for _event, data in client.post_events("/v1/completions", body, timeout_s=LIMITS["c1"]):
        if data == serving.SSE_DONE:
            break
        for choice in data.get("choices") or []:
            if choice.get("token_ids"):
                chunks.append((time.monotonic(), len(choice["token_ids"])))
    if len(chunks) < 2:
        raise ValueError(f"a streamed answer came in {len(chunks)} chunk(s): no decode to time")
    tokens = sum(n for _, n in chunks)
    decode_s = chunks[-1][0] - chunks[0][0]
    return {"tokens": tokens, "chunks": len(chunks), "ttft_ms": (chunks[0][0] - start) * 1000.0,
            "decode_tok_s": (tokens - chunks[0][1]) / decode_s if decode_s > 0 else None,
            "tokens_per_chunk": (tokens - chunks[0][1]) / (len(chunks) - 1)}


def measure_c1(client: serving.Client, model: str, prompts: Sequence[list[int]],
               sampling: Mapping[str, float]) -> dict:
    """C1 decode, one streamed request after the other. Client side: decode tok/s after the first chunk (vLLM sends
    one chunk per engine step at C1, so tokens per chunk is tokens per step as the client sees it); server side:
    the mean request TPOT from /metrics and tokens per step from the spec-decode counters."""
    before = metrics(client)
    runs = [stream_once(client, model, p, sampling) for p in prompts]
    after = metrics(client)
    spec = spec_delta(before, after)
    tpot_s = histogram_mean(before, after, TPOT)
    rates = [r["decode_tok_s"] for r in runs if r["decode_tok_s"]]
    out = {"requests": runs, "sampling": dict(sampling), "spec": spec,
           "client_decode_tok_s": sum(rates) / len(rates) if rates else None,
           "client_tokens_per_chunk": sum(r["tokens_per_chunk"] for r in runs) / len(runs),
           "server_tpot_ms": None if tpot_s is None else tpot_s * 1000.0}
    if tpot_s:
        out["server_decode_tok_s"] = 1.0 / tpot_s
        out["ms_per_step"] = tpot_s * 1000.0 * spec["tokens_per_step"]
    return out


def measure_chisq(client: serving.Client, model: str, prompts: Sequence[list[int]]) -> dict:
    """One CHISQ_ANSWER-token answer per prompt at sc.SAMPLING, CHISQ_CONCURRENCY in flight."""
    before = metrics(client)
    t0 = time.monotonic()
    deadline = t0 + LIMITS["chisq"]

    def one(prompt):
        body = {"model": model, "prompt": prompt, "max_tokens": CHISQ_ANSWER, "ignore_eos": True,
                "return_token_ids": True, **sc.SAMPLING}
        answer = client.post_json("/v1/completions", body, timeout_s=max(1.0, deadline - time.monotonic()))
        return answer["choices"][0]["token_ids"]

    with ThreadPoolExecutor(max_workers=CHISQ_CONCURRENCY) as pool:
        samples = list(pool.map(one, prompts))
    return {"seconds": round(time.monotonic() - t0, 2), "samples": samples, "sampling": dict(sc.SAMPLING),
            "spec": spec_delta(before, metrics(client))}


PREFIX_HITS = "vllm:prefix_cache_hits_total"


def counter(page: str, name: str) -> float:
    return sum(s.value for s in serving.parse_prometheus(page) if s.name == name)


def measure_prefix(client: serving.Client, model: str, prompt: list[int]) -> dict:
    """The same long prompt answered after the prefix cache was emptied, then again from the cache."""
    body = {**_body(model, prompt, GREEDY, logprobs=TOP_LOGPROBS, return_tokens_as_token_ids=True,
                    return_token_ids=True), "max_tokens": PREFIX_ANSWER}
    runs = []
    for cached in (False, True):
        if not cached:
            client.post_json("/reset_prefix_cache", {}, timeout_s=60)
        before = counter(metrics(client), PREFIX_HITS)
        answer = client.post_json("/v1/completions", body, timeout_s=LIMITS["prefix"])
        hits = counter(metrics(client), PREFIX_HITS) - before
        runs.append({"cached": cached, "hit_tokens": hits,
                     "trace": smoke_lib.trace_from_choice(answer["choices"][0])})
    cold, warm = runs[0]["trace"], runs[1]["trace"]
    agreement = logit_agreement([cold], [warm])
    return {"prompt_tokens": len(prompt), "answer_tokens": PREFIX_ANSWER,
            "hit_tokens": [r["hit_tokens"] for r in runs], "same_tokens": cold.token_ids == warm.token_ids,
            "logits": agreement}


def measure_profile(client: serving.Client, model: str, prompt: list[int], sampling: Mapping[str, float],
                    trace_dir: Path, out_dir: Path, name: str) -> dict:
    """A C1 answer of PROFILE_TOKENS between /start_profile and /stop_profile; the trace gzipped to out_dir."""
    import gzip

    from bench import step_analysis as sp
    from bench import step_profile

    before = set(trace_dir.rglob("*.json*"))
    client.post_json("/start_profile", {}, timeout_s=60)
    try:
        run = stream_once(client, model, prompt, {**sampling, "max_tokens": PROFILE_TOKENS})
    finally:
        client.post_json("/stop_profile", {}, timeout_s=120)
    trace = sp.read_trace(step_profile.new_trace(trace_dir, before, timeout_s=LIMITS["profile"]))
    events = trace.get("traceEvents", [])
    kept = [e for e in events if e.get("cat") in PROFILE_CATEGORIES]
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / f"{name}.trace.json.gz"
    with gzip.open(target, "wt", compresslevel=6) as dst:
        json.dump({**{k: v for k, v in trace.items() if k != "traceEvents"}, "traceEvents": kept}, dst)
    return {"tokens": run["tokens"], "chunks": run["chunks"], "trace": target.name, "events": len(events),
            "events_kept": len(kept), "trace_bytes": target.stat().st_size}


def measure_host(server: run_full.Server, client: serving.Client, model: str, prompt: list[int],
                 sampling: Mapping[str, float], out_dir: Path, name: str) -> dict:
    """py-spy on the server's engine core for HOST_PROFILE_S while C1 answers stream: which Python the step waits
    on (the summary here, the speedscope profile in out_dir)."""
    from bench import host_profile

    binary = host_profile.pyspy_binary()
    pid = host_profile.engine_core_pid(server.proc.pid) if server.proc else None
    if binary is None or pid is None:
        return {"error": f"py-spy {binary or 'not found (tests/gpu/stage-extra.sh)'}, engine core pid {pid}"}
    out_dir.mkdir(parents=True, exist_ok=True)
    return host_profile.record_while(binary, pid, HOST_PROFILE_S, out_dir / f"{name}.pyspy.json",
                                     lambda: stream_once(client, model, prompt, {**sampling, "max_tokens": MAX_TOKENS}))


# ---------------------------------------------------------------- the run


class Record:
    """The report, rewritten whole after every change (a cut run keeps what it measured)."""

    def __init__(self, path: Path, data: dict):
        self.path, self.data = path, data
        self.t0 = time.monotonic()
        self.traces: dict[str, list[smoke_lib.GreedyTrace]] = {}  # greedy answers by server (own files: ~3 MB each)
        self.samples: dict[str, list[list[int]]] = {}  # chi-square samples by server (own files)
        self.rows: dict[str, list[list[dict[int, float]]]] = {}  # the reference before each sampled token

    def keep_traces(self, name: str, records: list[dict]) -> None:
        self.traces[name] = [smoke_lib.GreedyTrace.from_record(r) for r in records]
        serving.write_json_atomic(self.path.with_name(f"{name}-greedy.json"), records)

    def keep_samples(self, name: str, prompts: list[list[int]], samples: list[list[int]]) -> None:
        self.samples[name] = samples
        serving.write_json_atomic(self.path.with_name(f"{name}-chisq-samples.json"),
                                  {"prompts": prompts, "samples": samples})

    def save(self) -> None:
        serving.write_json_atomic(self.path, self.data)

    def phase(self, name: str, seconds: float) -> None:
        self.data["phases_s"][name] = round(seconds, 1)
        self.save()


def prompts_for(design, kind: str, count: int) -> list[dict]:
    """Token-id prompts with their designed greedy continuation: quoting and free prompts alternate."""
    from qwen_serving.checkpoint import scripted

    out = []
    for i in range(count):
        seed = SEEDS[kind] + i
        if i % 2 == 0:
            made = scripted.quoting_prompt(design, seed)
        else:  # 200 tokens at full size; the tiny checkpoint's cycle (255 tokens) holds 127
            made = scripted.free_prompt(design, seed, length=min(200, len(design.active) // 2))
        out.append({"kind": "quoting" if i % 2 == 0 else "free", "seed": seed, "ids": made["ids"]})
    return out


def expected_chain(design, prompt: Sequence[int]) -> list[int]:
    return design.walk(prompt[-1], MAX_TOKENS)[1:]


def patch_state(patched_site: Path | None, python: str, env: Mapping[str, str]) -> dict:
    series = [patch.name for patch in patchset.read_series(patchset.DEFAULT_SERIES)]
    state: dict = {"series": series, "vllm_dir": None if patched_site is None else str(patched_site / "vllm")}
    if patched_site is None:
        return state
    try:
        done = subprocess.run([python, "-m", "qwen_serving.patchset", "verify", "--vllm-dir", state["vllm_dir"]],
                              cwd=REPO, env=dict(env), capture_output=True, text=True, timeout=120)
        state.update(verify_rc=done.returncode, verify_output=(done.stdout + done.stderr)[-3000:])
    except (OSError, subprocess.SubprocessError) as err:
        state.update(verify_rc=None, verify_output=str(err))
    return state


def build_servers(args: argparse.Namespace, out: Path, configs: Sequence[fb.BenchConfig],
                  first_port: int) -> list[run_full.Server]:
    servers = []
    for i, cfg in enumerate(configs):
        site = ablation_site(args, cfg.name) if cfg.name.startswith(fb.ABLATION_PREFIX) else args.patched_site
        paths = [str(site), str(args.site)] if cfg.patched else [str(args.site)]
        probe = plan.Probe.detect(REPO)  # the plan's vLLM facts are vllm_028's, whichever vllm the server runs
        port = first_port + i
        cmd = fb.server_command(cfg, python=args.python, ckpt=served_checkpoint(args, cfg.name), port=port,
                                traces=out / f"traces-{cfg.name}", probe=probe)
        servers.append(run_full.Server(cfg, cmd, port, os.pathsep.join(paths), out / f"{cfg.name}.server.log"))
    return servers


def server_gib(cfg: fb.BenchConfig) -> float:
    """A server's GPU memory estimate: its files' weights, its pool, run_full's graphs and overhead."""
    return (WEIGHTS_GIB[stack(cfg.name)] + int(cfg.knobs["KV_MEM"]) / run_full.GiB + run_full.GRAPHS_GIB
            + run_full.OVERHEAD_GIB)


def waves(args: argparse.Namespace, out: Path, taken: Sequence[str] = (),
          bound: float = run_full.BOUND_GIB) -> list[list[run_full.Server]]:
    """The first wave's servers (with --ablate, the plan's k=4 server and its ablations lead, one group, so that they
    boot side by side), then the variants', the sweep's in SWEEP_ORDER (each k's pair together: the
    single-user plan's, then stock's) and the high-agreement server, less those --from-run took from an earlier run
    (and the high-agreement one when args.high_agree is 0). Packed in that order: a wave takes whole groups (a k's
    pair is one) while the memory estimate stays within `bound` (the run passes run_full.bound_gib(), the lent
    card's), so a budget that ends the run early leaves whole pairs. Ports are never reused."""
    pairs = [[fb.SCRIPTED_SWEEP[f"scripted-{which}-mtp{k}"] for which in ("patched", "stock")] for k in SWEEP_ORDER]
    high = list(fb.SCRIPTED_HIGH_AGREE.values()) if args.high_agree else []
    first = [[c] for c in fb.SCRIPTED_CONFIGS.values()]
    if args.ablate:
        plan = fb.SCRIPTED_CONFIGS[ABLATION_BASE]
        first = [[plan, *(fb.scripted_ablation(patch) for patch in args.ablate)], *(g for g in first if g != [plan])]
    groups = [*first, *([c] for c in fb.SCRIPTED_VARIANTS.values()), *pairs, *([c] for c in high)]
    out_waves: list[list[fb.BenchConfig]] = [[]]
    used = 0.0
    for group in ([c for c in g if c.name not in taken] for g in groups):
        need = sum(server_gib(c) for c in group)
        if out_waves[-1] and used + need > bound:
            out_waves.append([])
            used = 0.0
        out_waves[-1] += group
        used += need
    servers, port = [], args.base_port
    for wave in (w for w in out_waves if w):
        servers.append(build_servers(args, out, wave, port))
        port += len(wave)
    return servers


def judge(rec: dict, traces: Mapping[str, list[smoke_lib.GreedyTrace]], samples: Mapping[str, list[list[int]]],
          rows: Mapping[str, list[list[dict[int, float]]]], design, greedy_prompts: list[dict]) -> dict:
    """Every check that the measurements so far allow, with its numbers."""
    meas = rec["measurements"]
    checks: dict = {}
    expected = [expected_chain(design, p["ids"]) for p in greedy_prompts]
    walks: dict[str, dict[int, dict]] = {}  # by stack
    for which, key in PREDICTIONS.items():
        pred = rec.get(key) or {}
        if pred.get("greedy_successor"):
            successor = {int(t): v for t, v in pred["greedy_successor"].items()}
            proposal = {int(t): v for t, v in pred["mtp_proposal"].items()}
            firsts = [successor[p["ids"][-1]] for p in greedy_prompts]
            walks[which] = {k: greedy_walk_acceptance(firsts, successor, proposal, k, MAX_TOKENS)
                            for k in {m.get("k", K) for name, m in meas.items() if files(name) == which} if k}
            rec[f"{key}_greedy_walk"] = {str(k): w for k, w in walks[which].items()}
        check = pred.get("reference_check")
        if check:
            checks[f"reference ({which} files): the float32 forward of the written weights follows the designed "
                   "chain"] = {"passed": check["argmax_is_chain"] == check["positions"],
                               **{key: v for key, v in check.items() if key != "top"}}
    for name, m in meas.items():
        k = m.get("k", K)
        greedy = m.get("greedy")
        pred, walk = rec.get(PREDICTIONS.get(files(name), "")) or {}, walks.get(files(name), {})
        baseline = BASELINES[stack(name)]
        reference = traces.get(baseline)
        if greedy and name in traces:
            checks[f"{name}: greedy answers are the designed chain"] = chain_check(traces[name], expected)
            if reference and name != baseline:
                comparison = smoke_lib.compare_greedy(reference, traces[name])
                checks[f"{name}: greedy token-identical to no speculation"] = {
                    "passed": not comparison.unexplained, **comparison.summary()}
                checks[f"{name}: top-20 raw logits agree with no speculation"] = logit_agreement(reference,
                                                                                                 traces[name])
            if k in walk and greedy["spec"]["speculative"]:
                checks[f"{name}: greedy acceptance per position = the exact greedy walk"] = compare_acceptance(
                    greedy["spec"]["per_position_acceptance"], walk[k]["acceptance_per_position"])
            if files(name) == "high" and greedy["spec"]["speculative"]:
                checks[f"{name}: greedy drafts accepted at least {HIGH_ACCEPTANCE_FLOOR:.0%} of the time"] = \
                    acceptance_floor(greedy["spec"]["per_position_acceptance"], HIGH_ACCEPTANCE_FLOOR)
        sampled = m.get("sampled")
        default = (pred.get("by_k") or {}).get(f"default_{m.get('draft_sample')}_drafts", {}).get(str(k))
        if sampled and default:
            which = f"default_{m['draft_sample']}_drafts"
            checks[f"{name}: default-sampling acceptance per position = prediction ({which})"] = compare_acceptance(
                sampled["spec"]["per_position_acceptance"], default)
        if name in samples and name in rows:
            checks[f"{name}: chi-square of the sampled tokens' ranks against the reference"] = sc.rank_test(
                samples[name], rows[name])
        prefix = m.get("prefix")
        if prefix:
            checks[f"{name}: a cache hit gives the same tokens and raw logits"] = {
                "passed": prefix["same_tokens"] and prefix["logits"]["passed"] and prefix["hit_tokens"][1] > 0,
                **prefix}
    return checks


def start_record(path: Path, args: argparse.Namespace, env: Mapping[str, str]) -> Record:
    patched_env = dict(env)
    if args.patched_site:
        patched_env["PYTHONPATH"] = os.pathsep.join([str(args.patched_site), env["PYTHONPATH"]])
    rec = Record(path, {
        "schema": SCHEMA, "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "gpu": smoke_lib.gpu_description(), "host_cpu": smoke_lib.host_cpu(),
        "gpu_state_at_start": run_full.gpu_state(),
        "versions": {"python": sys.version.split()[0], **smoke_lib.package_versions(smoke_lib.REPORTED_PACKAGES)},
        "patches": patch_state(args.patched_site, args.python, patched_env),
        "checkpoint": {"dir": str(args.ckpt), "prepared_dir": str(args.prepared_ckpt), "mtp_agree_asked": args.agree,
                       "draft_coverage_asked": args.coverage}, "k": K, "max_tokens": MAX_TOKENS,
        "acceptance_within": ACCEPTANCE_WITHIN, "budget_s": args.budget_s, "limits_s": LIMITS, "phases_s": {},
        **dict.fromkeys(PREDICTIONS.values()), "servers": {}, "measurements": {}, "checks": {}, "passed": False,
        "skipped": [], "errors": {}, "ablations": {},
    })
    rec.save()
    return rec


def finish(rec: Record, design, greedy_prompts: list[dict]) -> bool:
    """The checks over everything measured; passed when there are some and all pass."""
    rec.data["checks"] = judge(rec.data, rec.traces, rec.samples, rec.rows, design, greedy_prompts)
    rec.data["passed"] = bool(rec.data["checks"]) and all(c["passed"] for c in rec.data["checks"].values())
    rec.save()
    return rec.data["passed"]


def boot(servers: list[run_full.Server], rec: Record, out: Path, limit_s: float) -> None:
    t_boot = time.monotonic()
    for s in servers:
        (out / f"traces-{s.cfg.name}").mkdir(exist_ok=True)
        rec.data["servers"][s.cfg.name] = {"cmd": f"PYTHONPATH={s.pythonpath} {s.cmd.shell()}",
                                           "what": s.cfg.what, "port": s.port}
        log(f"{s.cfg.name}: starting on port {s.port}")
        s.start()
    rec.save()
    run_full.wait_until_up(servers, max(1.0, limit_s - (time.monotonic() - t_boot)))
    for s in servers:
        rec.data["servers"][s.cfg.name].update(state=s.state, boot_s=s.start_seconds,
                                               boot_facts=serving.boot_facts(s.log_text()))


def budget_spent(rec: Record, what: str, limit: float, left: Callable[[float], float], share: float) -> bool:
    """True, with `what` recorded as skipped, when less than `share` of its limit is left of the run's budget."""
    if left(limit) < limit * share:
        rec.data["skipped"].append(f"{what} (run budget spent)")
        return True
    return False


def wave_tools(servers: Mapping[str, run_full.Server], rec: Record, out: Path, env: Mapping[str, str],
               python: str, ckpt: Path, left: Callable[[float], float]) -> None:
    """Issue #22's tools against the first wave's servers, each a subprocess within its limit; its exit code and
    the tail of its output recorded, its JSON under OUT."""
    stock, plain = servers.get("scripted-stock"), servers.get("scripted-patched-plain")
    runs = []
    if stock and stock.state == "up":
        runs.append(("quality", [python, "bench/gpu/quality_scripted.py", "--url", stock.url, "--ckpt", str(ckpt),
                                 "--out", str(out / f"{QUALITY_TAG}-quality.json")]))
    if plain and plain.state == "up":
        runs.append(("real_rep", [python, "bench/repeats.py", "real-rep", QUALITY_TAG, "3", "--url", plain.url,
                                  "--out", str(out), "--harness-arg=--ignore-eos"]))
    if stock and plain and stock.state == plain.state == "up":
        runs.append(("prefill_ab", [python, "bench/repeats.py", "prefill-ab", QUALITY_TAG, "--a-url", stock.url,
                                    "--b-url", plain.url, "--lens", PREFILL_AB_LENS, "--max-rounds", "3",
                                    "--out", str(out)]))
    tools = rec.data.setdefault("tools", {})
    for part, argv in runs:
        if budget_spent(rec, part, LIMITS[part], left, share=0.5):
            continue
        t0 = time.monotonic()
        try:
            done = subprocess.run(argv, cwd=REPO, env=dict(env), capture_output=True, text=True,
                                  timeout=left(LIMITS[part]))
            tools[part] = {"rc": done.returncode, "output_tail": (done.stdout + done.stderr)[-3000:]}
        except subprocess.TimeoutExpired as err:
            tools[part] = {"rc": None, "output_tail": f"timed out after {err.timeout:.0f} s"}
        rec.phase(f"tools: {part}", time.monotonic() - t0)
        log(f"{part}: rc {tools[part]['rc']}")


def stack(name: str) -> str:
    """A server's stack from its config name (fullbench's scripted-stock-* / scripted-patched-*)."""
    return "patched" if "-patched-" in name else "stock"


def files(name: str) -> str:
    """The files a server serves, as PREDICTIONS names them: synth's (stock), the prepared copy (patched), the
    prepared high-agreement copy (high)."""
    return "high" if name in fb.SCRIPTED_HIGH_AGREE else stack(name)


def checkpoint_of(args: argparse.Namespace, which: str) -> Path:
    """The folder holding the files files() names `which`."""
    return getattr(args, {"stock": "ckpt", "patched": "prepared_ckpt", "high": "high_prepared_ckpt"}[which])


def served_checkpoint(args: argparse.Namespace, name: str) -> Path:
    return checkpoint_of(args, files(name))


class Predictor:
    """The --predict child for one stack's files; the report gets its prediction under `key` once written."""

    def __init__(self, key: str, ckpt: Path, out: Path):
        self.key, self.ckpt, self.path = key, ckpt, out / f"{key}.json"
        self.proc: subprocess.Popen | None = None

    def start(self, args: argparse.Namespace, env: Mapping[str, str], out: Path) -> None:
        self.path.unlink(missing_ok=True)
        with open(out / f"{self.key}.log", "w") as log_file:
            self.proc = subprocess.Popen([args.python, str(Path(__file__).resolve()), "--predict", str(self.path),
                                          "--ckpt", str(self.ckpt), "--device", args.device],
                                         cwd=REPO, env=dict(env), stdout=log_file, stderr=subprocess.STDOUT)

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def take(self, rec: Record, wait_s: float = 0.0) -> bool:
        """The prediction into the report once the child has written it (waiting up to wait_s); True when this
        child is done (an exit without a prediction is an error)."""
        if rec.data.get(self.key) is not None:
            return True
        if self.proc is None:
            return False
        try:
            self.proc.wait(timeout=max(wait_s, 0.01))
        except subprocess.TimeoutExpired:
            return False
        if self.path.exists():
            rec.data[self.key] = json.loads(self.path.read_text())
            rec.data["phases_s"][f"{self.key} ready"] = round(time.monotonic() - rec.t0, 1)
            log(f"{self.key}: " + json.dumps(rec.data[self.key]["acceptance_per_position"]))
            log(f"{self.key} reference: " + json.dumps({k: v for k, v in rec.data[self.key]["reference_check"].items()
                                                        if k != "top"}))
        else:
            rec.data["errors"][self.key] = f"exit {self.proc.returncode} (see {self.key}.log)"
        rec.save()
        return True


def take_predictions(rec: Record, predictors: Sequence[Predictor], args: argparse.Namespace,
                     env: Mapping[str, str], out: Path, wait_s: float = 0.0) -> None:
    """One child at a time (each holds the reference on the GPU beside the servers): the next starts when the
    one before it is done; waits up to wait_s for each."""
    for i, predictor in enumerate(predictors):
        if predictor.proc is None:
            if i and not predictors[i - 1].take(rec):
                return
            predictor.start(args, env, out)
        if not predictor.take(rec, wait_s):
            return


def chisq_rows_child(name: str, out: Path, env: Mapping[str, str], args: argparse.Namespace) -> subprocess.Popen:
    """The --chisq-rows child for one server's samples, started (its stderr in OUT/<name>-chisq-rows.log)."""
    with open(out / f"{name}-chisq-rows.log", "w") as log_file:
        return subprocess.Popen([args.python, str(Path(__file__).resolve()), "--chisq-rows",
                                 str(out / f"{name}-chisq-samples.json"), str(out / f"{name}-chisq-rows.json"),
                                 "--ckpt", str(served_checkpoint(args, name)),
                                 "--device", args.device], cwd=REPO, env=dict(env), stdout=subprocess.DEVNULL,
                                stderr=log_file)


def take_chisq_rows(rec: Record, out: Path, name: str, child: subprocess.Popen, timeout_s: float, t0: float) -> None:
    """Waits up to timeout_s for the child, then keeps its rows for the checks (or records why not)."""
    try:
        child.wait(timeout=max(timeout_s, 1.0))
        if child.returncode:
            raise subprocess.CalledProcessError(child.returncode, child.args)
        rows = json.loads((out / f"{name}-chisq-rows.json").read_text())
        rec.rows[name] = [[{int(t): p for t, p in row} for row in seq] for seq in rows]
    except (subprocess.SubprocessError, OSError, ValueError) as err:
        child.kill()
        tail = (out / f"{name}-chisq-rows.log").read_text()[-1500:] if (out / f"{name}-chisq-rows.log").exists() else ""
        rec.data["errors"][f"{name}: chisq rows"] = f"{type(err).__name__}: {err} {tail}".strip()
    rec.phase(f"{name}: chisq rows", time.monotonic() - t0)


def chisq_reference(rec: Record, out: Path, env: Mapping[str, str], args: argparse.Namespace,
                    left: Callable[[float], float]) -> None:
    """The --chisq-rows child for each server's samples not judged yet, one at a time within its limit."""
    for name in [n for n in rec.samples if n not in rec.rows]:
        take_chisq_rows(rec, out, name, chisq_rows_child(name, out, env, args), left(LIMITS["chisq_rows"]),
                        time.monotonic())


def dial_difference(earlier: Mapping, this: Mapping) -> str | None:
    """How an earlier run's scripted checkpoint differs from this one in its dials (None: the same files, since the
    checkpoint is deterministic given them and the seed)."""
    for dial in ("mtp_agree", "draft_coverage"):
        if earlier.get(dial) != this.get(dial):
            return f"its checkpoint has {dial} {earlier.get(dial)}, this one {this.get(dial)}"
    return None


def in_background(fn: Callable, *args) -> Future:
    """fn(*args) on a daemon thread (a killed run does not wait for it), its outcome in the Future."""
    future: Future = Future()

    def work() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as err:  # noqa: BLE001 (the caller reads it from the Future)
            future.set_exception(err)

    threading.Thread(target=work, daemon=True).start()
    return future


def take_high_copy(rec: Record, high_copy: Future, servers: list[run_full.Server], wait_s: float, t0: float) -> None:
    """Waits up to wait_s for the high-agreement copy; without it, its servers leave the wave (recorded)."""
    try:
        rec.data["checkpoint"]["high_agree"] = high_copy.result(timeout=max(wait_s, 1.0))
    except Exception as err:  # whatever stopped it, the wave boots without its servers
        rec.data["errors"]["high-agreement copy"] = f"{type(err).__name__}: {err}"
        dropped = [s for s in servers if files(s.cfg.name) == "high"]
        rec.data["skipped"] += [f"{s.cfg.name}: not booted (no high-agreement copy)" for s in dropped]
        servers[:] = [s for s in servers if s not in dropped]
    rec.phase("high-agreement copy ready", time.monotonic() - t0)
    rec.save()


def take_servers(rec: Record, report: Path, servers: Sequence[str]) -> list[str]:
    """--from-run: the measurements and greedy answers of the `servers` named from an earlier run on the same
    checkpoint, so that a visit can give its time to the servers not measured yet: the report, and the answers in the
    folder named like it (REPORT's stem, `<server>-greedy.json.gz`, as bench/results keeps them). Their checks are
    judged again here against this run's predictions; a server whose chi-square samples are there too
    (`<server>-chisq-samples.json.gz`) has its reference rows computed in this run, as if it had sampled here.
    A measurement the earlier run itself took from another keeps that origin, and its files are looked for in the
    origin's folder too (bench/results keeps each file once, in the folder of the run that measured it). Returns
    the servers taken."""
    earlier = json.loads(report.read_text())
    differs = dial_difference(earlier["checkpoint"], rec.data["checkpoint"])
    if differs:
        raise CheckpointError(f"--from-run {report}: {differs}")
    folder, taken = report.with_suffix(""), []
    for name in servers:
        if name not in earlier["measurements"]:
            continue
        measured = earlier["measurements"][name]
        answers = kept_file(report, measured, f"{name}-greedy.json.gz")
        if answers is None:
            continue
        rec.data["measurements"][name] = {"from_run": f"{report.name} ({earlier['date']})", **measured}
        rec.traces[name] = [smoke_lib.GreedyTrace.from_record(r) for r in json.loads(gzip.decompress(answers.read_bytes()))]
        samples = kept_file(report, measured, f"{name}-chisq-samples.json.gz")
        if samples is not None:
            kept = json.loads(gzip.decompress(samples.read_bytes()))
            rec.keep_samples(name, kept["prompts"], kept["samples"])
        taken.append(name)
    if not taken:
        raise CheckpointError(f"--from-run {report}: none of {', '.join(servers)} has its answers in {folder}")
    rec.data["from_run"] = {"report": report.name, "date": earlier["date"], "gpu": earlier.get("gpu"), "servers": taken}
    rec.save()
    return taken


def kept_file(report: Path, measured: Mapping, file_name: str) -> Path | None:
    """file_name in the folder named like REPORT, else in that of the run the measurement came from (its
    `from_run`, "<report name> (<date>)", a report beside REPORT)."""
    folders = [report.with_suffix("")]
    if measured.get("from_run"):
        folders.append(report.parent / Path(measured["from_run"].split(" (")[0]).stem)
    return next((f / file_name for f in folders if (f / file_name).is_file()), None)


ABLATION_BASE = "scripted-patched-mtp4"  # the server an ablation is set against (fb.scripted_ablation is it less a patch)


def ablation_site(args: argparse.Namespace, name: str) -> Path:
    """The folder holding the vllm copy an ablation server runs (its patch's stem under --ablate-root)."""
    return args.ablate_root / name.removeprefix(fb.ABLATION_PREFIX)


def make_ablation_site(site: Path, dst: Path, patches: Sequence[patchset.Patch], without: str) -> list[str]:
    """dst/vllm: site's stock vllm with every patch of `patches` but `without` applied. The files the series
    touches are copied, the rest hard-linked (the stock tree is never written: patchset writes beside and renames
    anyway); made beside dst and renamed. Returns the patches applied."""
    touched = set(patchset.series_files(patches))
    pristine = site / "vllm"

    def copy(src: str, target: str) -> None:
        if Path(src).relative_to(pristine).as_posix() in touched:
            shutil.copy2(src, target)
            return
        try:
            os.link(src, target)
        except OSError:  # another filesystem
            shutil.copy2(src, target)

    staging = dst.with_name(f".{dst.name}.making")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(pristine, staging / "vllm", symlinks=True, copy_function=copy)
    kept = [p for p in patches if p.name != without]
    patchset.apply(staging / "vllm", kept)
    shutil.rmtree(dst, ignore_errors=True)
    staging.rename(dst)
    return [p.name for p in kept]


def make_ablation_sites(args: argparse.Namespace, rec: Record) -> None:
    """Each --ablate patch's vllm copy; one that cannot be made is recorded, and its server left out."""
    patches = patchset.read_series(patchset.DEFAULT_SERIES)
    tools = Path(os.environ.get("PAY", "/tmp/pay")) / "tools"  # the staged GNU patch, where the image has none
    if shutil.which("patch") is None and (tools / "patch").is_file():
        os.environ["PATH"] = os.pathsep.join([str(tools), os.environ.get("PATH", "")])
    for patch in list(args.ablate):
        name = fb.scripted_ablation(patch).name
        t0 = time.monotonic()
        try:
            applied = make_ablation_site(args.site, ablation_site(args, name), patches, patch)
        except (patchset.PatchError, OSError) as err:
            rec.data["errors"][f"ablation {patch}"] = f"{type(err).__name__}: {err}"
            rec.data["skipped"].append(f"{name}: not booted (its vllm copy could not be made)")
            args.ablate.remove(patch)
            continue
        rec.data["ablations"][name] = {"without": patch, "site": str(ablation_site(args, name)),
                                       "applied": applied, "made_s": round(time.monotonic() - t0, 1)}
    rec.save()


def ablation_table(meas: Mapping[str, dict]) -> list[dict]:
    """Per ablation server measured at C1 beside the plan's own k=4 server in this run: both steps and what the
    patch saves (positive: the step is shorter with it)."""
    plan_c1 = (meas.get(ABLATION_BASE) or {}).get("c1") or {}
    if "from_run" in meas.get(ABLATION_BASE, {}) or not plan_c1.get("ms_per_step"):
        return []
    rows = []
    for name, m in meas.items():
        c1 = m.get("c1") or {}
        if name.startswith(fb.ABLATION_PREFIX) and c1.get("ms_per_step") and "from_run" not in m:
            rows.append({"server": name, "without": name.removeprefix(fb.ABLATION_PREFIX) + ".patch",
                         "ms_per_step_without": c1["ms_per_step"], "ms_per_step_with": plan_c1["ms_per_step"],
                         "saved_ms": round(c1["ms_per_step"] - plan_c1["ms_per_step"], 3),
                         "tokens_per_step_without": c1["spec"]["tokens_per_step"],
                         "tokens_per_step_with": plan_c1["spec"]["tokens_per_step"]})
    return rows


class CheckpointError(RuntimeError):
    """The checkpoint or its prepared copy could not be made; the message says where to look."""


def make_checkpoint(args: argparse.Namespace, env: Mapping[str, str], out: Path,
                    left: Callable[[float], float]) -> dict:
    """The scripted full checkpoint in args.ckpt (synth, unless one is there), checked against the dials asked."""
    from qwen_serving.checkpoint import scripted

    made = {}
    if not (args.ckpt / "config.json").exists():
        log(f"generating the scripted full checkpoint in {args.ckpt} (--mtp-agree {args.agree}, "
            f"--draft-coverage {args.coverage})")
        try:
            with open(out / "synth.log", "w") as synth_log:
                subprocess.run([args.python, "-m", "qwen_serving.checkpoint.synth", "--size", "full", "--behaviour",
                                "scripted", "--mtp-agree", str(args.agree), "--draft-coverage", str(args.coverage),
                                "--seed", str(CHECKPOINT_SEED), "--out", str(args.ckpt)],
                               cwd=REPO, env=dict(env), check=True, timeout=left(LIMITS["synth"]) or 1,
                               stdout=synth_log, stderr=subprocess.STDOUT)
        except subprocess.SubprocessError as err:
            raise CheckpointError(f"synth failed: {err} (see synth.log)") from err
        made["generated"] = True
    design = scripted.Design.read(args.ckpt)
    if abs(design.mtp_agree - args.agree) > 1e-9:
        raise CheckpointError(f"{args.ckpt} has --mtp-agree {design.mtp_agree}, not {args.agree}")
    if not (args.ckpt / scripted.DRAFT_IDS_FILE).is_file():
        raise CheckpointError(f"{args.ckpt} has no {scripted.DRAFT_IDS_FILE} (made without --draft-coverage): "
                              "remove it, and the run generates one with the draft id list")
    ids = json.loads((args.ckpt / scripted.DRAFT_IDS_FILE).read_text())["ids"]
    made["draft_coverage"] = round(scripted.draft_coverage(design, ids), 4)
    if abs(made["draft_coverage"] - args.coverage) > 2 / len(design.active):
        raise CheckpointError(f"{args.ckpt} has --draft-coverage {made['draft_coverage']}, not {args.coverage}")
    return made


def prepare_copy(args: argparse.Namespace, env: Mapping[str, str], out: Path,
                 left: Callable[[float], float], src: Path | None = None, dst: Path | None = None) -> dict:
    """dst (default args.prepared_ckpt): a hard-linked copy of src (default args.ckpt; prepare/'s steps never write
    into a file they did not create, so the links stay the originals' bytes), then prepare/'s int8 steps and the
    draft head, each a no-op when prepared.json records it; prepare_status's lines at the end. Returns each step's
    seconds. Logs to OUT/prepare-<dst's name>.log."""
    from qwen_serving.checkpoint import scripted

    src, dst = src or args.ckpt, dst or args.prepared_ckpt
    done: dict = {"steps_s": {}}
    if not (dst / "config.json").exists():
        staging = dst.with_name(f".{dst.name}.linking")
        shutil.rmtree(staging, ignore_errors=True)
        shutil.copytree(src, staging, copy_function=os.link)
        staging.rename(dst)
    ids = dst / scripted.DRAFT_IDS_FILE
    commands = [(step, ["prepare/" + f"{step}.py", str(dst)]) for step in PREPARE_STEPS]
    commands.append(("build_draft_vocab", ["prepare/build_draft_vocab.py", str(dst), "--ids", str(ids)]))
    log_path = out / f"prepare-{dst.name}.log"
    with open(log_path, "a") as prepare_log:
        for step, argv in commands:
            t0 = time.monotonic()
            log(f"prepared copy {dst.name}: {step}")
            try:
                subprocess.run([args.python, *argv], cwd=REPO, env=dict(env), check=True,
                               timeout=left(LIMITS["prepare"]) or 1, stdout=prepare_log, stderr=subprocess.STDOUT)
            except subprocess.SubprocessError as err:
                raise CheckpointError(f"prepare step {step} failed: {err} (see {log_path.name})") from err
            done["steps_s"][step] = round(time.monotonic() - t0, 1)
        status = subprocess.run([args.python, "-m", "qwen_serving.checkpoint.prepare_status", str(dst)],
                                cwd=REPO, env=dict(env), capture_output=True, text=True, timeout=120)
    done["prepare_status"] = (status.stdout + status.stderr).strip().splitlines()
    return done


def make_high_copy(args: argparse.Namespace, env: Mapping[str, str], out: Path,
                   left: Callable[[float], float]) -> dict:
    """args.high_ckpt: args.ckpt with its MTP at --high-agree (scripted redial, unless one is there, checked to hold
    the same target), then its prepared copy args.high_prepared_ckpt. Returns what was made and how long it took."""
    from qwen_serving.checkpoint.scripted import Design

    made: dict = {"dir": str(args.high_ckpt), "prepared_dir": str(args.high_prepared_ckpt), "mtp_agree_asked":
                  args.high_agree}
    t0 = time.monotonic()
    if not (args.high_ckpt / "config.json").exists():
        log(f"the high-agreement copy: {args.high_ckpt} (--mtp-agree {args.high_agree})")
        try:
            with open(out / "redial.log", "w") as redial_log:
                subprocess.run([args.python, "-m", "qwen_serving.checkpoint.scripted", "redial", str(args.ckpt),
                                "--mtp-agree", str(args.high_agree), "--out", str(args.high_ckpt)],
                               cwd=REPO, env=dict(env), check=True, timeout=left(LIMITS["synth"]) or 1,
                               stdout=redial_log, stderr=subprocess.STDOUT)
        except subprocess.SubprocessError as err:
            raise CheckpointError(f"scripted redial failed: {err} (see redial.log)") from err
        made["redial_s"] = round(time.monotonic() - t0, 1)
    base, high = Design.read(args.ckpt), Design.read(args.high_ckpt)
    if abs(high.mtp_agree - args.high_agree) > 1e-9:
        raise CheckpointError(f"{args.high_ckpt} has --mtp-agree {high.mtp_agree}, not {args.high_agree}")
    if (high.seed, high.active, high.chain, high.alternatives) != (base.seed, base.active, base.chain,
                                                                   base.alternatives):
        raise CheckpointError(f"{args.high_ckpt} holds another target than {args.ckpt}: remove it")
    made["mtp_agree"] = high.mtp_agree
    made["prepared"] = prepare_copy(args, env, out, left, src=args.high_ckpt, dst=args.high_prepared_ckpt)
    return made


def run(args: argparse.Namespace) -> int:
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    deadline = t_start + args.budget_s

    def left(limit: float) -> float:
        return max(0.0, min(limit, deadline - time.monotonic()))

    env = {**os.environ, **smoke_lib.DEVICE_ENV, "PYTHONPATH": os.pathsep.join([str(args.site), str(REPO)])}
    rec = start_record(out / REPORT, args, env)

    # 1. the checkpoint, and the patched servers' prepared copy (both skipped when already there)
    t0 = time.monotonic()
    try:
        rec.data["checkpoint"].update(make_checkpoint(args, env, out, left))
        rec.phase("checkpoint", time.monotonic() - t0)
        t0 = time.monotonic()
        rec.data["checkpoint"]["prepared"] = prepare_copy(args, env, out, left)
        rec.phase("prepared copy", time.monotonic() - t0)
    except CheckpointError as err:
        rec.data["errors"]["checkpoint"] = str(err)
        rec.phase("checkpoint", time.monotonic() - t0)
        return 1
    if args.ablate:
        t0 = time.monotonic()
        make_ablation_sites(args, rec)
        rec.phase("ablation copies", time.monotonic() - t0)
    from qwen_serving.checkpoint.scripted import Design

    design = Design.read(args.ckpt)
    prompts = make_prompts(design)
    rec.data["checkpoint"].update(mtp_agree=design.mtp_agree, hidden=design.hidden, active=len(design.active))
    rec.data["prompts"] = {"greedy": [{k: p[k] for k in ("kind", "seed")} | {"tokens": len(p["ids"])}
                                      for p in prompts.greedy], "sampled": len(prompts.sampled),
                           "c1": len(prompts.c1), "max_tokens": MAX_TOKENS, "chisq": len(prompts.chisq),
                           "prefix_tokens": len(prompts.prefix)}

    # 2. the first wave boots (or comes from --from-run), and the prediction (the reference at full size) runs beside it
    taken: list[str] = []
    if args.from_run:
        try:
            taken = take_servers(rec, args.from_run, args.from_run_servers)
        except (CheckpointError, OSError, ValueError, KeyError) as err:
            rec.data["errors"]["from_run"] = f"{type(err).__name__}: {err}"
            rec.save()
            return 1
    all_waves = waves(args, out, taken, run_full.bound_gib())
    # the high-agreement copy (CPU work) while the first waves boot and measure, when a server of it is still to
    # boot (--from-run may have taken it); that server waits for it
    high_copy = (in_background(make_high_copy, args, env, out, left)
                 if any(files(s.cfg.name) == "high" for wave in all_waves for s in wave) else None)
    t_high = time.monotonic()
    predictors = [Predictor(PREDICTIONS[which], checkpoint_of(args, which), out) for which in ("stock", "patched")]
    take_predictions(rec, predictors, args, env, out)  # the first starts now

    def predictions(wait_s: float = 0.0) -> None:
        take_predictions(rec, predictors, args, env, out, wait_s)

    sampling = default_sampling(args.ckpt)
    boot_s = LIMITS["boot"]
    # samples --from-run brought: their reference rows while the first wave boots (the GPU has room beside booting
    # servers, as for the predictions), done before anything is timed
    early_rows = {name: (chisq_rows_child(name, out, env, args), time.monotonic()) for name in rec.samples}
    try:
        for index, servers in enumerate(all_waves):
            first = index == 0  # the first wave's servers (with --from-run, those left) lead it
            if not first:  # a sweep wave: only when its boot and its servers' measures fit what is left
                need = boot_s + len(servers) * SWEEP_SERVER_S
                if deadline - time.monotonic() < need:
                    rec.data["skipped"] += [f"{s.cfg.name}: not booted (run budget spent)" for s in servers]
                    continue
            if high_copy is not None and any(files(s.cfg.name) == "high" for s in servers):
                take_high_copy(rec, high_copy, servers, left(LIMITS["synth"] + LIMITS["prepare"]), t_high)
            t_boot = time.monotonic()
            boot(servers, rec, out, left(LIMITS["boot"]))
            if index == 0:  # measuring starts now; the predictions join the report when they are written
                for name, (child, t0) in early_rows.items():
                    take_chisq_rows(rec, out, name, child, left(LIMITS["chisq_rows"]) - (time.monotonic() - t0), t0)
                predictions(wait_s=min(PREDICT_GRACE_S, left(LIMITS["predict"])))
            boot_s = time.monotonic() - t_boot
            rec.phase(f"boot wave {index}", boot_s)
            for s in servers:
                if s.state == "up":
                    measure_one(s, rec, prompts, sampling, left, out, sweep=s.cfg.name not in fb.SCRIPTED_CONFIGS)
                predictions()
                finish(rec, design, prompts.greedy)
            # the tools only where the chi-square rows and the patched sweep still fit after them
            sweep_need = boot_s + len(all_waves[1]) * SWEEP_SERVER_S if first and len(all_waves) > 1 else 0
            sweep_need += len([n for n in rec.samples if n not in rec.rows]) * CHISQ_ROWS_S if first else 0
            if first and deadline - time.monotonic() - sweep_need > LIMITS["quality"]:
                wave_tools({s.cfg.name: s for s in servers}, rec, out, env, args.python, args.ckpt,
                           lambda limit, keep=sweep_need: max(0.0, min(limit, deadline - time.monotonic() - keep)))
            elif first:
                rec.data["skipped"].append("the issue #22 tools (budget kept for the sweep)")
            for s in servers:
                s.stop()
                rec.data["servers"][s.cfg.name]["log_tail"] = s.log_tail(40)
            if first:  # the GPU is free: the predictions' end, the reference before every chi-square token
                predictions(wait_s=left(LIMITS["predict"]))
                chisq_reference(rec, out, env, args, left)
                finish(rec, design, prompts.greedy)
    finally:
        for child, _ in early_rows.values():
            if child.poll() is None:
                child.kill()
        for predictor in predictors:
            if predictor.running():
                predictor.proc.kill()
                rec.data["errors"][predictor.key] = f"killed unfinished at the end of the run (see {predictor.key}.log)"
        for servers in all_waves:
            for s in servers:
                s.stop()
                smoke_lib.trim_to_tail(s.log_path, 8 << 20)
    rec.data["sweep"] = sweep_table(rec.data["measurements"])
    rec.data["ablation_table"] = ablation_table(rec.data["measurements"])
    finish(rec, design, prompts.greedy)
    plot(rec.data, out / REPORT)
    rec.phase("total", time.monotonic() - t_start)
    failed = [name for name, c in rec.data["checks"].items() if not c["passed"]]
    log(f"checks: {len(rec.data['checks']) - len(failed)} passed, {len(failed)} failed" +
        "".join(f"\n  FAILED {name}" for name in failed))
    return 0 if rec.data["passed"] and not rec.data["errors"] else 1


def sweep_table(meas: Mapping[str, dict]) -> list[dict]:
    """Per server with a C1 measure: stack, k, tokens per step, ms per step, decode tok/s (the server's counters)."""
    rows = []
    for name, m in meas.items():
        if name in fb.SCRIPTED_VARIANTS or name in fb.SCRIPTED_HIGH_AGREE or name.startswith(fb.ABLATION_PREFIX):
            continue  # one k per stack in the sweep; a variant or an ablation is set against its k in the report
        c1 = m.get("c1") or {}
        if not c1.get("server_tpot_ms"):
            continue
        rows.append({"server": name, "stack": stack(name), "k": m.get("k", 0),
                     "tokens_per_step": c1["spec"]["tokens_per_step"], "ms_per_step": c1.get("ms_per_step"),
                     "decode_tok_s": c1.get("server_decode_tok_s"), "client_decode_tok_s": c1.get("client_decode_tok_s"),
                     **({"from_run": m["from_run"]} if "from_run" in m else {})})
    return sorted(rows, key=lambda r: (r["stack"], r["k"]))


def plot(data: dict, report: Path) -> None:
    """The sweep's PNG beside the report (none, with a warning, where matplotlib is missing: --plot-only later)."""
    title = f"MTP k sweep, scripted model, {(data.get('gpu') or {}).get('name', '?')}, {data['date'][:10]}"
    earlier = sorted({r["from_run"].split(" (")[0] for r in data["sweep"] if r.get("from_run")})
    if earlier:  # rows measured in other visits, perhaps on another machine
        title += f" (and {', '.join(Path(name).stem.removeprefix('scripted-h200-mtp-') for name in earlier)})"
    br.plot_sweep(data["sweep"], title, report.with_suffix(".png"))


def default_sampling(ckpt: Path) -> dict:
    """The checkpoint's generation_config sampling, which vLLM applies to requests that set none."""
    gen = json.loads((ckpt / "generation_config.json").read_text())
    return {"temperature": float(gen["temperature"]), "top_k": int(gen["top_k"]), "top_p": float(gen["top_p"])}


def draft_tokens(cmd: fb.ServerCommand) -> int:
    """The server's k (0: no speculation)."""
    spec = speculative_config(cmd)
    return 0 if spec is None else int(spec["num_speculative_tokens"])


@dataclass(frozen=True)
class Prompts:
    greedy: list[dict]
    sampled: list[list[int]]
    c1: list[list[int]]
    chisq: list[list[int]]
    prefix: list[int]


def make_prompts(design) -> Prompts:
    from qwen_serving.checkpoint import scripted

    segments = min(PREFIX_SEGMENTS, len(design.active) // PREFIX_SEGMENT_LEN)  # the tiny cycle holds 4
    prefix = scripted.quoting_prompt(design, SEEDS["prefix"], segments=segments, segment_len=PREFIX_SEGMENT_LEN)
    return Prompts(greedy=prompts_for(design, "greedy", GREEDY_PROMPTS),
                   sampled=[p["ids"] for p in prompts_for(design, "sampled", SAMPLED_REQUESTS)],
                   c1=[p["ids"] for p in prompts_for(design, "c1", C1_REQUESTS)],
                   chisq=chisq_prompts(design), prefix=prefix["ids"])


def measure_one(server: run_full.Server, rec: Record, prompts: Prompts, sampling: dict,
                left: Callable[[float], float], out: Path, sweep: bool = False) -> None:
    """greedy, then (speculating servers) the sampled batch, then C1, then the server's EXTRA_PARTS; each part
    recorded as it ends. A sweep server sends two C1 requests."""
    name = server.cfg.name
    client = serving.Client(server.url)
    model = fb.SERVED_NAME
    m = rec.data["measurements"].setdefault(name, {})
    m["draft_sample"] = draft_sample(server.cmd)
    m["k"] = draft_tokens(server.cmd)
    c1 = prompts.c1[:2] if sweep else prompts.c1
    parts: list[tuple[str, Callable[[], dict]]] = [
        ("greedy", lambda: measure_greedy(client, model, [p["ids"] for p in prompts.greedy]))]
    if m["draft_sample"] and files(name) != "high":  # the high copy has no prediction to set it against
        parts.append(("sampled", lambda: measure_sampled(client, model, prompts.sampled, sampling)))
    parts.append(("c1", lambda: measure_c1(client, model, c1, sampling)))
    extra = {"chisq": lambda: measure_chisq(client, model, prompts.chisq),
             "prefix": lambda: measure_prefix(client, model, prompts.prefix),
             "profile": lambda: measure_profile(client, model, prompts.c1[0], sampling, out / f"traces-{name}",
                                                out / "profiles", name),
             "host": lambda: measure_host(server, client, model, prompts.c1[0], sampling, out / "profiles", name)}
    parts += [(part, extra[part]) for part in EXTRA_PARTS.get(name, ())]
    log(f"{name}: GPU before measuring (utilization, memory used): {run_full.gpu_state()}")
    for part, measure in parts:
        if budget_spent(rec, f"{name}: {part}", LIMITS[part], left, share=0.25):
            continue
        t0 = time.monotonic()
        try:
            m[part] = measure()
            if part == "greedy":
                rec.keep_traces(name, m[part].pop("traces"))
            elif part == "chisq":
                rec.keep_samples(name, prompts.chisq, m[part].pop("samples"))
        except Exception as err:  # a failed part is recorded; the other parts and servers still run
            rec.data["errors"][f"{name}: {part}"] = f"{type(err).__name__}: {str(err)[:1500]}"
        rec.phase(f"{name}: {part}", time.monotonic() - t0)
        log(f"{name}: {part} done after {time.monotonic() - t0:.0f} s")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path, nargs="?", help="where scripted-h200-mtp.json and the logs go")
    p.add_argument("--site", type=Path, default=Path("/tmp/site"), help="the staged stock stack (default %(default)s)")
    p.add_argument("--patched-site", type=Path, help="a folder holding the patched vllm package")
    p.add_argument("--ckpt", type=Path, default=Path("/tmp/qwen-scripted-full"),
                   help="stock's checkpoint, generated here if missing (default %(default)s)")
    p.add_argument("--prepared-ckpt", type=Path, default=Path("/tmp/qwen-scripted-full-prepared"),
                   help="the patched servers' prepared copy, made here if missing (default %(default)s)")
    p.add_argument("--agree", type=float, default=DEFAULT_AGREE, help="--mtp-agree of the checkpoint (%(default)s)")
    p.add_argument("--high-agree", type=float, default=HIGH_AGREE,
                   help="--mtp-agree of the high-agreement copy (%(default)s; 0: no copy, no server on it)")
    p.add_argument("--high-ckpt", type=Path, default=Path(f"/tmp/qwen-scripted-full-agree{round(HIGH_AGREE * 100)}"),
                   help="where the high-agreement copy is made (hard links beside --ckpt; default %(default)s)")
    p.add_argument("--high-prepared-ckpt", type=Path,
                   default=Path(f"/tmp/qwen-scripted-full-agree{round(HIGH_AGREE * 100)}-prepared"),
                   help="its prepared copy (default %(default)s)")
    p.add_argument("--coverage", type=float, default=DEFAULT_COVERAGE,
                   help="--draft-coverage of the checkpoint (%(default)s)")
    p.add_argument("--only", choices=("checkpoint", "prepare"),
                   help="make the checkpoint (and with `prepare` its prepared copy), then stop")
    p.add_argument("--base-port", type=int, default=18060, help="server i listens on base + i")
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--device", default="cuda", help="where the prediction runs (default %(default)s)")
    p.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S, help="the whole run (default %(default)s)")
    p.add_argument("--predict", type=Path, metavar="FILE", help="only write the prediction for --ckpt to FILE")
    p.add_argument("--chisq-rows", type=Path, nargs=2, metavar=("SAMPLES", "FILE"),
                   help="only write the reference before every token of a chi-square run's SAMPLES to FILE")
    p.add_argument("--dry-run", action="store_true", help="print every server command, start nothing")
    p.add_argument("--from-run", type=Path, metavar="REPORT",
                   help="the measurements and answers of --from-run-servers from an earlier run's REPORT (bench/results "
                        "keeps them beside it): those are not booted again")
    p.add_argument("--plot-only", type=Path, metavar="REPORT",
                   help="only the sweep's PNG beside REPORT, and its markdown table on stdout")
    p.add_argument("--from-run-servers", type=lambda v: v.split(","), default=list(FROM_RUN_SERVERS),
                   help="the servers --from-run takes, comma-separated (default %(default)s)")
    p.add_argument("--rejudge", action="store_true", help="judge OUT's finished run again from its files (CPU)")
    p.add_argument("--ablate", type=lambda v: [x for x in v.split(",") if x], default=[], metavar="PATCH[,PATCH]",
                   help="patches of patches/series to measure by their absence: per patch the plan at k=4 served from "
                        "a vllm copy without it, beside the plan's own k=4 server (which must then boot here)")
    p.add_argument("--ablate-root", type=Path, default=Path("/tmp/ablate"),
                   help="where the ablation copies of vllm are made (default %(default)s)")
    args = p.parse_args(argv)
    if args.ablate:  # the series is read only when asked for (every child process parses these arguments)
        check_ablations(p, args)
    child = (args.predict is not None or args.chisq_rows is not None or args.only is not None or args.rejudge
             or args.plot_only is not None)
    if (args.only or args.rejudge) and args.out is None:
        p.error("--only and --rejudge need OUT")
    if not child and args.out is None:
        p.error("OUT is required (or --predict FILE, or --chisq-rows SAMPLES FILE)")
    if not child and not args.dry_run:
        if not args.patched_site or not (args.patched_site / "vllm" / "__init__.py").is_file():
            p.error("--patched-site must name a folder holding the patched vllm package")
    return args


def check_ablations(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    series = [patch.name for patch in patchset.read_series(patchset.DEFAULT_SERIES)]
    unknown = [patch for patch in args.ablate if patch not in series]
    if unknown:
        p.error(f"--ablate {','.join(unknown)}: not in {patchset.DEFAULT_SERIES} ({', '.join(series)})")
    if args.from_run and ABLATION_BASE in args.from_run_servers:
        p.error(f"--ablate measures a patch beside the plan's own k=4 server: leave {ABLATION_BASE} out of "
                "--from-run-servers")
    beside = server_gib(fb.SCRIPTED_CONFIGS[ABLATION_BASE]) + sum(
        server_gib(fb.scripted_ablation(patch)) for patch in args.ablate)
    bound = run_full.bound_gib()  # on the device: the lent card's (an H100 holds fewer than the H200)
    if beside > bound:
        p.error(f"--ablate: {len(args.ablate)} ablations and the plan's k=4 server need ~{beside:.0f} GiB, more than "
                f"one wave's {bound} on this card: ablate fewer patches per run")


def make_only(args: argparse.Namespace) -> int:
    """--only: the checkpoint (and the prepared copy), as the run itself would make them; a one-line verdict."""
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(args.site), str(REPO)])}
    deadline = time.monotonic() + args.budget_s

    def left(limit: float) -> float:
        return max(0.0, min(limit, deadline - time.monotonic()))

    try:
        made = make_checkpoint(args, env, out, left)
        if args.only == "prepare":
            made["prepared"] = prepare_copy(args, env, out, left)
            if args.high_agree:
                made["high_agree"] = make_high_copy(args, env, out, left)
    except CheckpointError as err:
        log(f"--only {args.only}: {err}")
        return 1
    log(f"--only {args.only}: " + json.dumps(made))
    return 0


def rejudge(out: Path) -> int:
    """--rejudge: every check again from a run's files in OUT (the report, the greedy answers, the chi-square
    samples and rows beside it), on any machine, after a rule changed; the design is read from the checkpoint where
    it is still there, else made again from the dials the report records (make_design is deterministic). The report
    is rewritten with the new checks and a note."""
    from qwen_serving.checkpoint import scripted

    path = out / REPORT
    rec = Record(path, json.loads(path.read_text()))
    made = rec.data["checkpoint"]
    if (Path(made["dir"]) / scripted.DESIGN_FILE).is_file():
        design = scripted.Design.read(made["dir"])
    else:
        design = scripted.make_design("full", CHECKPOINT_SEED, made["mtp_agree"], made["draft_coverage"])
    for name in rec.data["measurements"]:
        greedy, samples, rows = (out / f"{name}-{part}.json" for part in ("greedy", "chisq-samples", "chisq-rows"))
        if greedy.is_file():
            rec.traces[name] = [smoke_lib.GreedyTrace.from_record(r) for r in json.loads(greedy.read_text())]
        if samples.is_file() and rows.is_file():
            rec.samples[name] = json.loads(samples.read_text())["samples"]
            rec.rows[name] = [[{int(t): p for t, p in row} for row in seq] for seq in json.loads(rows.read_text())]
    before = {name for name, c in rec.data["checks"].items() if c["passed"]}
    passed = finish(rec, design, make_prompts(design).greedy)
    changed = sorted(name for name, c in rec.data["checks"].items() if c["passed"] != (name in before))
    rec.data.setdefault("notes", []).append(
        f"checks judged again by --rejudge on {datetime.now(UTC).date()}; changed: {changed or 'none'}")
    rec.save()
    log(f"rejudged: {'passed' if passed else 'failed'}; changed: {changed or 'none'}")
    return 0 if passed else 1


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.predict:
        serving.write_json_atomic(args.predict, predict(args.ckpt, args.device))
        return 0
    if args.chisq_rows:
        samples, target = args.chisq_rows
        rows = chisq_rows(args.ckpt, samples, args.device)
        serving.write_json_atomic(target, [[[[t, p] for t, p in row.items()] for row in seq] for seq in rows])
        return 0
    if args.only:
        return make_only(args)
    if args.rejudge:
        return rejudge(args.out.resolve())
    if args.plot_only:
        data = json.loads(args.plot_only.read_text())
        plot(data, args.plot_only)
        print(br.sweep_markdown(data["sweep"]))
        return 0
    if args.dry_run:
        for i, wave in enumerate(waves(args, args.out.resolve(), args.from_run_servers if args.from_run else ())):
            print(f"## wave {i}: {len(wave)} servers, ~{sum(server_gib(s.cfg) for s in wave):.1f} of "
                  f"{run_full.BOUND_GIB} GiB")
            for s in wave:
                print(f"# {s.cfg.name} (port {s.port}): {s.cfg.what}\nPYTHONPATH={s.pythonpath} {s.cmd.shell()}")
        return 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a kill still stops the servers
    return run(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
