"""The full-shape GPU flow's configurations (bench/gpu/run_full.py): what each server runs and what is
measured against it. Pure data and argv building, so the CPU tests can check every command.

Every server is a serve plan (qwen_serving.plan.build: the product's own knobs and checks) plus a short, explicit
list of what a plan cannot say: stock vLLM has none of our patches, so it gets none of the plan's exports; flags
the stock reference launch left to vLLM are dropped again (`vllm_defaults`); every server gets the model path
and port, Marlin forced (the RTX 3090's kernel) unless the config says otherwise, and /server_info.

Servers of one call start together and share the GPU while they boot (they boot in ~4 min each, and
the device time is scarce); they are measured one after the other once all are up, with nothing else
on the GPU. Sharing needs every server to skip vLLM's memory profiling: each gets a fixed KV pool
(KV_MEM) and a low `--gpu-memory-utilization`, which then only gates the free-memory check at start, and the
torch profiler (idle until step_profile.py starts it). Neither changes a decode step: the pool only has to
seat the largest cohort.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from qwen_serving import plan

GB = 10**9
SERVED_NAME = "qwen3.8-27b"  # the plan's --served-model-name
MAX_LEN = 40960
SHARED_UTIL = 0.2  # the free-memory check at start only: every pool is fixed by KV_MEM
# The stock figures of issue #4 (stock vLLM 0.28.0, H200, Marlin forced, random prompts, vllm bench serve),
# each in the report field that measures the same thing: C1 as a decode rate (1000 / mean TPOT), C64 as
# vllm bench serve's output throughput; both with their mean TPOT.
REFERENCE = {"C1": {"decode_tok_s": 117.8, "tpot_ms": 8.49}, "C64": {"e2e_output_tok_s": 3024.0, "tpot_ms": 18.7}}
REFERENCE_MACHETE = {"C1": {"decode_tok_s": 100.8}}  # the same server on vLLM's default kernel for sm90
REPRODUCE_WITHIN = 0.05
NOTE_RANDOM = ("Random weights: draft acceptance and tokens per step mean nothing here; compare ms_per_step of the "
               "mtp configs with the plain config (the cost of a k-draft verify step against a decode step).")
# What a config runs, in this order (see runs_for):
#   single: harness single (C1/C2/C4/C8 over the real prompts);  single-c1: harness C1, 4 prompts
#   batch: harness batch (C64, 128 in / 512 out);  repeat: the second run of C1 (as single-c1) and of batch,
#   each where the config runs it
#   context: harness --prefill --long (prefill tok/s at 1k/4k/16k, C1 decode at 8k/16k/32k), after one C1 answer
#   ladder: conc_ladder 1/2/4/8 streams;  steps: step_profile C1 and C64;  api: api_smoke
RUN_KINDS = ("single", "single-c1", "batch", "repeat", "context", "ladder", "steps", "api")
# Every server: vLLM's sampler without FlashInfer (not shipped to the test machine), /server_info on (the
# harness records the engine config from it).
SERVER_ENV = {"VLLM_USE_FLASHINFER_SAMPLER": "0", "VLLM_SERVER_DEV_MODE": "1"}
# The single-user plan's 2048-token prefill chunk is the product's choice for a 24 GB card; the stock reference
# ran vLLM's own default (8192 on the H200, recorded in bench/results/h200-full-stock-single.json).
VLLM_CHUNK = ("--max-num-batched-tokens",)


@dataclass(frozen=True)
class BenchConfig:
    name: str
    patched: bool  # False: stock vLLM 0.28.0, which reads none of the plan's exports
    knobs: Mapping[str, str] = field(default_factory=dict)  # the plan's knob values (README's table)
    mode: str = "single"  # the plan's mode
    vllm_defaults: Sequence[str] = VLLM_CHUNK  # plan flags dropped again, leaving vLLM's own default
    shared_start: bool = True  # False: vLLM's own memory profiling and defaults, so it must boot alone
    marlin_forced: bool = True  # False: vLLM picks the kernel (Machete on sm90)
    reference: Mapping[str, Mapping[str, float]] | None = None  # figures to reproduce (reference_check)
    runs: tuple[str, ...] = ("single-c1",)
    what: str = ""
    max_len: int | None = MAX_LEN  # None: the plan's own MAX_LEN for the config's knobs
    extra_args: tuple[str, ...] = ()  # vllm serve flags no knob names, through EXTRA_ARGS


# The stock flags as plan knobs: no tool parser, the checkpoint's fp32 recurrent state (what vLLM's `auto` picks
# for it), no speculation; prefix caching stays on (0.28.0's default for hybrids, mamba cache mode align), CTX=fast
# names the bf16 KV cache on FlashAttention that vLLM picks on sm90, ASYNC_SCHED=1 what it picks for these.
STOCK = {"TOOLS": "0", "STATE_DTYPE": "float32", "SPEC": "off"}


# vLLM's FlashAttention 2, the 3090's: on sm90 vLLM runs FA3, where the attention hooks stand aside
# (qwen_serving/engine/attn_routing.py), so the H200 takes this to run the kernels a 3090 runs.
FA2 = ("--attention-config.flash_attn_version=2",)


def _pool(kv_gb: int, seats: int) -> dict[str, str]:
    return {"KV_MEM": str(kv_gb * GB), "MAX_SEQS": str(seats)}


def _mtp(k: int) -> dict[str, str]:
    # greedy drafts: vLLM's default draft_sample_method, as the stock runs had it
    return {"SPEC": "mtp", "DRAFT_TOKENS": str(k), "DRAFT_SAMPLE": "greedy"}


# Pools: stock keeps vLLM's fp32 recurrent state (the checkpoint's mamba_ssm_dtype); with prefix caching on, one
# request holds 3 GDN groups x 2 state blocks of 51 MB (memory.CacheShape). 28 GB seats 77 requests of 640 tokens;
# 8 GB seats 7 MTP requests, and holds one MAX_LEN request; 16 GB with fp16 state seats 76. vLLM 0.28.0 refuses
# more seats than the pool has GDN state blocks (CUDA graphs), so every pool names its seats.
CONFIGS: dict[str, BenchConfig] = {c.name: c for c in (
    BenchConfig("stock", False, {**STOCK, **_pool(28, 128)}, runs=("single", "batch", "repeat", "ladder", "steps"),
                reference=REFERENCE, what="stock vLLM 0.28.0, no speculation: the reference figures"),
    BenchConfig("stock-ref", False, {**STOCK, "KV_MEM": "", "GPU_UTIL": "0.9"},
                vllm_defaults=(*VLLM_CHUNK, "--max-num-seqs"), runs=("single-c1", "batch", "repeat"),
                shared_start=False, reference=REFERENCE,
                what="stock exactly as the issue's reference was launched (utilization 0.9, vLLM's default seats, "
                     "no profiler); boots alone"),
    BenchConfig("stock-mtp4", False, {**STOCK, **_pool(8, 16), **_mtp(4)}, what="stock, MTP k=4: the cost of a verify step"),
    BenchConfig("stock-mtp7", False, {**STOCK, **_pool(8, 16), **_mtp(7)}, what="stock, MTP k=7: the cost of a verify step"),
    BenchConfig("stock-machete", False, {**STOCK, **_pool(4, 16)}, runs=("single-c1", "repeat"), marlin_forced=False,
                reference=REFERENCE_MACHETE, what="stock on vLLM's own choice of kernel (Machete on the H200)"),
    BenchConfig("stock-fp16state", False, {**STOCK, **_pool(16, 128), "STATE_DTYPE": "float16"},
                runs=("single-c1", "batch", "repeat", "steps", "api"), reference=REFERENCE,
                what="stock with the GDN state in fp16 (half its traffic): the state's share of a C64 step, the "
                     "reference figures if the reference server kept a 16-bit state, and the API without a tool "
                     "parser (one can take a random answer for a call)"),
    BenchConfig("patched-defaults", True, {**STOCK, **_pool(28, 128)}, runs=("single-c1", "batch", "context"),
                what="the patch series with the stock flags: patches at their defaults; prefill and long-context rates"),
    BenchConfig("patched-mtp4", True, {**STOCK, **_pool(8, 16), **_mtp(4)}, extra_args=FA2,
                what="patched, MTP k=4, verify attention on qwen_serving.engine.kernels.spec_attn (SPEC_ATTN=1, "
                     "on FlashAttention 2 as on a 3090)"),
    BenchConfig("patched-mtp7", True, {**STOCK, **_pool(8, 16), **_mtp(7)}, extra_args=FA2,
                what="patched, MTP k=7, verify attention on qwen_serving.engine.kernels.spec_attn (SPEC_ATTN=1, "
                     "on FlashAttention 2 as on a 3090)"),
    BenchConfig("patched-batch", True, {"KV_MEM": str(16 * GB)}, mode="batch", vllm_defaults=(),
                runs=("single-c1", "batch", "ladder", "steps", "api"),
                what="the serve plan's batch mode (W4A8 MLP GEMMs, fp16 state, fp8 KV, prefix cache, async)"),
)}


# The scripted checkpoint's servers (bench/gpu/scripted_mtp.py: speculation on accepted drafts, issue #16). A
# short context keeps the pools small, so a wave boots side by side. The first wave: stock without and with MTP
# k=4, the single-user plan without and with it; 16 seats each, for the chi-square batches (pools: each seats the
# 8 requests of the greedy batch at once, memory.CacheShape.residents at 260 + 512 tokens). Then a variant
# (SCRIPTED_VARIANTS) and the k sweep (SCRIPTED_SWEEP), each k's pair together (scripted_mtp.SWEEP_ORDER). Raw logits in the logprobs: the near-tie rule (tests/gpu/smoke_lib.py)
# reads logit gaps on the bf16 scale. The patched servers are the single-user plan as it stands (probabilistic
# drafts, fp16 state, its prefill chunk, the draft head when the checkpoint they serve has one:
# bench/gpu/scripted_mtp.py serves them the prepared copy), less the tool parser (its ijson dependency is staged
# separately, and no request here calls a tool).
SCRIPTED_MAX_LEN = 4096
RAW_LOGITS = ("--logprobs-mode", "raw_logits")
SCRIPTED_SWEEP_K = (1, 2, 3, 5, 6, 7)
PATCHED_SINGLE = {"TOOLS": "0"}


def _scripted(name: str, patched: bool, knobs: Mapping[str, str], what: str,
              extra_args: tuple[str, ...] = ()) -> BenchConfig:
    return BenchConfig(name, patched, knobs, vllm_defaults=VLLM_CHUNK if not patched else (), runs=(),
                       max_len=SCRIPTED_MAX_LEN, extra_args=RAW_LOGITS + extra_args, what=what)


def _patched_mtp(k: int) -> dict[str, str]:
    return {**PATCHED_SINGLE, "DRAFT_TOKENS": str(k)}


SCRIPTED_CONFIGS: dict[str, BenchConfig] = {c.name: c for c in (
    _scripted("scripted-stock", False, {**STOCK, **_pool(8, 16)}, "stock vLLM 0.28.0, no speculation: the greedy baseline"),
    _scripted("scripted-stock-mtp4", False, {**STOCK, **_pool(12, 16), **_mtp(4)}, "stock, MTP k=4, greedy drafts"),
    _scripted("scripted-patched-plain", True, {**PATCHED_SINGLE, "SPEC": "off", **_pool(6, 16)},
              "the single-user plan without speculation: the plain decode step its verify step is set against"),
    _scripted("scripted-patched-mtp4", True, {**_patched_mtp(4), **_pool(8, 16)},
              "the patch series as the single-user plan runs it: MTP k=4, probabilistic drafts"),
)}
# Beside the sweep: the plan at k=4 on FlashAttention 2, so the split-KV verify kernel runs as on a 3090 (on the
# H200 the plan's own servers verify on FA3), to set its step cost and CUDA-graph memory against FA3's in situ
# (visit 9, kernel on under FA3: our k=4 server's graphs took 6.8 GiB, stock's 0.4).
SCRIPTED_VARIANTS: dict[str, BenchConfig] = {c.name: c for c in (
    _scripted("scripted-patched-mtp4-fa2", True, {**_patched_mtp(4), **_pool(5, 8)},
              "the single-user plan, MTP k=4, on FlashAttention 2 with the split-KV verify kernel (a 3090's path)",
              extra_args=FA2),
)}
# After the sweep: the plan at k=4 on the checkpoint's copy whose MTP agrees more often (--mtp-agree
# SCRIPTED_HIGH_MTP_AGREE, the same target: bench/gpu/scripted_mtp.py makes it), so that greedy identity is shown
# where most drafts are accepted
SCRIPTED_HIGH_MTP_AGREE = 0.9
SCRIPTED_HIGH_AGREE: dict[str, BenchConfig] = {c.name: c for c in (
    _scripted(f"scripted-patched-mtp4-agree{round(SCRIPTED_HIGH_MTP_AGREE * 100)}", True,
              {**_patched_mtp(4), **_pool(5, 8)},
              f"the single-user plan, MTP k=4, on the high-agreement copy (--mtp-agree {SCRIPTED_HIGH_MTP_AGREE})"),
)}
# Ablations (scripted_mtp.py --ablate PATCH): the plan at k=4 served from a vllm copy with the series less one patch,
# booted in the plan's own k=4 server's wave, so that what the patch buys is a difference within one machine
ABLATION_PREFIX = "scripted-patched-mtp4-without-"


def scripted_ablation(patch: str) -> BenchConfig:
    return _scripted(f"{ABLATION_PREFIX}{patch.removesuffix('.patch')}", True, {**_patched_mtp(4), **_pool(5, 8)},
                     f"the single-user plan, MTP k=4, without {patch} (beside the plan's own k=4 server)")


# the smallest pool (GB) that seats the greedy batch at each k (bench/gpu/scripted_mtp.py packs the waves by memory)
SWEEP_POOL_GB = {"patched": {1: 3, 2: 4, 3: 4, 5: 6, 6: 7, 7: 8}, "stock": {1: 5, 2: 6, 3: 8, 5: 11, 6: 12, 7: 14}}
SCRIPTED_SWEEP: dict[str, BenchConfig] = {c.name: c for c in (
    *(_scripted(f"scripted-patched-mtp{k}", True, {**_patched_mtp(k), **_pool(SWEEP_POOL_GB["patched"][k], 8)},
                f"the single-user plan, MTP k={k}") for k in SCRIPTED_SWEEP_K),
    *(_scripted(f"scripted-stock-mtp{k}", False, {**STOCK, **_pool(SWEEP_POOL_GB["stock"][k], 8), **_mtp(k)},
                f"stock, MTP k={k}") for k in SCRIPTED_SWEEP_K),
)}


def profiler_config(traces: Path) -> str:
    """vLLM's torch profiler, idle until /start_profile; the API server's own trace is left out."""
    return json.dumps({"profiler": "torch", "torch_profiler_dir": str(traces), "torch_profiler_use_gzip": False,
                       "torch_profiler_with_stack": False, "ignore_frontend": True})


@dataclass(frozen=True)
class ServerCommand:
    argv: tuple[str, ...]
    env: Mapping[str, str]  # on top of the caller's environment

    def shell(self) -> str:
        exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        return f"{exports} {shlex.join(self.argv)}".strip()


def serve_plan(cfg: BenchConfig, *, ckpt: Path, port: int, traces: Path,
               probe: plan.Probe | None = None, will_create: Collection[str] = ()) -> plan.ServePlan:
    """The config's serve plan: its knobs plus what every server here shares (model, address, context length,
    Triton GDN prefill: no FlashInfer on the test machine) and, on a shared boot, the low utilization and the
    profiler. A refusal of the plan is a PlanError, as for any other serve plan. will_create: paths besides the
    checkpoint that the caller makes before the server starts (a generated drafter)."""
    knob_env = {"MODEL": str(ckpt), "HOST": "127.0.0.1", "PORT": str(port), "GDN_PREFILL": "triton", **cfg.knobs}
    if cfg.max_len is not None:
        knob_env["MAX_LEN"] = str(cfg.max_len)
    extra = list(cfg.extra_args)
    if cfg.shared_start:
        extra = ["--gpu-memory-utilization", str(SHARED_UTIL), "--profiler-config", profiler_config(traces), *extra]
    if extra:
        knob_env["EXTRA_ARGS"] = shlex.join(extra)
    # run_full generates the checkpoint after planning
    return plan.build(cfg.mode, knob_env, probe=probe, will_create={str(ckpt), *will_create})


def without_flags(argv: Sequence[str], flags: Sequence[str]) -> list[str]:
    """argv less each of `flags` and its value; a flag that is not there is an error (the override is stale)."""
    out = list(argv)
    for flag in flags:
        if flag not in out:
            raise ValueError(f"{flag} is not in the plan's argv: nothing to leave to vLLM")
        at = out.index(flag)
        del out[at:at + 2]
    return out


def server_command(cfg: BenchConfig, *, python: str, ckpt: Path, port: int, traces: Path,
                   probe: plan.Probe | None = None, will_create: Collection[str] = ()) -> ServerCommand:
    """The vllm serve command of one config (module form: the test machine has no console script on PATH)."""
    served = serve_plan(cfg, ckpt=ckpt, port=port, traces=traces, probe=probe, will_create=will_create)
    return command_of(cfg, served, python=python)


def command_of(cfg: BenchConfig, served: plan.ServePlan, *, python: str) -> ServerCommand:
    """The vllm serve command of a config whose serve plan is built already (serve_plan)."""
    if served.argv[:2] != ("vllm", "serve"):
        raise ValueError(f"the {cfg.mode} plan does not start with `vllm serve`: {served.argv[:2]}")
    env = {**(served.env if cfg.patched else {}), **SERVER_ENV}
    if cfg.marlin_forced:
        env["VLLM_DISABLED_KERNELS"] = "MacheteLinearKernel"
    argv = (python, "-m", "vllm.entrypoints.cli.main", "serve", *without_flags(served.argv[2:], cfg.vllm_defaults))
    return ServerCommand(argv, env)


@dataclass(frozen=True)
class Run:
    part: str  # the report's file: h200-full-<config>-<part>.json
    argv: tuple[str, ...]


def runs_for(cfg: BenchConfig, *, python: str, repo: Path, url: str, out: Path, ckpt: Path, traces: Path) -> list[Run]:
    """The measurements of one config, in order, each writing OUT/h200-full-<config>-<part>.json (+ .png)."""
    bench = repo / "bench"
    tag = f"h200-full-{cfg.name}"

    def harness(part: str, *args: str) -> Run:
        return Run(part, (python, str(bench / "harness.py"), *args, "--tag", f"{tag}-{part}", "--url", url,
                          "--out", str(out), "--ignore-eos", "--note", NOTE_RANDOM, "--meta", f"config={cfg.name}",
                          "--force"))

    single_c1 = ("single", "--cohorts", "1", "--num-prompts", "4")
    runs: list[Run] = []
    for kind in cfg.runs:
        if kind == "single":
            runs.append(harness("single", "single"))
        elif kind == "single-c1":
            runs.append(harness("single", *single_c1))
        elif kind == "batch":
            runs.append(harness("batch", "batch"))
        elif kind == "repeat":
            if {"single", "single-c1"} & set(cfg.runs):
                runs.append(harness("single-run2", *single_c1))
            if "batch" in cfg.runs:
                runs.append(harness("batch-run2", "batch"))
        elif kind == "context":  # single mode always measures a cohort: one C1 answer, the shortest
            runs.append(harness("context", "single", "--cohorts", "1", "--num-prompts", "1", "--prefill", "--long"))
        elif kind == "ladder":
            runs.append(Run("ladder", (python, str(bench / "conc_ladder.py"), "--url", url,
                                       "--out", str(out / f"{tag}-ladder.json"))))
        elif kind == "steps":
            runs.append(Run("steps", (python, str(bench / "step_profile.py"), "--url", url, "--trace-dir", str(traces),
                                      "--model-dir", str(ckpt), "--out", str(out / f"{tag}-steps.json"))))
        elif kind == "api":
            runs.append(Run("api", (python, str(bench / "api_smoke.py"), "--url", url,
                                    "--json", str(out / f"{tag}-api.json"))))
        else:
            raise ValueError(f"{cfg.name}: unknown run kind {kind!r} (one of {', '.join(RUN_KINDS)})")
    return runs


def _cohort(report: Mapping | None, cohort: str) -> Mapping | None:
    return ((report or {}).get("cohorts") or {}).get(cohort)


def reference_check(parts: Mapping[str, Mapping | None], reference: Mapping[str, Mapping[str, float]]) -> dict:
    """A stock config's C1 and C64 against the reference figures, figure by figure: reproduced when every
    figure of both runs is within REPRODUCE_WITHIN of the reference.

    parts: the config's reports by part (single and single-run2 hold C1, batch and batch-run2 C64)."""
    sources = {"C1": ("single", "single-run2"), "C64": ("batch", "batch-run2")}
    check: dict = {"reference": dict(reference), "within": REPRODUCE_WITHIN, "runs": {}}
    ok = True
    for cohort in reference:
        names = sources[cohort]
        rows = []
        for name in names:
            fig = _cohort(parts.get(name), cohort)
            if fig is None:
                ok = False
                continue
            row: dict = {"run": name}
            for key, want in reference[cohort].items():
                got = float(fig["tpot_ms"]["mean"] if key == "tpot_ms" else fig[key])
                row[key] = got
                row[f"{key}_off_by"] = got / want - 1
                ok = ok and abs(got / want - 1) <= REPRODUCE_WITHIN
            rows.append(row)
        check["runs"][cohort] = rows
    check["reproduced"] = ok
    return check


def merge(config: str, serve_cmd: str, parts: Mapping[str, Mapping | None], errors: Mapping[str, str]) -> dict:
    """One config's figures in one JSON (h200-full-<config>.json)."""
    merged = {"config": config, "what": CONFIGS[config].what, "serve_cmd": serve_cmd, "note": NOTE_RANDOM,
              "errors": dict(errors), **{part: report for part, report in parts.items()}}
    if CONFIGS[config].reference:
        merged["reference_check"] = reference_check(parts, CONFIGS[config].reference)
    return merged
