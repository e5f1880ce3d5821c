"""The scripted DFlash2 drafter on the GPU (issue #16 item 2): vLLM's DFlash2 path against the prediction, one server.

Given the scripted `full` target and a scripted drafter (qwen_serving/checkpoint/scripted_dflash2.py; both
generated when missing), boots stock vLLM 0.28.0 through the product's plan with SPEC=dflash2 DRAFT=<drafter>
(`--speculative-config {"method": "dflash", "model": DRAFTER, "num_speculative_tokens": 7}`, V2 runner), then:

- greedy: 4 prompts x 512 tokens; every answer equals the designed chain, and vLLM's per-position acceptance
  (/metrics) equals the exact greedy walk of those answers (the drafter's follow map, read from its tensors);
- with --sampled: 16 requests at the checkpoint's default sampling; vLLM's per-position acceptance against the
  Markov prediction (predicted_acceptance), within 3 points.

    python bench/gpu/scripted_dflash2.py OUT --site SITE [--ckpt DIR] [--drafter DIR] [--agree Q] [--sampled]
    python bench/gpu/scripted_dflash2.py --predict FILE --ckpt DIR --drafter DIR [--device cuda]

OUT/scripted-h200-dflash2.json is rewritten after every phase. Prefix caching is off by default (PREFIX_CACHE=0;
--prefix-cache turns it on): upstream #55600 (V2 runner, DFlash2 + hybrid prefix caching) is open in stock
0.28.0 (patches/vllm-55600-v2-mamba-state-seed.patch fixes it in the series; not run on a GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "gpu"), str(Path(__file__).resolve().parent)]

import run_full  # noqa: E402
import scripted_mtp as sm  # noqa: E402
import smoke_lib  # noqa: E402

from bench import fullbench as fb  # noqa: E402
from bench import serving  # noqa: E402
from qwen_serving import plan  # noqa: E402

REPORT = "scripted-h200-dflash2.json"
SCHEMA = "qwen-serving scripted-dflash2/1"
DRAFTS = 7  # the drafter's block (8) less its anchor
DEFAULT_AGREE = 0.7
GREEDY_PROMPTS = 4
SAMPLED_REQUESTS = 16
LIMITS = {"synth": 240, "drafter": 240, "predict": 300, "boot": 420, "greedy": 120, "sampled": 180}
DEFAULT_BUDGET_S = 600


def log(msg: str) -> None:
    print(f"[dflash2 {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def config(drafter: Path, prefix_cache: bool) -> fb.BenchConfig:
    """Stock vLLM through the plan: SPEC=dflash2 with the scripted drafter, 4 seats on a fixed 8 GB pool."""
    # LOOKUP=0: the check is that acceptance is the drafter's own walk (stock reads no plan export anyway)
    knobs = {**fb.STOCK, **fb._pool(8, 4), "SPEC": "dflash2", "DRAFT": str(drafter), "DFLASH_TOKENS": str(DRAFTS),
             "PREFIX_CACHE": "1" if prefix_cache else "0", "LOOKUP": "0"}
    return fb.BenchConfig("scripted-stock-dflash2", False, knobs, runs=(), max_len=fb.SCRIPTED_MAX_LEN,
                          extra_args=fb.RAW_LOGITS, what="stock vLLM 0.28.0, DFlash2 (scripted drafter), V2 runner")


# ---------------------------------------------------------------- prediction (torch; the --predict child)


def predict(ckpt: Path, drafter_dir: Path, device: str) -> dict:
    import torch

    from qwen_serving.checkpoint import scripted_dflash2 as sd2
    from qwen_serving.checkpoint import scripted_reference as sr
    from qwen_serving.checkpoint.scripted import Design

    t0 = time.time()
    design = Design.read(ckpt)
    drafter = sd2.DraftReference(drafter_dir, ckpt, device)
    follow, margin = drafter.follow_map(design.active)
    ref = drafter.target
    columns = torch.tensor(design.active, device=ref.w.device)
    successor = ref.context_free_logits(design.active)[:, columns].argmax(-1).tolist()
    default = sr.Sampling(**sm.default_sampling(ckpt))
    return {
        "checkpoint": str(ckpt), "drafter": str(drafter_dir), "device": device,
        "agree": sd2.DrafterDesign.read(drafter_dir).agree, "selector_margin": margin, "default_sampling": vars(default),
        "acceptance_per_position": {"greedy": sd2.predicted_acceptance(drafter, design.active, sr.GREEDY),
                                    "default": sd2.predicted_acceptance(drafter, design.active, default)},
        # the context-free greedy successor and the drafter's next draft after each active token
        "greedy_successor": {str(t): design.active[j] for t, j in zip(design.active, successor, strict=True)},
        "proposal": {str(t): f for t, f in zip(design.active, follow, strict=True)},
        "seconds": round(time.time() - t0, 1),
    }


# ---------------------------------------------------------------- the run


def generate(args: argparse.Namespace, env: dict, out: Path, rec: sm.Record, left) -> bool:
    """The target and the drafter, each only when missing; False (and the error recorded) when one fails."""
    steps = []
    if not (args.ckpt / "config.json").exists():
        steps.append(("synth", [args.python, "-m", "qwen_serving.checkpoint.synth", "--size", "full", "--behaviour",
                                "scripted", "--seed", "0", "--out", str(args.ckpt)]))
    if not (args.drafter / "config.json").exists():
        steps.append(("drafter", [args.python, "-m", "qwen_serving.checkpoint.scripted_dflash2", str(args.ckpt),
                                  "--out", str(args.drafter), "--agree", str(args.agree), "--seed", "0"]))
    for name, argv in steps:
        t0 = time.monotonic()
        log(f"{name}: {' '.join(argv[2:])}")
        try:
            with open(out / f"{name}.log", "w") as f:
                subprocess.run(argv, cwd=REPO, env=env, check=True, timeout=left(LIMITS[name]) or 1,
                               stdout=f, stderr=subprocess.STDOUT)
        except subprocess.SubprocessError as err:
            rec.data["errors"][name] = f"{err} (see {name}.log)"
            return False
        rec.phase(name, time.monotonic() - t0)
    return True


def answer_walk_acceptance(answers: list[list[int]], proposal: dict[int, int], successor: dict[int, int],
                           k: int) -> dict:
    """vLLM's counters over greedy answers, whatever the target chose: each verify step drafts k chained
    proposals after the last emitted token, keeps them while they match the answer's next tokens, then emits one
    more; the first token comes from the prefill. A last step verifies past max_tokens (vLLM truncates the
    output after counting): there the answer is continued by the context-free greedy successor. On the designed
    chain this is scripted_mtp's greedy_walk_acceptance; off it, still what the drafter should score."""
    drafts, accepted = 0, [0] * k
    for answer in answers:
        extended = list(answer)
        for _ in range(k):
            extended.append(successor.get(extended[-1], -1))
        at = 0
        while at + 1 < len(answer):
            drafts += 1
            kept, draft = 0, answer[at]
            for j in range(k):
                draft = proposal.get(draft, -1)
                if draft != extended[at + 1 + j]:
                    break
                kept += 1
            for j in range(kept):
                accepted[j] += 1
            at += kept + 1
    return {"drafts": drafts, "acceptance_per_position": [a / drafts for a in accepted] if drafts else []}


