"""Speculative decoding on accepted drafts, measured on the scripted `full` checkpoint (issue #16 items 5 and 6,
one GPU run; bench/gpu/README.md). Stock vLLM 0.28.0 without speculation, stock with MTP k=4 and the patched
single-user plan with MTP k=4 (bench.fullbench.SCRIPTED_CONFIGS) boot together, then are measured one after the
other against what the checkpoint's weights predict:

- greedy: 8 prompts x 512 tokens, token-identical to no speculation (or measured near-ties), equal to the designed
  chain, top-20 raw logits within bf16 noise, and vLLM's per-position acceptance equal to the exact greedy walk;
- default sampling (the checkpoint's generation_config): per-position acceptance from vLLM's /metrics against
  the Markov prediction (greedy drafts for stock, vLLM's probabilistic drafts for the patched plan), within 3 points;
- C1: decode tok/s, tokens per step and ms per step, from streamed answers and the server's own counters.

    python bench/gpu/scripted_mtp.py OUT --site SITE --patched-site PATCHED --ckpt DIR [--agree Q]
    python bench/gpu/scripted_mtp.py --predict FILE --ckpt DIR [--device cuda]   # the prediction alone (torch)

OUT/scripted-h200-mtp.json is rewritten after every phase; each phase has its own time limit and the whole run
its budget (--budget-s), after which what is left is skipped and recorded as such.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "gpu"), str(Path(__file__).resolve().parent)]

import run_full  # noqa: E402
import smoke_lib  # noqa: E402

from bench import fullbench as fb  # noqa: E402
from bench import report as br  # noqa: E402
from bench import serving  # noqa: E402
from qwen_serving import plan  # noqa: E402

REPORT = "scripted-h200-mtp.json"
SCHEMA = "qwen-serving scripted-mtp/1"
# --mtp-agree of the generated checkpoint: q = 0.76 puts the full checkpoint's Markov prediction (greedy drafts, T 0.6,
# top-k 20, top-p 0.95, k = 4) at 0.740 / 0.510 / 0.360 / 0.252 per position, 2.86 tokens per step, against the spec's
# measured 74 / 50 / 34 / 24 % and 2.8-2.9 (computed from the design's logit table on the CPU; the run records the
# prediction from the written weights). a_i falls like (q p_chain)^i with p_chain = 0.924 at that sampling.
DEFAULT_AGREE = 0.76
K = 4
K_SWEEP = range(1, 8)
ACCEPTANCE_WITHIN = 0.03  # the bar: per position, measured vs predicted
GREEDY_PROMPTS = 8  # half quoting, half free
MAX_TOKENS = 512
TOP_LOGPROBS = smoke_lib.TIE_TOP_K
SAMPLED_REQUESTS, SAMPLED_CONCURRENCY = 32, 8
C1_REQUESTS = 3
SEEDS = {"greedy": 0, "sampled": 1000, "c1": 2000}  # prompt seeds: no prompt is sent twice to one server
TPOT = "vllm:request_time_per_output_token_seconds"
BASELINE = "scripted-stock"  # the greedy answers every speculating server is compared with
# time limits (s); budget: the whole run, from start to the last server stopped
LIMITS = {"synth": 420, "predict": 420, "boot": 600, "greedy": 240, "sampled": 300, "c1": 240, "stop": 60}
DEFAULT_BUDGET_S = 690  # the ~12-minute slot, less packing


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
    logits, vocab = ref.draft_logits(ref.mtp_step(design.active, hidden, positions))
    columns = {int(t): i for i, t in enumerate(vocab.tolist())}
    active = torch.tensor([columns[t] for t in design.active], device=logits.device)
    draft_probs = torch.softmax(logits.float() / default.temperature, -1)[:, active]
    del logits
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
        "seconds": round(time.time() - t0, 1),
    }


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


def compare_acceptance(measured: Sequence[float], predicted: Sequence[float], within: float = ACCEPTANCE_WITHIN) -> dict:
    """Per position: measured - predicted; passed when every position is within `within` (and both have k)."""
    diff = [m - p for m, p in zip(measured, predicted, strict=False)]
    ok = len(measured) == len(predicted) > 0 and all(abs(d) <= within for d in diff)
    return {"passed": ok, "measured": list(measured), "predicted": list(predicted), "difference": diff,
            "within": within}


def logit_agreement(runs_a: Sequence[smoke_lib.GreedyTrace], runs_b: Sequence[smoke_lib.GreedyTrace]) -> dict:
    """Top-20 raw logits of B against A at every position both answered from the same context, token by token
    (tokens in both lists): passed when each differs by at most smoke_lib.CEILING_ULPS bf16 steps at its value,
    the ceiling the near-tie rule allows (logits leave a bf16 lm_head, and a k+1-token verify step reduces its
    GEMMs in another order than a one-token decode step)."""
    worst, worst_ulps, compared, over = 0.0, 0.0, 0, []
    for prompt, (a, b) in enumerate(zip(runs_a, runs_b, strict=True)):
        split = smoke_lib.first_divergence(a.token_ids, b.token_ids)
        for position in range(len(a.token_ids) if split is None else split):
            for token, value in b.top[position].items():
                if token not in a.top[position]:
                    continue
                other = a.top[position][token]
                diff = abs(value - other)
                ulp = smoke_lib.bf16_ulp(max(abs(value), abs(other)))
                compared += 1
                worst = max(worst, diff)
                worst_ulps = max(worst_ulps, diff / ulp if ulp else 0.0)
                if diff > smoke_lib.CEILING_ULPS * ulp:
                    over.append({"prompt": prompt, "position": position, "token": token, "a": other, "b": value})
    return {"passed": compared > 0 and not over, "logits_compared": compared, "max_abs_diff": worst,
            "max_diff_bf16_ulps": worst_ulps, "tolerance_ulps": smoke_lib.CEILING_ULPS, "over": over[:20],
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


def draft_sample(cmd: fb.ServerCommand) -> str | None:
    """The server's draft_sample_method as vLLM is told it (None: no speculation)."""
    if "--speculative-config" not in cmd.argv:
        return None
    spec = json.loads(cmd.argv[cmd.argv.index("--speculative-config") + 1])
    return spec.get("draft_sample_method", "greedy")  # vLLM 0.28.0's default


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


