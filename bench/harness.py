"""The serving harness behind bench/run_benchmarks.sh: `vllm bench serve` cohorts against a running
server, /metrics deltas around each call, one report JSON (+ PNG) in bench/results/.

The figures are computed by bench.report; this file only talks to the server, runs
`vllm bench serve` and writes files.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import report as br  # noqa: E402
from bench import serving  # noqa: E402

# vLLM's CLI, with the CPU shims on a machine without a GPU (a no-op on CUDA machines).
VLLM_CLI = ("from qwen_serving.engine import cpu_compat; cpu_compat.install(); "
            "from vllm.entrypoints.cli.main import main; main()")
WARMUP_SEED_OFFSET = 1_000_003  # far from the seeds of the measured runs (base seed + run index)
WARMUP_TOKEN_IDS = range(100, 4000)  # ordinary tokens in Qwen's vocabulary and in the tiny test checkpoints'


def metrics(base: str, key: str | None) -> br.MetricsSnapshot:
    return br.snapshot(serving.get_text(f"{base}/metrics", key=key, timeout_s=30))


def server_facts(base: str, key: str | None) -> dict:
    """What the server says about itself: version, model, cache config, and the full engine config
    when it runs with VLLM_SERVER_DEV_MODE=1 (/server_info)."""
    facts: dict = {"url": base}
    try:
        facts["vllm_version"] = serving.get_json(f"{base}/version", key=key, timeout_s=30).get("version")
    except serving.HttpError:
        facts["vllm_version"] = None
    model = serving.get_json(f"{base}/v1/models", key=key, timeout_s=30)["data"][0]
    facts["model"] = {k: model.get(k) for k in ("id", "root", "max_model_len")}
    facts["cache_config"] = metrics(base, key).cache_config
    try:
        info = serving.get_json(f"{base}/server_info?config_format=json", key=key, timeout_s=120)
    except serving.HttpError:  # 404 unless the server runs in dev mode
        info = None
    if info is not None:
        facts["vllm_config"] = info.get("vllm_config")
        facts["vllm_env"] = info.get("vllm_env")
        facts["system_env"] = info.get("system_env")
    else:
        facts["vllm_config"] = None
        facts["vllm_config_note"] = "start the server with VLLM_SERVER_DEV_MODE=1 to record its full config"
    return facts


def machine_facts() -> dict:
    facts = {"hostname": socket.gethostname(), "platform": platform.platform(), "python": platform.python_version(),
             "cpus": os.cpu_count(), "gpu": {}}
    query = "name,driver_version,memory.total,power.limit,clocks.max.sm,clocks.max.mem"
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30, check=True).stdout.strip().splitlines()
        facts["gpu"] = dict(zip(query.split(","), (v.strip() for v in out[0].split(",")), strict=True))
        facts["gpu_count"] = len(out)
    except (OSError, subprocess.SubprocessError, IndexError, ValueError):
        facts["gpu"] = {"name": "unknown (nvidia-smi not available here)"}
    try:
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
        facts["harness_commit"] = head + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        facts["harness_commit"] = None
    return facts


def bench_serve(run: br.RunSpec, args, base: str, key: str | None, seed: int, salt: str, workdir: str) -> dict:
    """One `vllm bench serve` call; its saved result. The model is looked up here, with the key."""
    listed = serving.Client(base, key).get_json("/v1/models")["data"][0]
    cmd = [sys.executable, "-c", VLLM_CLI, "bench", "serve"] + br.bench_serve_args(
        run, base_url=base, seed=seed, cache_salt=salt, result_dir=workdir, prompts_file=str(args.prompts),
        tokenizer=args.tokenizer, ignore_eos=args.ignore_eos, temperature=args.temperature,
        model=(listed["id"], listed["root"]))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    if key:
        env["OPENAI_API_KEY"] = key
    log_path = Path(workdir) / f"{run.name}.log"
    t0 = time.time()
    with open(log_path, "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env).returncode
    if rc != 0:
        tail = log_path.read_text(errors="replace")[-2000:]
        raise RuntimeError(f"vllm bench serve exited {rc} after {time.time() - t0:.0f} s; log tail:\n{tail}")
    return json.loads((Path(workdir) / f"{run.name}.json").read_text())


def warm_up(spec: br.RunSpec, args, base: str, key: str | None, seed: int, salt: str) -> None:
    """The unmeasured warm-up call, straight over HTTP (a second `vllm bench serve` would spend ~30 s
    starting): spec.num_prompts completions at once, prompts of the run's shape (random token ids of
    spec.input_len, or the prompts file's texts), spec.output_len tokens each, all under their own salt."""
    model = serving.Client(base, key).served_model()
    rng = random.Random(seed)
    if spec.dataset == "random":
        prompts = [[rng.choice(WARMUP_TOKEN_IDS) for _ in range(spec.input_len)] for _ in range(spec.num_prompts)]
    else:
        texts = [json.loads(line)["prompt"] for line in args.prompts.read_text().splitlines() if line.strip()]
        prompts = [texts[(i + seed) % len(texts)] for i in range(spec.num_prompts)]
    extra = {"ignore_eos": True} if args.ignore_eos else {}
    if args.temperature is not None:
        extra["temperature"] = args.temperature
    bodies = [{"model": model, "prompt": p, "max_tokens": spec.output_len, "cache_salt": salt, **extra}
              for p in prompts]
    with ThreadPoolExecutor(max_workers=spec.concurrency) as pool:
        list(pool.map(lambda b: serving.post_json(f"{base}/v1/completions", b, key=key), bodies))