def run_prediction(args: argparse.Namespace, env: dict, out: Path, timeout_s: float) -> dict:
    """The --predict child (torch on the GPU, beside the booting server); its JSON."""
    target = out / "prediction.json"
    target.unlink(missing_ok=True)
    with open(out / "prediction.log", "w") as f:
        subprocess.run([args.python, str(Path(__file__).resolve()), "--predict", str(target), "--ckpt", str(args.ckpt),
                        "--drafter", str(args.drafter), "--device", args.device], cwd=REPO, env=env, check=True,
                       timeout=timeout_s, stdout=f, stderr=subprocess.STDOUT)
    return json.loads(target.read_text())


def judge(rec: dict, traces, design, prompts: list[dict]) -> dict:
    pred, meas = rec.get("prediction") or {}, rec["measurements"]
    checks: dict = {}
    greedy = meas.get("greedy")
    if greedy and traces:
        checks["greedy answers are the designed chain"] = sm.chain_check(
            traces, [sm.expected_chain(design, p["ids"]) for p in prompts])
        if pred.get("proposal"):
            proposal = {int(t): v for t, v in pred["proposal"].items()}
            successor = {int(t): v for t, v in pred["greedy_successor"].items()}
            walk = answer_walk_acceptance([t.token_ids for t in traces], proposal, successor, DRAFTS)
            rec["prediction_greedy_walk"] = walk
            checks["greedy acceptance per position = the drafter's walk over the answers"] = sm.compare_acceptance(
                greedy["spec"]["per_position_acceptance"], walk["acceptance_per_position"])
            # a long generation's average (prediction) against these 4 x 512 tokens: recorded, not judged
            rec["greedy_against_markov"] = sm.compare_acceptance(greedy["spec"]["per_position_acceptance"],
                                                                 pred["acceptance_per_position"]["greedy"])
    sampled = meas.get("sampled")
    if sampled and pred.get("acceptance_per_position"):
        checks["default-sampling acceptance per position = prediction"] = sm.compare_acceptance(
            sampled["spec"]["per_position_acceptance"], pred["acceptance_per_position"]["default"])
    return checks