# ---------------------------------------------------------------- the run


class Record:
    """The report, rewritten whole after every change (a cut run keeps what it measured)."""

    def __init__(self, path: Path, data: dict):
        self.path, self.data = path, data
        self.traces: dict[str, list[smoke_lib.GreedyTrace]] = {}  # greedy answers by server (own files: ~3 MB each)

    def keep_traces(self, name: str, records: list[dict]) -> None:
        self.traces[name] = [smoke_lib.GreedyTrace.from_record(r) for r in records]
        serving.write_json_atomic(self.path.with_name(f"{name}-greedy.json"), records)

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
    series = [line.strip() for line in (REPO / "patches" / "series").read_text().splitlines()
              if line.strip() and not line.startswith("#")]
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


def build_servers(args: argparse.Namespace, out: Path) -> list[run_full.Server]:
    servers = []
    for i, cfg in enumerate(fb.SCRIPTED_CONFIGS.values()):
        paths = [str(args.patched_site), str(args.site)] if cfg.patched else [str(args.site)]
        probe = plan.Probe.detect(REPO)  # the plan's vLLM facts are vllm_028's, whichever vllm the server runs
        cmd = fb.server_command(cfg, python=args.python, ckpt=args.ckpt, port=args.base_port + i,
                                traces=out / f"traces-{cfg.name}", probe=probe)
        servers.append(run_full.Server(cfg, cmd, args.base_port + i, os.pathsep.join(paths),
                                       out / f"{cfg.name}.server.log"))
    return servers