def run_one(run: br.RunSpec, args, base: str, key: str | None, seed: int, workdir: str) -> dict:
    warmup = None
    if args.warmup:  # own seed and salt: nothing it sends can be served from the cache to the measured call
        spec, warm_seed = br.warmup_run(run), seed + WARMUP_SEED_OFFSET
        t0 = time.time()
        warm_up(spec, args, base, key, warm_seed, f"{args.tag}-{seed}-{spec.name}")
        warmup = {"num_prompts": spec.num_prompts, "output_len": spec.output_len, "seed": warm_seed,
                  "seconds": round(time.time() - t0, 2)}
    salt = f"{args.tag}-{seed}-{run.name}"
    before = metrics(base, key)
    raw = bench_serve(run, args, base, key, seed, salt, workdir)
    after = metrics(base, key)
    delta = br.metrics_delta(before, after)
    if run.section == "prefill":
        figures = br.prefill_figures(raw, run.input_len)
    else:
        figures = br.cohort_figures(raw, run.concurrency, delta)
    figures.update(seed=seed, cache_salt=salt, warmup=warmup, dataset=run.dataset, num_prompts=run.num_prompts,
                   output_len=run.output_len, input_len=run.input_len or None, vllm_bench_result=raw)
    return figures


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="run_benchmarks.sh",
        description="Benchmark a running vLLM server with `vllm bench serve`. single: C1/C2/C4/C8 over the 8 "
                    "prompts in bench/prompts_real.jsonl, 1,024-token answers. batch: C64, random 128 in / 512 out. "
                    "Decode rate = C x 1000 / mean TPOT. Writes bench/results/<tag>.json and <tag>.png.")
    p.add_argument("mode", choices=["single", "batch"])
    p.add_argument("--prefill", action="store_true", help="add prefill tok/s at 1k/4k/16k (one request at a time)")
    p.add_argument("--long", action="store_true", help="add C1 decode at 8k/16k/32k-token prompts")
    p.add_argument("--tag", help="report name (default: <mode>-<date>-<time>)")
    p.add_argument("--url", default="http://127.0.0.1:18020", help="server base URL (default %(default)s)")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results", help="report folder (default %(default)s)")
    p.add_argument("--cohorts", help="comma-separated concurrencies instead of the mode's default (e.g. 1,8)")
    p.add_argument("--num-prompts", type=int, help="requests per cohort (single: at most the prompts in the file)")
    p.add_argument("--prompts", type=Path, default=REPO / "bench" / "prompts_real.jsonl")
    p.add_argument("--tokenizer", help="tokenizer for vllm bench serve (default: the served model's path)")
    p.add_argument("--seed", type=int, help="base seed (default: from the clock); run i uses seed + i")
    p.add_argument("--temperature", type=float, help="0 = greedy (default: the model's own sampling defaults)")
    p.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="skip the unmeasured warm-up call before each run (same shapes, short answers)")
    p.add_argument("--ignore-eos", action="store_true", help="every answer runs to its full length (random weights)")
    p.add_argument("--api-key", help="default: $VLLM_API_KEY, else the first line of api_key.txt")
    p.add_argument("--note", action="append", default=[], help="a line stored in the report and printed under it")
    p.add_argument("--meta", action="append", default=[], metavar="KEY=VALUE", help="stored under report.meta")
    p.add_argument("--force", action="store_true", help="overwrite an existing report of the same tag")
    args = p.parse_args(argv)
    args.tag = args.tag or f"{args.mode}-{time.strftime('%Y%m%d-%H%M%S')}"
    if "/" in args.tag or args.tag.startswith("."):
        p.error(f"--tag {args.tag!r}: a plain file name please")
    bad_meta = [m for m in args.meta if "=" not in m]
    if bad_meta:
        p.error(f"--meta needs KEY=VALUE, got {bad_meta}")
    try:
        args.cohorts = tuple(int(c) for c in args.cohorts.split(",")) if args.cohorts else None
    except ValueError:
        p.error(f"--cohorts {args.cohorts!r}: comma-separated integers please")
    if args.cohorts and min(args.cohorts) < 1:
        p.error("--cohorts: concurrencies must be >= 1")
    if not args.prompts.is_file():
        p.error(f"--prompts {args.prompts}: no such file")
    args.url = args.url.rstrip("/").removesuffix("/v1")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    report_path = args.out / f"{args.tag}.json"
    if report_path.exists() and not args.force:
        print(f"run_benchmarks: {report_path} exists (pick another --tag, or --force)", file=sys.stderr)
        return 2
    prompts = [line for line in args.prompts.read_text().splitlines() if line.strip()]
    try:
        runs = br.plan_runs(args.mode, prefill=args.prefill, long=args.long, cohorts=args.cohorts,
                            num_prompts=args.num_prompts, prompts_in_file=len(prompts))
    except ValueError as e:
        print(f"run_benchmarks: {e}", file=sys.stderr)
        return 2
    key = serving.api_key(args.api_key)
    try:
        server = server_facts(args.url, key)
    except (OSError, RuntimeError, ValueError, KeyError, IndexError) as e:
        print(f"run_benchmarks: no usable vLLM server at {args.url}: {e}", file=sys.stderr)
        return 3
    max_len = server["model"].get("max_model_len") or 0
    seed = args.seed if args.seed is not None else int(time.time()) % 2**31
    sections: dict[str, dict] = {"cohorts": {}, "prefill": {}, "long_context": {}}
    errors, notes = {}, list(args.note)
    machine, started = machine_facts(), time.strftime("%Y-%m-%dT%H:%M:%S%z")

    def report(unfinished: list[str]) -> dict:
        run_notes = notes + ([f"unfinished: {', '.join(unfinished)} (the harness stopped before them)"]
                             if unfinished else [])
        if any(c.get("prefix_cache_hit_rate", 0) > 0.05 for c in sections["cohorts"].values()):
            run_notes.append("prefix-cache hits above 5% inside a cohort: prompts were served from the cache")
        return br.build_report(tag=args.tag, mode=args.mode, machine=machine, server=server,
                               runs={**{k: v for k, v in sections.items() if v}, "errors": errors,
                                     "meta": dict(m.split("=", 1) for m in args.meta), "date": started,
                                     "base_seed": seed}, notes=run_notes)

    with tempfile.TemporaryDirectory(prefix="qs-bench-") as workdir:
        for i, run in enumerate(runs):
            if run.input_len and max_len and run.input_len + run.output_len > max_len:
                notes.append(f"{run.name} skipped: {run.input_len}+{run.output_len} tokens > max_model_len {max_len}")
                print(f"[{i + 1}/{len(runs)}] {run.name}: skipped (max_model_len {max_len})", flush=True)
                continue
            print(f"[{i + 1}/{len(runs)}] {run.name}: C{run.concurrency}, {run.num_prompts} x {run.dataset} "
                  f"prompts, {run.output_len}-token answers ...", flush=True)
            t0 = time.time()
            try:
                fig = run_one(run, args, args.url, key, seed + i, workdir)
            except (OSError, RuntimeError, ValueError, KeyError) as e:
                errors[run.name] = str(e)
                print(f"    FAILED: {e}", file=sys.stderr, flush=True)
                continue
            sections[run.section][run.name] = fig
            headline = (f"{fig['prefill_tok_s']:.0f} prefill tok/s" if run.section == "prefill" else
                        f"{fig['decode_tok_s']:.1f} decode tok/s, {fig['tokens_per_step']:.2f} tokens/step, "
                        f"TTFT {fig['ttft_ms']['mean']:.0f} ms")
            print(f"    {headline} ({time.time() - t0:.0f} s)", flush=True)
            if i + 1 < len(runs):  # a harness stopped from outside keeps what it measured
                serving.write_json_atomic(report_path, report([r.name for r in runs[i + 1:]]))
    final = report([])
    serving.write_json_atomic(report_path, final)
    if sections["cohorts"] or sections["prefill"]:
        br.plot_report(final, report_path.with_suffix(".png"))
    print(br.summary_markdown(final))
    print(f"wrote {report_path}")
    if errors:
        print(f"run_benchmarks: {len(errors)} run(s) failed: {', '.join(errors)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