def run(args: argparse.Namespace) -> int:
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.budget_s

    def left(limit: float) -> float:
        return max(0.0, min(limit, deadline - time.monotonic()))

    env = {**os.environ, **smoke_lib.DEVICE_ENV, "PYTHONPATH": os.pathsep.join([str(args.site), str(REPO)])}
    rec = sm.Record(out / REPORT, {
        "schema": SCHEMA, "date": datetime.now(UTC).isoformat(timespec="seconds"), "gpu": smoke_lib.gpu_description(), "host_cpu": smoke_lib.host_cpu(),
        "versions": {"python": sys.version.split()[0], **smoke_lib.package_versions(smoke_lib.REPORTED_PACKAGES)},
        "checkpoint": str(args.ckpt), "drafter": str(args.drafter), "agree_asked": args.agree,
        "max_tokens": sm.MAX_TOKENS, "phases_s": {}, "prediction": None, "server": {}, "measurements": {},
        "checks": {}, "passed": False, "errors": {}})
    rec.save()
    t_start = time.monotonic()
    if not generate(args, env, out, rec, left):
        return 1
    from qwen_serving.checkpoint.scripted import Design

    design = Design.read(args.ckpt)
    prompts = sm.prompts_for(design, "greedy", GREEDY_PROMPTS)
    cfg = config(args.drafter, args.prefix_cache)
    cmd = fb.server_command(cfg, python=args.python, ckpt=args.ckpt, port=args.port, traces=out / "traces",
                            probe=plan.Probe.detect(REPO))
    server = run_full.Server(cfg, cmd, args.port, str(args.site), out / "server.log")
    rec.data["server"] = {"cmd": f"PYTHONPATH={args.site} {cmd.shell()}", "what": cfg.what}
    t_boot = time.monotonic()
    with ThreadPoolExecutor(max_workers=1) as pool:
        prediction = pool.submit(run_prediction, args, env, out, left(LIMITS["predict"]) or 1)
        try:
            (out / "traces").mkdir(exist_ok=True)
            server.start()
            run_full.wait_until_up([server], left(LIMITS["boot"]))
            rec.data["server"].update(state=server.state, boot_s=server.start_seconds)
            rec.phase("boot", time.monotonic() - t_boot)
            try:
                rec.data["prediction"] = prediction.result()
                log("prediction: " + json.dumps(rec.data["prediction"]["acceptance_per_position"]))
            except (subprocess.SubprocessError, OSError, ValueError) as err:
                rec.data["errors"]["prediction"] = f"{err} (see prediction.log)"
            if server.state == "up":
                measure(serving.Client(server.url), rec, prompts, args, left)
            rec.data["server"]["log_tail"] = server.log_tail(60)
        finally:
            server.stop()
            smoke_lib.trim_to_tail(server.log_path, 8 << 20)
    rec.data["checks"] = judge(rec.data, rec.traces.get("greedy"), design, prompts)
    rec.data["passed"] = bool(rec.data["checks"]) and all(c["passed"] for c in rec.data["checks"].values())
    rec.phase("total", time.monotonic() - t_start)
    failed = [name for name, c in rec.data["checks"].items() if not c["passed"]]
    log(f"checks: {len(rec.data['checks']) - len(failed)} passed, {len(failed)} failed"
        + "".join(f"\n  FAILED {name}" for name in failed))
    return 0 if rec.data["passed"] and not rec.data["errors"] else 1