def judge(rec: dict, traces: Mapping[str, list[smoke_lib.GreedyTrace]], design, greedy_prompts: list[dict]) -> dict:
    """Every check that the measurements so far allow, with its numbers."""
    meas, pred = rec["measurements"], rec.get("prediction") or {}
    checks: dict = {}
    reference = traces.get(BASELINE)
    expected = [expected_chain(design, p["ids"]) for p in greedy_prompts]
    walk = None
    if pred.get("greedy_successor"):
        successor = {int(t): v for t, v in pred["greedy_successor"].items()}
        proposal = {int(t): v for t, v in pred["mtp_proposal"].items()}
        walk = greedy_walk_acceptance([successor[p["ids"][-1]] for p in greedy_prompts], successor, proposal, K,
                                      MAX_TOKENS)
        rec["prediction_greedy_walk"] = walk
    for name, m in meas.items():
        greedy = m.get("greedy")
        if greedy and name in traces:
            checks[f"{name}: greedy answers are the designed chain"] = chain_check(traces[name], expected)
            if reference and name != BASELINE:
                comparison = smoke_lib.compare_greedy(reference, traces[name])
                checks[f"{name}: greedy token-identical to no speculation"] = {
                    "passed": not comparison.unexplained, **comparison.summary()}
                checks[f"{name}: top-20 raw logits agree with no speculation"] = logit_agreement(reference,
                                                                                                 traces[name])
            if walk and greedy["spec"]["speculative"]:
                checks[f"{name}: greedy acceptance per position = the exact greedy walk"] = compare_acceptance(
                    greedy["spec"]["per_position_acceptance"], walk["acceptance_per_position"])
        sampled = m.get("sampled")
        if sampled and pred.get("acceptance_per_position"):
            which = f"default_{m['draft_sample']}_drafts"
            checks[f"{name}: default-sampling acceptance per position = prediction ({which})"] = compare_acceptance(
                sampled["spec"]["per_position_acceptance"], pred["acceptance_per_position"][which])
    return checks


def start_record(path: Path, args: argparse.Namespace, env: Mapping[str, str]) -> Record:
    patched_env = dict(env)
    if args.patched_site:
        patched_env["PYTHONPATH"] = os.pathsep.join([str(args.patched_site), env["PYTHONPATH"]])
    rec = Record(path, {
        "schema": SCHEMA, "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "gpu": smoke_lib.gpu_description(), "gpu_state_at_start": run_full.gpu_state(),
        "versions": {"python": sys.version.split()[0], **smoke_lib.package_versions(smoke_lib.REPORTED_PACKAGES)},
        "patches": patch_state(args.patched_site, args.python, patched_env),
        "checkpoint": {"dir": str(args.ckpt), "mtp_agree_asked": args.agree}, "k": K, "max_tokens": MAX_TOKENS,
        "acceptance_within": ACCEPTANCE_WITHIN, "budget_s": args.budget_s, "limits_s": LIMITS, "phases_s": {},
        "prediction": None, "servers": {}, "measurements": {}, "checks": {}, "passed": False, "skipped": [],
        "errors": {},
        "not_measured_here": ("chi-square of the sampled distribution (>= 1e5 tokens, and the reference's exact "
                              "distribution on every sampled context), servers for k = 1, 2, 3, 5, 7 (only their "
                              "predictions), prefix caching, the draft vocabulary"),
    })
    rec.save()
    return rec


def finish(rec: Record, design, greedy_prompts: list[dict]) -> bool:
    """The checks over everything measured; passed when there are some and all pass."""
    rec.data["checks"] = judge(rec.data, rec.traces, design, greedy_prompts)
    rec.data["passed"] = bool(rec.data["checks"]) and all(c["passed"] for c in rec.data["checks"].values())
    rec.save()
    return rec.data["passed"]


def run(args: argparse.Namespace) -> int:
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    deadline = t_start + args.budget_s

    def left(limit: float) -> float:
        return max(0.0, min(limit, deadline - time.monotonic()))

    env = {**os.environ, **smoke_lib.DEVICE_ENV, "PYTHONPATH": os.pathsep.join([str(args.site), str(REPO)])}
    rec = start_record(out / REPORT, args, env)

    # 1. the checkpoint
    t0 = time.monotonic()
    if not (args.ckpt / "config.json").exists():
        log(f"generating the scripted full checkpoint in {args.ckpt} (--mtp-agree {args.agree})")
        try:
            with open(out / "synth.log", "w") as synth_log:
                subprocess.run([args.python, "-m", "qwen_serving.checkpoint.synth", "--size", "full", "--behaviour",
                                "scripted", "--mtp-agree", str(args.agree), "--seed", "0", "--out", str(args.ckpt)],
                               cwd=REPO, env=env, check=True, timeout=left(LIMITS["synth"]) or 1,
                               stdout=synth_log, stderr=subprocess.STDOUT)
        except subprocess.SubprocessError as err:
            rec.data["errors"]["checkpoint"] = f"synth failed: {err} (see synth.log)"
            rec.phase("checkpoint", time.monotonic() - t0)
            return 1
        rec.data["checkpoint"]["generated"] = True
    from qwen_serving.checkpoint.scripted import Design

    design = Design.read(args.ckpt)
    greedy_prompts = prompts_for(design, "greedy", GREEDY_PROMPTS)
    rec.data["checkpoint"].update(mtp_agree=design.mtp_agree, hidden=design.hidden, active=len(design.active))
    if abs(design.mtp_agree - args.agree) > 1e-9:
        rec.data["errors"]["checkpoint"] = f"{args.ckpt} has --mtp-agree {design.mtp_agree}, not {args.agree}"
    rec.phase("checkpoint", time.monotonic() - t0)

    # 2. servers boot, and the prediction runs beside them
    servers = build_servers(args, out)
    predict_out = out / "prediction.json"
    predict_out.unlink(missing_ok=True)
    with open(out / "prediction.log", "w") as predict_log:
        predictor = subprocess.Popen([args.python, str(Path(__file__).resolve()), "--predict", str(predict_out),
                                      "--ckpt", str(args.ckpt), "--device", args.device],
                                     cwd=REPO, env=env, stdout=predict_log, stderr=subprocess.STDOUT)
    t_boot = time.monotonic()
    try:
        for s in servers:
            (out / f"traces-{s.cfg.name}").mkdir(exist_ok=True)
            rec.data["servers"][s.cfg.name] = {"cmd": f"PYTHONPATH={s.pythonpath} {s.cmd.shell()}",
                                               "what": s.cfg.what, "port": s.port}
            log(f"{s.cfg.name}: starting on port {s.port}")
            s.start()
        rec.save()
        try:
            predictor.wait(timeout=left(LIMITS["predict"]) or 1)
        except subprocess.TimeoutExpired:
            predictor.kill()
            predictor.wait(timeout=30)
        if predict_out.exists():
            rec.data["prediction"] = json.loads(predict_out.read_text())
            log("prediction: " + json.dumps(rec.data["prediction"]["acceptance_per_position"]))
        else:
            rec.data["errors"]["prediction"] = f"exit {predictor.returncode} (see prediction.log)"
        rec.phase("prediction", time.monotonic() - t_boot)
        run_full.wait_until_up(servers, left(LIMITS["boot"] - (time.monotonic() - t_boot)))
        for s in servers:
            rec.data["servers"][s.cfg.name].update(state=s.state, boot_s=s.start_seconds)
        rec.phase("boot", time.monotonic() - t_boot)

        # 3. one server after the other
        sampled_prompts = [p["ids"] for p in prompts_for(design, "sampled", SAMPLED_REQUESTS)]
        c1_prompts = [p["ids"] for p in prompts_for(design, "c1", C1_REQUESTS)]
        rec.data["prompts"] = {"greedy": [{k: p[k] for k in ("kind", "seed")} | {"tokens": len(p["ids"])}
                                          for p in greedy_prompts], "sampled": len(sampled_prompts),
                               "c1": len(c1_prompts), "max_tokens": MAX_TOKENS}
        sampling = default_sampling(args.ckpt)
        for s in servers:
            if s.state == "up":
                measure_one(s, rec, greedy_prompts, sampled_prompts, c1_prompts, sampling, left)
            s.stop()
            rec.data["servers"][s.cfg.name]["log_tail"] = s.log_tail(40)
            finish(rec, design, greedy_prompts)
    finally:
        if predictor.poll() is None:
            predictor.kill()
        for s in servers:
            s.stop()
            smoke_lib.trim_to_tail(s.log_path, 8 << 20)
    finish(rec, design, greedy_prompts)
    rec.phase("total", time.monotonic() - t_start)
    failed = [name for name, c in rec.data["checks"].items() if not c["passed"]]
    log(f"checks: {len(rec.data['checks']) - len(failed)} passed, {len(failed)} failed" +
        "".join(f"\n  FAILED {name}" for name in failed))
    return 0 if rec.data["passed"] and not rec.data["errors"] else 1