def measure(client: serving.Client, rec: sm.Record, prompts: list[dict], args: argparse.Namespace, left) -> None:
    parts = [("greedy", lambda: sm.measure_greedy(client, fb.SERVED_NAME, [p["ids"] for p in prompts]))]
    if args.sampled:
        from qwen_serving.checkpoint.scripted import Design

        sampled = [p["ids"] for p in sm.prompts_for(Design.read(args.ckpt), "sampled", SAMPLED_REQUESTS)]
        parts.append(("sampled", lambda: sm.measure_sampled(client, fb.SERVED_NAME, sampled,
                                                            sm.default_sampling(args.ckpt))))
    for part, run_part in parts:
        if left(LIMITS[part]) < LIMITS[part] / 4:
            rec.data["errors"][part] = "skipped: run budget spent"
            continue
        t0 = time.monotonic()
        try:
            result = run_part()
            if part == "greedy":
                rec.keep_traces("greedy", result.pop("traces"))
            rec.data["measurements"][part] = result
        except Exception as err:  # recorded; the report still gets written
            rec.data["errors"][part] = f"{type(err).__name__}: {str(err)[:1500]}"
        rec.phase(part, time.monotonic() - t0)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path, nargs="?", help=f"where {REPORT} and the logs go")
    p.add_argument("--site", type=Path, default=Path("/tmp/site"), help="the staged stock stack (default %(default)s)")
    p.add_argument("--ckpt", type=Path, default=Path("/tmp/qwen-scripted-full"), help="generated here if missing")
    p.add_argument("--drafter", type=Path, default=Path("/tmp/qwen-scripted-dflash2"), help="generated if missing")
    p.add_argument("--agree", type=float, default=DEFAULT_AGREE, help="--agree of a generated drafter (%(default)s)")
    p.add_argument("--sampled", action="store_true", help="also measure acceptance at the default sampling")
    p.add_argument("--prefix-cache", action="store_true", help="PREFIX_CACHE=1 (upstream #55600 is open)")
    p.add_argument("--port", type=int, default=18090)
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--device", default="cuda", help="where the prediction runs (default %(default)s)")
    p.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S, help="the whole run (default %(default)s)")
    p.add_argument("--predict", type=Path, metavar="FILE", help="only write the prediction to FILE")
    p.add_argument("--dry-run", action="store_true", help="print the server command, start nothing")
    args = p.parse_args(argv)
    if args.predict is None and args.out is None and not args.dry_run:
        p.error("OUT is required (or --predict FILE)")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.predict:
        serving.write_json_atomic(args.predict, predict(args.ckpt, args.drafter, args.device))
        return 0
    if args.dry_run:
        cmd = fb.server_command(config(args.drafter, args.prefix_cache), python=args.python, ckpt=args.ckpt,
                                port=args.port, traces=Path("/tmp/traces"), probe=plan.Probe.detect(REPO))
        print(f"PYTHONPATH={args.site} {cmd.shell()}")
        return 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a kill still stops the server
    return run(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