def default_sampling(ckpt: Path) -> dict:
    """The checkpoint's generation_config sampling, which vLLM applies to requests that set none."""
    gen = json.loads((ckpt / "generation_config.json").read_text())
    return {"temperature": float(gen["temperature"]), "top_k": int(gen["top_k"]), "top_p": float(gen["top_p"])}


def measure_one(server: run_full.Server, rec: Record, greedy_prompts: list[dict], sampled_prompts: list[list[int]],
                c1_prompts: list[list[int]], sampling: dict, left: Callable[[float], float]) -> None:
    """greedy, then (speculating servers) the sampled batch, then C1; each part recorded as it ends."""
    name = server.cfg.name
    client = serving.Client(server.url)
    model = fb.SERVED_NAME
    m = rec.data["measurements"].setdefault(name, {})
    m["draft_sample"] = draft_sample(server.cmd)
    parts: list[tuple[str, Callable[[], dict]]] = [
        ("greedy", lambda: measure_greedy(client, model, [p["ids"] for p in greedy_prompts]))]
    if m["draft_sample"]:
        parts.append(("sampled", lambda: measure_sampled(client, model, sampled_prompts, sampling)))
    parts.append(("c1", lambda: measure_c1(client, model, c1_prompts, sampling)))
    log(f"{name}: GPU before measuring (utilization, memory used): {run_full.gpu_state()}")
    for part, measure in parts:
        if left(LIMITS[part]) < LIMITS[part] / 4:
            rec.data["skipped"].append(f"{name}: {part} (run budget spent)")
            continue
        t0 = time.monotonic()
        try:
            m[part] = measure()
            if part == "greedy":
                rec.keep_traces(name, m[part].pop("traces"))
        except Exception as err:  # a failed part is recorded; the other parts and servers still run
            rec.data["errors"][f"{name}: {part}"] = f"{type(err).__name__}: {str(err)[:1500]}"
        rec.phase(f"{name}: {part}", time.monotonic() - t0)
        log(f"{name}: {part} done after {time.monotonic() - t0:.0f} s")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path, nargs="?", help="where scripted-h200-mtp.json and the logs go")
    p.add_argument("--site", type=Path, default=Path("/tmp/site"), help="the staged stock stack (default %(default)s)")
    p.add_argument("--patched-site", type=Path, help="a folder holding the patched vllm package")
    p.add_argument("--ckpt", type=Path, default=Path("/tmp/qwen-scripted-full"), help="generated here if missing")
    p.add_argument("--agree", type=float, default=DEFAULT_AGREE, help="--mtp-agree of the checkpoint (%(default)s)")
    p.add_argument("--base-port", type=int, default=18060, help="server i listens on base + i")
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--device", default="cuda", help="where the prediction runs (default %(default)s)")
    p.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S, help="the whole run (default %(default)s)")
    p.add_argument("--predict", type=Path, metavar="FILE", help="only write the prediction for --ckpt to FILE")
    p.add_argument("--dry-run", action="store_true", help="print every server command, start nothing")
    args = p.parse_args(argv)
    if args.predict is None and args.out is None:
        p.error("OUT is required (or --predict FILE)")
    if args.predict is None and not args.dry_run:
        if not args.patched_site or not (args.patched_site / "vllm" / "__init__.py").is_file():
            p.error("--patched-site must name a folder holding the patched vllm package")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.predict:
        serving.write_json_atomic(args.predict, predict(args.ckpt, args.device))
        return 0
    if args.dry_run:
        for s in build_servers(args, args.out.resolve()):
            print(f"# {s.cfg.name} (port {s.port}): {s.cfg.what}\nPYTHONPATH={s.pythonpath} {s.cmd.shell()}")
        return 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a kill still stops the servers
    return run(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
