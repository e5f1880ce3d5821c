"""The product's other plans on the scripted `full` checkpoint, in one GPU visit (issues #18 to #23): the
single-user and batch plans that never booted on a GPU (DFlash2 at 7 and 15 drafts with and without the lookup,
CTX=long, CTX=huge, VISION=1, the two launchers' defaults), each built by the product's plan
(bench.fullbench.server_command: `python -m qwen_serving.plan`'s argv) with its KV pool pinned to what the plan
leaves on a 24 GB card (the plan's own pin for SPEC=dflash2, else the memory model's KV_MEM=auto on a headless
24 GB card). Run in visits 13 and 14 (bench/README.md, "Product plans"). `mtp-long` (SPEC=mtp CTX=long: fp8 KV on
FlashInfer, issue #20 item 1) is planned only where tests/gpu/install-flashinfer.sh has installed FlashInfer beside the
stack (--flashinfer-site) and it imports (flashinfer_missing); elsewhere the report lists it under `not_tried` and
`skipped`, with why. Only that server gets FlashInfer's site on its PYTHONPATH and its bin on its PATH. Issue #19's two
configs (`single-fast`, `dflash2-w4a16`) serve drafters built on the device before any server boots (make_variants:
drafter/capture.py on the GPU, then drafter/quantize.py's GPTQ from the quant site tests/gpu/install-quant.sh
installs, --quant-site); where that site is not installed they are listed under `not_tried`.

Order (what a budget cut leaves out last to first):
1. every config boots (a boot is a Must-show): CONFIGS in priority order, packed first-fit into waves whose memory
   estimate (weights + CUDA graphs + pinned pool + overhead, `memory_gib`) stays within the card's bound
   (run_full.bound_gib: BOUND_GIB on the H200, less on a smaller card); a later wave is
   packed again from the boot facts of the servers already up (their measured weights and graphs per class);
2. per server, one at a time, the cheap checks (CHEAP): the pool in tokens from the log against the memory model,
   greedy answers (8 prompts x 512 tokens) against the designed chain and, within #18's group, token-identical
   across LOOKUP, DFLASH_TOKENS and no speculation (visit 9's answers), api_smoke;
3. the expensive parts (EXPENSIVE_ORDER): the 25k-token quote at DFLASH_TOKENS=15/7 and LOOKUP=0, issue #22's
   quality check, real_rep and prefill_ab, the 1,000-request soaks, the shipped MTP plan's residue sweep,
   labd_soak, DFlash2's residue sweep, the longest request each long-context plan takes, the
   CTX=huge residue sweep, retrieval at depth.
Before the next wave boots, a wave's cheap parts keep that wave's boot in reserve, its expensive parts the boot and
the cheap parts of the waves still to come. What does not fit is listed under `skipped` with why.
Each server's GPU memory (its own processes, nvidia-smi's compute apps) is read once its wave is up and again
after its parts, before it stops; the second, with the weights it loaded swapped for the shipped ones (card_fit),
must fit the 23.60 GiB a headless 24 GB card leaves (CARD_FREE).
The launchers' plans are served with an API key (VISIT_API_KEY), which their parts send.

    python bench/gpu/product_visit.py OUT --site SITE --patched-site PATCHED [--budget-s S]
    python bench/gpu/product_visit.py OUT --dry-run   # every wave's commands and the parts plan, nothing started

OUT/product-visit.json is rewritten after every part.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "gpu"), str(Path(__file__).resolve().parent)]

import run_full  # noqa: E402
import scripted_mtp as sm  # noqa: E402
import smoke_lib  # noqa: E402

from bench import fullbench as fb  # noqa: E402
from bench import serving, soak  # noqa: E402
from qwen_serving import knobs as kn  # noqa: E402
from qwen_serving import memory, plan  # noqa: E402

REPORT = "product-visit.json"
FLASHINFER_MARKER = ".qs-flashinfer"  # tests/gpu/install-flashinfer.sh writes it once its checks pass
QUANT_MARKER = ".qs-quant"  # tests/gpu/install-quant.sh writes it once GPTQ imports beside the stack
# issue #19: the drafters built here, each served beside the config it is compared with (greedy acceptance per
# position within ACCEPTANCE_POINTS of that server's; `single` holds the prepared copy's int8 MTP module, whose
# greedy acceptance equalled the bf16 module's exact greedy walk in scripted runs 3 to 6, `dflash2` the bf16 drafter)
VARIANT_BASE = {"single-fast": "single", "dflash2-w4a16": "dflash2"}
ACCEPTANCE_POINTS = 0.02
VARIANT_PROMPTS = 80  # drafter/capture.py's prompts: 64 calibration, 16 held out (drafter/README.md's table)
ERROR_TABLES = {"fast": "fast-error-table.md", "w4a16": "dflash2-error-table.md", "shape": "shape-error-table.md"}
SCHEMA = "qwen-serving product-visit/1"
GiB, MiB = memory.GiB, memory.MiB
# the card the pools are pinned for: a headless 24 GB card's free VRAM (docs/long-context.md's table)
CARD_FREE = int(23.60 * GiB)
DRAFTER_AGREE = 0.7  # scripted_dflash2's default --agree
# Memory per server (GiB; graphs, overhead and the bound: run_full's). Weights: visit 9's prepared-copy servers
# (bench/results/scripted-h200-mtp-run3.json, boot_facts): 14.51 without MTP, 14.99 with it. The scripted drafter is
# bf16 at the target's width (5 layers, ~1.7e9 parameters; the shipped W4A16 one is 1.19 GB).
WEIGHTS_GIB = {"off": 14.51, "mtp": 14.99, "dflash2": 14.51}
DRAFTER_GIB = 3.5
GRAPHS_GIB, OVERHEAD_GIB, BOUND_GIB = run_full.GRAPHS_GIB, run_full.OVERHEAD_GIB, run_full.BOUND_GIB
# visit 9's answers without speculation on the same prepared copy (the checkpoint is deterministic: seed 0 and the
# dials below), the baseline of "DFlash2 vs no speculation"
BASELINE_REPORT = REPO / "bench" / "results" / "scripted-h200-mtp-run3.json"
BASELINE_SERVER = "scripted-patched-plain"
# time: estimates decide what is started, limits stop what runs long (s)
BOOT_S = {"first": 330, "later": 260}  # visit 9: four servers up after 313 s with Triton cold
# A FlashInfer server compiles its attention kernels (nvcc) during its boot, unless a carried flashinfer-cache holds
# them: on the 2-core development machine (2026-12-04, CUDA 13.0) the fp8 FA3 prefill module at head dim 256 (fp8
# queries and KV, bf16 out) compiled its 10 objects in 568 s, ~1.9 core-minutes each; the H200's 16 cores build them
# side by side, so about one object's time, plus the decode module. A guess added to the boot estimate and limit of
# a wave that holds one (nothing measured on the device).
FLASHINFER_JIT_S = 240
STOP_S = 30
LIMITS = {"synth": 420, "prepare": 420, "drafter": 300, "variant_step": 600, "boot": 600, "greedy": 240, "api": 240,
          "quote25k": 240, "max_request": 1200, "soak": 440, "labd_soak": 240, "residue": 420, "retrieval": 480,
          "quality": 300, "real_rep": 240, "prefill_ab": 300}
# visits 13-14 took: greedy 7-14 s (mtp-huge 50), api 6-9, quote25k 11-15, soak 100-115 (180 s budget then),
# labd_soak 22, residue 149-155 at 384-639-token prompts (1,024 and up now: past two blocks); visit 16: the two soaks
# side by side 234 s, quality 13 s before its closed form became the float32 reference forward (not timed on a GPU
# yet: 64 layers over four 1,024-id walks, the weights dequantized on the device; 90 s is a guess). prefill_ab: each
# measurement a `vllm bench serve` call of 3 requests at 4,096 tokens (~20 s with its start), two arms, two rounds
# when the first two agree, three at most; a part that outruns its estimate is cut at what is left and keeps what
# it wrote (both repeats reports are rewritten after every measurement)
ESTIMATES = {"greedy": 15, "api": 20, "quote25k": 25, "soak": 300, "labd_soak": 40, "residue": 240,
             "retrieval": 420, "quality": 90, "real_rep": 150, "prefill_ab": 120}
# prefill rate the estimate of a max-length request assumes: visit 14's 245,696-token prompt (DFlash2, CTX=huge,
# int4 KV on Triton) had not finished after 317 s (below 775 tok/s, whatever held it); 500 is a guess under that
MAX_REQUEST_TOK_S = 500
CHEAP = ("greedy", "api")  # the pool check reads the boot log: no request
QUOTE_CTX = 25_000
# soak_visit's budget: 1,000 requests, 120 s timeouts (visit 14 ran 540-871 in 180 s, one soak at a time); more than
# its default 360 s, as the two soaks now share the GPU
SOAK_BUDGET_S = 420
# Parts that run at once on the wave's servers where EXPENSIVE_ORDER lists them one after the other: the soaks judge
# status codes, deaths, leaks and drift per server, none of which another server's load changes, and side by side
# they cost one soak's time (their latencies are then those of two servers sharing the GPU: the report says so)
SIDE_BY_SIDE = frozenset({"soak"})
VISIT_API_KEY = "product-visit-key"  # loopback only; a fixed key, so a report's commands can be rerun as they are
SEGMENT = 64  # the max-length request's quote and answer (retrieval_depth's default segment)
DEFAULT_BUDGET_S = 1200  # ~20 minutes of a 30-minute visit after staging


@dataclass(frozen=True)
class VisitConfig:
    """One server: its plan (knobs, mode), the issues it serves, what it measures."""

    name: str
    mode: str
    knobs: Mapping[str, str]
    issues: tuple[str, ...]
    what: str
    cheap: tuple[str, ...] = ("greedy",)
    raw_logits: bool = False  # --logprobs-mode raw_logits: the near-tie rule; api_smoke's logprob checks need it off
    api_key: bool = False  # served with VISIT_API_KEY: the soak's wrong- and missing-key kinds run against it
    flashinfer: bool = False  # its plan serves on FlashInfer: planned only where flashinfer_missing() finds nothing
    variant: str = ""  # issue #19: "fast", the fast variant built here is its checkpoint; "w4a16", the drafter built here
    extra_args: tuple[str, ...] = ()  # vLLM flags past the plan's (an experiment's), as a user's EXTRA_ARGS would pass them

    def bench_config(self) -> fb.BenchConfig:
        extra = (*(fb.RAW_LOGITS if self.raw_logits else ()), *self.extra_args)
        return fb.BenchConfig(f"product-{self.name}", True, dict(self.knobs), mode=self.mode, vllm_defaults=(),
                              runs=(), max_len=None, extra_args=extra, what=self.what)


def _dflash2(**more: str) -> dict[str, str]:
    return {"SPEC": "dflash2", **more}  # DRAFT is the generated drafter (knobs_for)


# Priority order: #18's DFlash2 group first (its greedy identity needs the three together), then the long-context
# plans, the launchers' defaults, VISION=1, and what the issues ask least of.
CONFIGS: tuple[VisitConfig, ...] = (
    VisitConfig("dflash2", "single", _dflash2(), ("#18",), "the single-user plan with SPEC=dflash2 (7 drafts, lookup on)",
                raw_logits=True),
    VisitConfig("dflash2-k15", "single", _dflash2(DFLASH_TOKENS="15"), ("#18",),
                "SPEC=dflash2 DFLASH_TOKENS=15: the long verify block the lookup fills", raw_logits=True),
    VisitConfig("dflash2-lookup0", "single", _dflash2(LOOKUP="0"), ("#18",), "SPEC=dflash2 LOOKUP=0: the drafter alone",
                raw_logits=True),
    VisitConfig("dflash2-huge", "single", _dflash2(CTX="huge"), ("#20",),
                "SPEC=dflash2 CTX=huge: int4 per-token-head KV on Triton, 245,760 tokens, the 4.90 GiB pin"),
    VisitConfig("mtp-huge", "single", {"SPEC": "mtp", "CTX": "huge"}, ("#20",),
                "SPEC=mtp CTX=huge: int4 per-token-head KV on Triton, 262,144 tokens, 3 drafts, PIECEWISE graphs"),
    VisitConfig("single", "single", {}, ("#21",), "the single-user launcher's plan as shipped (MTP k=4, CTX=fast, tools)",
                cheap=CHEAP, api_key=True),
    VisitConfig("batch", "batch", {}, ("#21",), "the batch launcher's plan as shipped (W4A8 MLP, fp8 KV, 64 seats)",
                cheap=CHEAP, api_key=True),
    VisitConfig("dflash2-vision", "single", _dflash2(VISION="1"), ("#23",),
                "SPEC=dflash2 VISION=1 (the tower streamed from host RAM)", cheap=CHEAP),
    VisitConfig("mtp-vision", "single", {"VISION": "1"}, ("#23",), "SPEC=mtp VISION=1 (the tower streamed from host RAM)",
                cheap=CHEAP),
    VisitConfig("dflash2-long", "single", _dflash2(CTX="long"), ("#20",),
                "SPEC=dflash2 CTX=long: int8 per-token-head KV on Triton, 131,072 tokens"),
    VisitConfig("batch-int4pth", "batch", {"KV": "int4pth"}, ("#20",),
                "the batch plan with KV=int4pth: int4 per-token-head KV on Triton, 262,144 tokens"),
    # last, so that the configs before it keep their ports
    VisitConfig("mtp-long", "single", {"SPEC": "mtp", "CTX": "long"}, ("#20",),
                "SPEC=mtp CTX=long: fp8 KV on FlashInfer, 150,000 tokens, 3 drafts", flashinfer=True),
    VisitConfig("single-fast", "single", {}, ("#19",), "the single-user plan on the fast variant built here "
                "(drafter/: GPTQ int4 lm_head and MTP module, then the int8 embedding and the draft head)",
                variant="fast"),
    VisitConfig("dflash2-w4a16", "single", _dflash2(), ("#19",),
                "SPEC=dflash2 with the W4A16 drafter built here (drafter/: GPTQ of its 36 matrices)", variant="w4a16"),
    # What holds DFlash2's GPU memory beside its weights and pool (docs/memory.md, "DFlash2 at 8 seats"): visit 14's
    # dflash2 server held ~7.4 GiB more than both, dflash2-huge (2 seats, Triton, int4 KV) ~3.0. One variable each:
    VisitConfig("dflash2-seats2", "single", _dflash2(MAX_SEQS="2"), ("#18",),
                "SPEC=dflash2 at 2 seats (CTX=fast, FlashAttention, bf16 KV): the seats against the KV backend"),
    VisitConfig("dflash2-graphs32", "single", _dflash2(), ("#18",),
                "SPEC=dflash2 at 8 seats with CUDA graphs captured up to 32 tokens (dflash2-huge's sizes): the graphs",
                extra_args=("--compilation-config", json.dumps({"max_cudagraph_capture_size": 32}))),
)
BY_NAME = {c.name: c for c in CONFIGS}
# What the issues ask that this visit does not try, and why (recorded in every report).
NOT_TRIED = {
    "CTX=long with SPEC=off": "the same fp8 KV on FlashInfer as mtp-long (which serves CTX=long's 150k request where "
    "FlashInfer is installed: tests/gpu/install-flashinfer.sh), without the drafts; CTX=long is also tried with "
    "SPEC=dflash2 (int8 per-token-head on Triton), whose plan caps max_model_len at 131,072",
}
# The expensive parts, in the order they run (within a wave: those of its servers).
EXPENSIVE_ORDER: tuple[tuple[str, str], ...] = (
    ("dflash2-k15", "quote25k"), ("dflash2-lookup0", "quote25k"), ("dflash2", "quote25k"),
    ("single", "quality"), ("single", "real_rep"), ("single", "prefill_ab"),
    ("single", "soak"), ("batch", "soak"),
    ("single", "residue"),  # #20 item 3 on the shipped MTP plan (CTX=fast, FULL graphs, prefix caching)
    ("dflash2-k15", "labd_soak"),
    ("dflash2", "residue"),
    ("dflash2-huge", "max_request"), ("mtp-huge", "max_request"), ("mtp-long", "max_request"),
    ("dflash2-long", "max_request"),
    ("mtp-huge", "residue"),
    ("mtp-huge", "retrieval"), ("batch-int4pth", "max_request"),
)
# issue #22's tools on the single-user launcher's plan: the quality battery's scripted check (the closed form read
# from the prepared copy it serves: int8 lm_head and embed dequantized as vLLM holds them), real_rep, and prefill_ab
# against the batch launcher's plan (W4A8 MLP and fp8 KV against W4A16 and bf16 KV)
QUALITY_TAG = "product-h200"
# one length: each measurement is a `vllm bench serve` call and its warm-up, and the arms alternate up to 3 rounds
PREFILL_AB_LENS = "4096"
PREFILL_AB_OTHER = "batch"
# greedy comparisons (reference, other): each pair token-identical or measured near-ties (smoke_lib.compare_greedy)
IDENTITY = (("dflash2", "dflash2-lookup0"), ("dflash2", "dflash2-k15"), (BASELINE_SERVER, "dflash2"))


def log(msg: str) -> None:
    print(f"[product {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------------------------------------------------------- plans and memory (standard library)


def auto_pool_values(vc: VisitConfig) -> kn.Values:
    """The config's knob values with KV_MEM=auto, as a 24 GB card would resolve them."""
    return kn.Values.of(vc.mode, kn.resolve(vc.mode, {**vc.knobs, "KV_MEM": "auto"}))


def shipped_weights(vc: VisitConfig) -> float:
    """The GPU bytes of the weights a user serves with the config's plan, as the memory model counts them
    (single-user: the fast variant; batch: the base requantization; the W4A16 DFlash2 drafter; VISION_OFFLOAD's
    budget): the scripted servers load the prepared copy's int8 lm_head and MTP module and a bf16 drafter instead."""
    v = auto_pool_values(vc)
    spec = v.spec if vc.mode == "single" else "off"
    offload = v.vision_offload_gib if v.vision and v.vision_offload else None
    return memory.weights_bytes(spec, fast_variant=vc.mode == "single", vision=bool(v.vision),
                                vision_offload_gib=offload)


def card_pool(vc: VisitConfig) -> int:
    """KV_MEM=auto of the config's plan on a headless 24 GB card, after the first start, with the shipped weights:
    what the plan's own `explain` prints as `KV_MEM=auto would pin`."""
    vision = bool(auto_pool_values(vc).vision)
    batched = memory.PREFILL_CHUNK if vc.mode == "single" else plan.VLLM_BATCHED_TOKENS
    encoder = memory.encoder_cache_bytes(batched, kn.VISION_IMAGE_TOKENS) if vision else 0
    return memory.auto_kv_mem(CARD_FREE, shipped_weights(vc), encoder_cache=encoder)


def card_fit(server: Mapping) -> dict | None:
    """The server on a 24 GB card: its processes' GPU memory after its parts, with the weights it loaded (vLLM's
    "Model loading took", the drafter's too) swapped for the shipped ones; None before that reading."""
    held = (server.get("gpu_process_mib") or {}).get("end")
    if held is None:
        return None
    loaded = (server.get("boot_facts") or {}).get("weights_gib")
    loaded = sum(loaded) if isinstance(loaded, list) else loaded
    shipped = server.get("shipped_weights_mib")
    out = {"held_mib": held, "card_free_mib": round(CARD_FREE / MiB), **server["gpu_process_mib"]}
    if isinstance(loaded, int | float) and shipped is not None:
        out.update(loaded_weights_mib=round(loaded * 1024), shipped_weights_mib=shipped,
                   as_shipped_mib=round(held - loaded * 1024 + shipped),
                   rule="held - loaded weights + shipped weights <= card_free")
    else:
        out["rule"] = "held <= card_free (no weights figure in the log)"
    out["passed"] = out.get("as_shipped_mib", held) <= CARD_FREE / MiB
    return out


def knobs_for(vc: VisitConfig, drafter: Path) -> dict[str, str]:
    """The config's knobs as served: the generated drafter, and the pool the 24 GB plan leaves (the plan's own pin
    where it has one: SPEC=dflash2)."""
    out = dict(vc.knobs)
    if out.get("SPEC") == "dflash2":
        out["DRAFT"] = str(drafter)
    settings = kn.resolve(vc.mode, out)
    if settings["KV_MEM"].value == "":
        out["KV_MEM"] = str(card_pool(vc))
    return out


@dataclass
class Planned:
    """One config rendered: its server command, or the plan's refusal."""

    vc: VisitConfig
    port: int
    cmd: fb.ServerCommand | None = None
    served: plan.ServePlan | None = None
    refusal: str | None = None
    unavailable: str | None = None  # what this machine lacks for it (flashinfer_missing)

    @property
    def spec(self) -> str:
        return self.served.value("SPEC") if self.served and self.vc.mode == "single" else "off"

    @property
    def vision(self) -> bool:
        return bool(self.served and self.served.value("VISION"))


NAMES = tuple(vc.name for vc in CONFIGS)


def server_log(out: Path, name: str) -> Path:
    return out / f"{name}.server.log"


def flashinfer_path(fi_site: Path, environ: Mapping[str, str]) -> str:
    """The PATH a FlashInfer server gets (install-flashinfer.sh checks the same): the staged ninja, which
    FlashInfer's JIT runs, and the CUDA bin with nvcc, which vLLM's has_flashinfer() looks for and the JIT runs."""
    cuda_bin = Path(environ.get("CUDA_HOME") or "/usr/local/cuda") / "bin"
    return os.pathsep.join([str(fi_site / "bin"), str(cuda_bin), environ.get("PATH", os.defpath)])


def flashinfer_missing(python: str, site: Path, fi_site: Path, environ: Mapping[str, str] = os.environ) -> str | None:
    """Why this machine cannot serve a FlashInfer config, or None: tests/gpu/install-flashinfer.sh's marker (it
    passed its checks: nvcc building sm_90a, ninja, vLLM's FLASHINFER backend importing), nvcc and ninja on the
    servers' PATH, and `import flashinfer` with the servers' path now."""
    marker = fi_site / FLASHINFER_MARKER
    if not marker.is_file():
        return f"FlashInfer is not installed here: no {marker} (tests/gpu/stage-flashinfer.sh, install-flashinfer.sh)"
    path = flashinfer_path(fi_site, environ)
    for tool in ("nvcc", "ninja"):
        if shutil.which(tool, path=path) is None:
            return f"no {tool} on the FlashInfer servers' PATH ({path})"
    try:
        res = subprocess.run([python, "-c", "import flashinfer"], capture_output=True, text=True, timeout=300,
                             env={**environ, "PYTHONPATH": os.pathsep.join([str(site), str(fi_site)])})
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"import flashinfer: {type(err).__name__}: {err}"
    if res.returncode != 0:
        tail = (res.stderr.strip().splitlines() or ["(no output)"])[-1]
        return f"import flashinfer from {fi_site} fails: {tail}"
    return None


def quant_missing(quant_site: Path) -> str | None:
    """Why #19's drafters cannot be built here, or None: tests/gpu/install-quant.sh's marker (GPTQ imports with the
    quant site first, the serving stack alone is unchanged)."""
    marker = quant_site / QUANT_MARKER
    if not marker.is_file():
        return (f"the GPTQ quant site is not installed here: no {marker} (tests/gpu/stage-quant.sh, "
                "install-quant.sh)")
    return None


def fast_dir(args: argparse.Namespace) -> Path:
    return args.ckpt.with_name(args.ckpt.name + "-fast")  # drafter/quantize.py's default: <base>-fast


def w4a16_dir(args: argparse.Namespace) -> Path:
    return args.drafter.with_name(args.drafter.name + "-W4A16")  # drafter/quantize.py --dflash2's default


def shape_dir(args: argparse.Namespace) -> Path:
    """The random `shape` checkpoint (every real matrix shape, 4 layers) whose drafter matrices GPTQ is measured on
    against round-to-nearest (issue #19's table; the scripted one's designed MTP has exact and zero matrices)."""
    return args.ckpt.with_name("qwen-shape-random")


def served_ckpt(args: argparse.Namespace, vc: VisitConfig) -> Path:
    return fast_dir(args) if vc.variant == "fast" else args.prepared_ckpt


def served_drafter(args: argparse.Namespace, vc: VisitConfig) -> Path:
    return w4a16_dir(args) if vc.variant == "w4a16" else args.drafter


@dataclass(frozen=True)
class VariantStep:
    name: str
    argv: list[str]
    quant: bool  # runs with the quant site first on its path (GPTQ)
    made: Path | None  # a file whose presence means the step's product is there (None: the step is idempotent)


def variant_steps(args: argparse.Namespace, out: Path, variants: Sequence[str], method: str = "gptq",
                  device: str = "cuda", prompts: int = VARIANT_PROMPTS) -> list[VariantStep]:
    """What builds each variant, in order: the capture on the GPU over the scripted
    checkpoint (its bf16 MTP module and lm_head; with --dflash2, the bf16 drafter too), GPTQ, and for the fast variant
    the prepare steps the single-user plan takes from a prepared copy (the int8 embedding, the draft head from the
    design's id list; its lm_head and MTP module are the int4 ones). "shape": the random `shape` checkpoint, its
    capture and its fast variant, for GPTQ's held-out error against round-to-nearest on every real matrix shape.
    method "rtn" (round-to-nearest, any venv), device "cpu" and a few prompts are the CPU test's."""
    from qwen_serving.checkpoint import scripted

    ckpt, n, gptq = str(args.ckpt), str(prompts), method == "gptq"
    steps: list[VariantStep] = []
    if "fast" in variants:
        fast, capture, built = fast_dir(args), out / "fast-capture.safetensors", fast_dir(args) / "config.json"
        steps += [VariantStep("fast: capture", ["drafter/capture.py", ckpt, "--device", device, "--max-prompts", n,
                                                "--out", str(capture)], False, built),
                  VariantStep("fast: quantize", ["drafter/quantize.py", ckpt, "--capture", str(capture), "--out",
                                                 str(fast), "--method", method, "--table",
                                                 str(out / ERROR_TABLES["fast"])], gptq, built),
                  VariantStep("fast: quant_embed", ["prepare/quant_embed.py", str(fast)], False, None),
                  VariantStep("fast: build_draft_vocab", ["prepare/build_draft_vocab.py", str(fast), "--ids",
                                                          str(args.ckpt / scripted.DRAFT_IDS_FILE)], False, None)]
    if "w4a16" in variants:
        capture, built = out / "dflash2-capture.safetensors", w4a16_dir(args) / "config.json"
        steps += [VariantStep("w4a16: capture", ["drafter/capture.py", ckpt, "--dflash2", str(args.drafter),
                                                 "--device", device, "--max-prompts", n, "--out", str(capture)],
                              False, built),
                  VariantStep("w4a16: quantize", ["drafter/quantize.py", str(args.drafter), "--dflash2", "--capture",
                                                  str(capture), "--out", str(w4a16_dir(args)), "--method", method,
                                                  "--table", str(out / ERROR_TABLES["w4a16"])], gptq, built)]
    if "shape" in variants:
        shape, capture = shape_dir(args), out / "shape-capture.safetensors"
        built = variant_dir(args, "shape") / "config.json"
        steps += [VariantStep("shape: synth", ["-m", "qwen_serving.checkpoint.synth", "--size", "shape", "--layers",
                                               "4", "--out", str(shape), "--seed", "0", "--device", device], False,
                              shape / "config.json"),
                  VariantStep("shape: capture", ["drafter/capture.py", str(shape), "--device", device,
                                                 "--max-prompts", n, "--out", str(capture)], False, built),
                  VariantStep("shape: quantize", ["drafter/quantize.py", str(shape), "--capture", str(capture),
                                                  "--out", str(variant_dir(args, "shape")), "--method", method,
                                                  "--table", str(out / ERROR_TABLES["shape"])], gptq, built)]
    return steps


def variant_dir(args: argparse.Namespace, variant: str) -> Path:
    """What a variant's build leaves: the directory whose config.json says it is built."""
    if variant == "fast":
        return fast_dir(args)
    if variant == "w4a16":
        return w4a16_dir(args)
    return shape_dir(args).with_name(shape_dir(args).name + "-fast")


def make_variants(args: argparse.Namespace, env: Mapping[str, str], out: Path, budget: Budget,
                  variants: Sequence[str], method: str = "gptq", device: str = "cuda",
                  prompts: int = VARIANT_PROMPTS) -> dict:
    """Issue #19's drafters, built on the device before any server holds the GPU (variant_steps), each step's log in
    OUT/variants.log. Returns each step's seconds and the held-out error tables; a failed step raises
    CheckpointError. A step whose product is there is skipped (a visit run again on the same machine); the
    idempotent prepare steps run again, each a no-op once prepared.json records it."""
    quant_env = {**env, "PYTHONPATH": os.pathsep.join([str(args.quant_site), env.get("PYTHONPATH", "")])}
    done: dict = {"steps_s": {}, "method": method, "device": device}
    with open(out / "variants.log", "a") as f:
        for step in variant_steps(args, out, variants, method, device, prompts):
            if step.made is not None and step.made.exists():
                continue
            t0 = time.monotonic()
            log(f"variants: {step.name}")
            try:
                subprocess.run([args.python, *step.argv], cwd=REPO, env=dict(quant_env if step.quant else env),
                               check=True, timeout=budget.within(LIMITS["variant_step"]) or 1, stdout=f,
                               stderr=subprocess.STDOUT)
            except subprocess.SubprocessError as err:
                raise sm.CheckpointError(f"{step.name} failed: {err} (see variants.log)") from err
            done["steps_s"][step.name] = round(time.monotonic() - t0, 1)
    for v in variants:
        table = out / ERROR_TABLES[v]
        if table.is_file():
            done[f"{v}_error_table"] = table.read_text()
    if "shape" in variants:
        from qwen_serving.checkpoint import drafter_quantize
        from qwen_serving.checkpoint.model_dir import ModelDir

        rows = ModelDir.open(variant_dir(args, "shape")).manifest()["steps"]["fast_variant"]["held_out_error"]
        done["shape_held_out_error"] = rows
        done["shape_gptq_not_lower"] = drafter_quantize.gptq_beats_rtn(rows) if method == "gptq" else None
    return done


def server_pythonpath(args: argparse.Namespace, p: Planned) -> str:
    """The patched vllm first, then the stack; FlashInfer's site last, for the configs that serve on it only."""
    return os.pathsep.join([str(args.patched_site), str(args.site),
                            *([str(args.flashinfer_site)] if p.vc.flashinfer else [])])


def render(args: argparse.Namespace, out: Path, flashinfer: str | None,
           variants: Mapping[str, str] | None = None) -> list[Planned]:
    """Every config (or those --plans names) through the plan, each on its own port (base_port + its index in
    CONFIGS: never reused). `flashinfer` is flashinfer_missing()'s answer: a config that serves on FlashInfer is
    rendered only when it is None, else it is left unavailable with that reason; `variants` says why a #19 variant
    is not there (quant_missing's answer, or its build's failure), and its configs are left unavailable likewise."""
    probe = plan.Probe.detect(REPO)
    planned = []
    for i, vc in enumerate(CONFIGS):
        if args.plans and vc.name not in args.plans:
            continue
        p = Planned(vc, args.base_port + i)
        planned.append(p)
        if vc.flashinfer and flashinfer is not None:
            p.unavailable = flashinfer
            continue
        if vc.variant and (variants or {}).get(vc.variant):
            p.unavailable = variants[vc.variant]
            continue
        drafter = served_drafter(args, vc)
        cfg = dataclasses.replace(vc.bench_config(), knobs=knobs_for(vc, drafter))
        try:
            p.served = fb.serve_plan(cfg, ckpt=served_ckpt(args, vc), port=p.port, traces=out / f"traces-{vc.name}",
                                     probe=probe, will_create={str(drafter)})
            p.cmd = fb.command_of(cfg, p.served, python=args.python)
            if vc.api_key:  # vLLM reads it from the environment, as the launchers pass it
                p.cmd = dataclasses.replace(p.cmd, env={**p.cmd.env, kn.SECRET_ENV: VISIT_API_KEY})
            if vc.flashinfer:
                p.cmd = dataclasses.replace(p.cmd, env={**p.cmd.env,
                                                        "PATH": flashinfer_path(args.flashinfer_site, os.environ)})
        except plan.PlanError as err:
            p.refusal = str(err)
    return planned


def not_tried(planned: Sequence[Planned]) -> dict[str, str]:
    """NOT_TRIED and the configs this machine cannot serve, with why."""
    return {**NOT_TRIED, **{f"{p.vc.name} ({p.vc.what}; {', '.join(p.vc.issues)})": p.unavailable
                            for p in planned if p.unavailable}}


def memory_gib(p: Planned, seen: Mapping[str, Mapping] | None = None) -> dict[str, float]:
    """The server's GPU memory estimate; `seen` (booted servers' boot facts by class, see memory_classes) replaces
    the weights and graphs estimates of its class with what those servers measured."""
    seen = seen or {}
    weights = WEIGHTS_GIB[p.spec] + (DRAFTER_GIB if p.spec == "dflash2" else 0.0)
    if p.vision:
        offload = p.served.value("VISION_OFFLOAD_GIB") if p.served.value("VISION_OFFLOAD") else None
        weights += memory.vision_card_bytes(offload) / GiB
    weights = seen.get(weights_class(p), {}).get("weights_gib", weights)
    # vLLM's graph figure is the device's free memory before and after its capture, so servers booting beside it
    # move it either way (visit 13: 13.78 GiB for one DFlash2 server, -0.08 for an MTP one): never below the estimate
    graphs = max(GRAPHS_GIB, seen.get(graphs_class(p), {}).get("graph_capture_gib", GRAPHS_GIB))
    pool = (p.served.kv_mem or 0) / GiB
    return {"weights": round(weights, 2), "graphs": round(graphs, 2), "pool": round(pool, 2),
            "overhead": OVERHEAD_GIB, "total": round(weights + graphs + pool + OVERHEAD_GIB, 2)}


def weights_class(p: Planned) -> str:
    return f"weights {p.spec} vision={int(p.vision)}"


def graphs_class(p: Planned) -> str:
    return f"graphs {p.spec} k={p.served.cache.spec_tokens if p.served.cache else 0}"


def memory_classes(booted: Sequence[tuple[Planned, Mapping]]) -> dict[str, dict[str, float]]:
    """From booted servers' boot facts: the largest weights and graphs measured per class."""
    seen: dict[str, dict[str, float]] = {}
    for p, facts in booted:
        for cls, key in ((weights_class(p), "weights_gib"), (graphs_class(p), "graph_capture_gib")):
            value = facts.get(key)
            if isinstance(value, list):
                value = sum(value)
            if isinstance(value, int | float):
                entry = seen.setdefault(cls, {})
                entry[key] = max(entry.get(key, 0.0), float(value))
    return seen


def pack(planned: Sequence[Planned], bound: float = BOUND_GIB,
         seen: Mapping[str, Mapping] | None = None) -> list[list[Planned]]:
    """run_full.first_fit on each server's memory estimate (a config larger than the bound alone is its own wave,
    and is recorded)."""
    return run_full.first_fit(planned, lambda p: memory_gib(p, seen)["total"], bound)


def pool_prediction(p: Planned) -> int | None:
    """vLLM 0.28.0's 'GPU KV cache size' line as the memory model has it for this plan (the patched groups)."""
    if not (p.served and p.served.cache and p.served.kv_mem):
        return None
    return p.served.cache.pool_tokens(p.served.kv_mem, max_len(p))


def max_len(p: Planned) -> int:
    argv = p.cmd.argv
    return int(argv[argv.index("--max-model-len") + 1])


# ---------------------------------------------------------------- the parts plan


def parts_for(p: Planned) -> tuple[list[str], list[str]]:
    """(cheap, expensive) part names of one server, each list in the order it runs."""
    expensive = [part for name, part in EXPENSIVE_ORDER if name == p.vc.name]
    return list(p.vc.cheap), expensive


def estimate_s(p: Planned, part: str) -> float:
    if part == "max_request":
        return 60 + max_len(p) / MAX_REQUEST_TOK_S
    return ESTIMATES[part]


def limit_s(p: Planned, part: str) -> float:
    if part == "max_request":
        return min(LIMITS["max_request"], 2 * estimate_s(p, part))
    return LIMITS[part]


def cheap_s(wave: Sequence[Planned]) -> float:
    return sum(estimate_s(p, part) for p in wave for part in p.vc.cheap)


def boot_s(wave: Sequence[Planned], first: bool) -> float:
    """A wave's boot estimate: FLASHINFER_JIT_S more when one of its servers serves on FlashInfer."""
    return BOOT_S["first" if first else "later"] + (FLASHINFER_JIT_S if any(p.vc.flashinfer for p in wave) else 0)


def wave_need_s(wave: Sequence[Planned], first: bool) -> float:
    """Boot, cheap parts and stop of a wave."""
    return boot_s(wave, first) + cheap_s(wave) + STOP_S


def reserve_s(later: Sequence[Sequence[Planned]], left: float, cheap_only: bool) -> float:
    """The time kept for the waves still to boot, one after the other as far as what is left covers their boots:
    each one's boot and stop, and for an expensive part also its cheap parts, as far as they fit (a wave that
    could not boot anyway keeps nothing)."""
    kept = 0.0
    for wave in later:
        boot = boot_s(wave, first=False) + STOP_S
        if kept + boot > left:
            break
        kept += boot
        if not cheap_only:
            kept += min(cheap_s(wave), left - kept)
    return kept


class Budget:
    """The run's deadline on an injectable clock (tests drive a fake one)."""

    def __init__(self, seconds: float, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.t0 = clock()
        self.deadline = self.t0 + seconds

    def left(self) -> float:
        return max(0.0, self.deadline - self.clock())

    def within(self, limit: float) -> float:
        return min(limit, self.left())


# ---------------------------------------------------------------- measuring


@dataclass
class Context:
    """What the parts need besides the server."""

    args: argparse.Namespace
    out: Path
    env: Mapping[str, str]
    prompts: list[dict] = field(default_factory=list)  # the greedy prompts (scripted_mtp's)
    urls: dict[str, str] = field(default_factory=dict)  # the servers up now, by config name


def tool(ctx: Context, name: str, part: str, argv: Sequence[str], report: Path, timeout: float) -> dict:
    """A bench tool as a child within `timeout`; its exit code, output tail and JSON report."""
    with open(ctx.out / f"{name}-{part}.log", "w") as f:
        try:
            rc: int | str = subprocess.run([ctx.args.python, *argv], cwd=REPO, env=dict(ctx.env), stdout=f,
                                           stderr=subprocess.STDOUT, timeout=max(1.0, timeout)).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    data = json.loads(report.read_text()) if report.is_file() else None
    return {"rc": rc, "report": report.name if data is not None else None, "summary": summarize_tool(part, data),
            "passed": rc == 0}


def summarize_tool(part: str, data: dict | None) -> dict | None:
    """The few figures of a tool's report that the visit report keeps (the whole report comes back beside it)."""
    if data is None:
        return None
    if part == "api":
        return {name: c["status"] for name, c in data["checks"].items()}
    if part == "quote25k":
        return {k: data.get("all", {}).get(k) for k in ("tokens_per_step", "decode_tok_s", "completion_tokens")} | {
            "verdict": (data.get("tasks", {}).get("copy") or {}).get("verdict")}
    if part in ("max_request", "retrieval", "residue"):
        return data.get("summary")
    if part == "soak":
        return {k: data.get(k) for k in ("passed", "criteria", "counts") if k in data}
    if part == "labd_soak":
        return {k: data.get(k) for k in ("passed", "summary") if k in data}
    if part == "quality":
        scripted = data.get("scripted") or {}
        return {"check": scripted.get("check"), "check_passed": data.get("check_passed"),
                "forward_s": scripted.get("forward_s"), "forward_peak_gib": scripted.get("forward_peak_gib")}
    if part == "real_rep":
        return data.get("summary")
    if part == "prefill_ab":
        return {"rounds": data.get("rounds"), "conditions": {c: {"a": (row.get("A") or {}).get("value"),
                                                                 "b": (row.get("B") or {}).get("value"),
                                                                 "b_vs_a": row.get("b_vs_a"),
                                                                 "reproduced": row.get("reproduced")}
                                                             for c, row in (data.get("conditions") or {}).items()}}
    return None


def run_part(ctx: Context, p: Planned, url: str, part: str, timeout: float) -> dict:
    name, ckpt, out = p.vc.name, str(ctx.args.prepared_ckpt), ctx.out
    key = VISIT_API_KEY if p.vc.api_key else None
    keyed = ["--api-key", key] if key else []
    if part == "greedy":
        client = serving.Client(url, key)
        return sm.measure_greedy(client, fb.SERVED_NAME, [q["ids"] for q in ctx.prompts])
    if part == "api":
        report = out / f"{name}-api.json"
        return tool(ctx, name, part, ["bench/api_smoke.py", "--url", url, "--json", str(report), *keyed], report,
                    timeout)
    if part == "quote25k":
        return tool(ctx, name, part, ["bench/labd_bench.py", f"{name}-quote25k", "--url", url, "--scripted", ckpt,
                                      "--ctx", str(QUOTE_CTX), "--tasks", "copy", "--out", str(out), "--force",
                                      *keyed],
                    out / f"{name}-quote25k-labd.json", timeout)
    if part == "labd_soak":
        return tool(ctx, name, part, ["bench/labd_soak.py", name, "--url", url, "--scripted", ckpt, "--rounds", "3",
                                      "--out", str(out), "--force", *keyed], out / f"{name}-labd-soak.json", timeout)
    if part == "residue":
        return tool(ctx, name, part, ["bench/residue_sweep.py", name, "--url", url, "--scripted", ckpt,
                                      "--out", str(out), "--force", *keyed], out / f"{name}-residue.json", timeout)
    if part == "soak":
        report = out / f"{name}-soak.json"
        return tool(ctx, name, part, ["bench/gpu/soak_visit.py", "--url", url, "--out", str(report), "--mode",
                                      p.vc.mode, "--budget-s", str(int(min(SOAK_BUDGET_S, timeout - 10))),
                                      "--server-log", str(server_log(out, name)), *keyed], report, timeout)
    if part == "max_request":  # prompt and answer fill max_model_len; the quote deep in the prompt
        prompt = max_len(p) - SEGMENT
        return tool(ctx, name, part, ["bench/retrieval_depth.py", f"{name}-max", "--url", url, "--scripted", ckpt,
                                      "--depths", "8192", "--prompt-tokens", str(prompt), "--followup-prefix", "0",
                                      "--timeout", str(int(timeout)), "--out", str(out), "--force", *keyed],
                    out / f"retrieval-{name}-max.json", timeout)
    if part == "quality":
        report = out / f"{QUALITY_TAG}-quality.json"
        return tool(ctx, name, part, ["bench/gpu/quality_scripted.py", "--url", url, "--ckpt", ckpt,
                                      "--out", str(report), *keyed], report, timeout)
    if part == "real_rep":
        return tool(ctx, name, part, ["bench/repeats.py", "real-rep", QUALITY_TAG, "3", "--url", url, "--out", str(out),
                                      "--harness-arg=--ignore-eos", *keyed], out / f"{QUALITY_TAG}-real-rep.json",
                    timeout)
    if part == "prefill_ab":
        other = ctx.urls.get(PREFILL_AB_OTHER)
        if other is None:
            return {"rc": None, "passed": False, "report": None, "summary": None,
                    "error": f"the {PREFILL_AB_OTHER} server, arm B, is not up"}
        return tool(ctx, name, part, ["bench/repeats.py", "prefill-ab", QUALITY_TAG, "--a-url", url, "--b-url", other,
                                      "--lens", PREFILL_AB_LENS, "--max-rounds", "3", "--out", str(out), *keyed],
                    out / f"{QUALITY_TAG}-prefill-ab.json", timeout)
    if part == "retrieval":
        return tool(ctx, name, part, ["bench/retrieval_depth.py", name, "--url", url, "--scripted", ckpt,
                                      "--timeout", str(int(timeout)), "--out", str(out), "--force", *keyed],
                    out / f"retrieval-{name}.json", timeout)
    raise ValueError(f"unknown part {part!r}")


# ---------------------------------------------------------------- the run


class Visit:
    """Boots the waves, measures their servers one at a time, keeps the report. `boot(wave, limit_s)` returns each
    server's (state, boot facts); `measure(planned, part, timeout_s)` one part's result; both injectable."""

    def __init__(self, planned: Sequence[Planned], rec: sm.Record, budget: Budget,
                 boot: Callable[[Sequence[Planned], float], dict[str, tuple[str, dict]]],
                 measure: Callable[[Planned, str, float], dict], stop: Callable[[Sequence[Planned]], None],
                 judge: Callable[[], None] = lambda: None, bound: float = BOUND_GIB):
        self.rec, self.budget, self.boot_wave, self.measure_part, self.stop = rec, budget, boot, measure, stop
        self.judge, self.bound = judge, bound
        self.todo = [p for p in planned if p.cmd is not None]
        self.booted: list[tuple[Planned, dict]] = []
        data = rec.data
        for key, default in (("servers", {}), ("measurements", {}), ("skipped", []), ("errors", {}),
                             ("phases_s", {}), ("waves", [])):
            data.setdefault(key, default)
        for p in planned:
            if p.refusal:
                data["skipped"].append(f"{p.vc.name}: the plan refuses it: {p.refusal}")
            if p.unavailable:
                data["skipped"].append(f"{p.vc.name}: not planned: {p.unavailable}")

    def run(self) -> None:
        index = 0
        while self.todo:
            waves = pack(self.todo, self.bound, seen=memory_classes(self.booted))
            wave, later = waves[0], waves[1:]
            need = boot_s(wave, first=index == 0)
            if self.budget.left() < need:
                for w in waves:
                    self.rec.data["skipped"] += [f"{p.vc.name}: not booted ({self.budget.left():.0f} s left, a wave's "
                                                 f"boot takes ~{need} s)" for p in w]
                break
            self.todo = [p for w in later for p in w]
            self.rec.data["waves"].append({"servers": [p.vc.name for p in wave],
                                           "estimate_gib": round(sum(memory_gib(p, memory_classes(self.booted))["total"]
                                                                     for p in wave), 1)})
            self.one_wave(wave, later, index)
            index += 1
        self.rec.save()

    def one_wave(self, wave: list[Planned], later: list[list[Planned]], index: int) -> None:
        t0 = self.budget.clock()
        jit = boot_s(wave, first=index == 0) - BOOT_S["first" if index == 0 else "later"]
        states = self.boot_wave(wave, self.budget.within(LIMITS["boot"] + jit))
        self.rec.data["phases_s"][f"boot wave {index}"] = round(self.budget.clock() - t0, 1)
        up = []
        for p in wave:
            state, facts = states.get(p.vc.name, ("not started", {}))
            self.rec.data["servers"][p.vc.name] = {**self.rec.data["servers"].get(p.vc.name, {}), "state": state,
                                                   "boot_facts": facts, "wave": index}
            self.rec.data["measurements"].setdefault(p.vc.name, {})["pool"] = pool_check(p, facts)
            if state == "up":
                up.append(p)
                self.booted.append((p, facts))
        self.rec.save()
        try:
            for p in up:  # 2. the cheap parts, keeping the next waves' boots
                for part in p.vc.cheap:
                    self.one_part(p, part, reserve_s(later, self.budget.left(), cheap_only=True))
            names = {p.vc.name: p for p in up}
            for step in expensive_steps(names):  # 3. the expensive ones, keeping the next waves' boots and checks
                reserve = reserve_s(later, self.budget.left(), cheap_only=False)
                if len(step) == 1:
                    self.one_part(names[step[0][0]], step[0][1], reserve)
                else:
                    self.parts_together([(names[name], part) for name, part in step], reserve)
            for p in wave:
                if p not in up:
                    cheap, expensive = parts_for(p)
                    self.rec.data["skipped"] += [f"{p.vc.name}: {part} (server {states.get(p.vc.name, ('?',))[0]})"
                                                 for part in cheap + expensive]
        finally:
            self.stop(wave)
            self.rec.save()

    def one_part(self, p: Planned, part: str, reserve: float) -> None:
        room = self.budget.left() - reserve
        estimate = estimate_s(p, part)
        if room < estimate:
            self.rec.data["skipped"].append(f"{p.vc.name}: {part} (needs ~{estimate:.0f} s, {room:.0f} s left "
                                            f"after {reserve:.0f} s kept for later waves)")
            self.rec.save()
            return
        t0 = self.budget.clock()
        m = self.rec.data["measurements"].setdefault(p.vc.name, {})
        try:
            m[part] = self.measure_part(p, part, min(limit_s(p, part), room))
        except Exception as err:  # a failed part is recorded; the others still run
            self.rec.data["errors"][f"{p.vc.name}: {part}"] = f"{type(err).__name__}: {str(err)[:1500]}"
        self.judge()
        self.rec.phase(f"{p.vc.name}: {part}", self.budget.clock() - t0)


    def parts_together(self, step: Sequence[tuple[Planned, str]], reserve: float) -> None:
        """Parts of SIDE_BY_SIDE on several servers at once: each with the room one of them would get."""
        room = self.budget.left() - reserve
        estimate = max(estimate_s(p, part) for p, part in step)
        label = " + ".join(f"{p.vc.name}: {part}" for p, part in step)
        if room < estimate:
            self.rec.data["skipped"] += [f"{p.vc.name}: {part} (needs ~{estimate:.0f} s side by side with the others, "
                                         f"{room:.0f} s left after {reserve:.0f} s kept for later waves)"
                                         for p, part in step]
            self.rec.save()
            return
        t0 = self.budget.clock()
        with ThreadPoolExecutor(max_workers=len(step)) as pool:
            futures = [pool.submit(self.measure_part, p, part, min(limit_s(p, part), room)) for p, part in step]
        others = [p.vc.name for p, _ in step]
        for (p, part), future in zip(step, futures, strict=True):
            m = self.rec.data["measurements"].setdefault(p.vc.name, {})
            try:
                m[part] = {**future.result(), "side_by_side_with": [n for n in others if n != p.vc.name]}
            except Exception as err:  # as one_part: recorded, the others kept
                self.rec.data["errors"][f"{p.vc.name}: {part}"] = f"{type(err).__name__}: {str(err)[:1500]}"
        self.judge()
        self.rec.phase(label, self.budget.clock() - t0)


def expensive_steps(up: Iterable[str]) -> list[list[tuple[str, str]]]:
    """EXPENSIVE_ORDER's entries for the servers up, as steps: one part each, except that consecutive entries of one
    SIDE_BY_SIDE part form one step that runs at once."""
    steps: list[list[tuple[str, str]]] = []
    up = set(up)
    for name, part in (entry for entry in EXPENSIVE_ORDER if entry[0] in up):
        if steps and part in SIDE_BY_SIDE and steps[-1][-1][1] == part:
            steps[-1].append((name, part))
        else:
            steps.append([(name, part)])
    return steps


def pool_check(p: Planned, facts: Mapping) -> dict:
    """The pool in tokens the log gives against the memory model's; bytes per token of the pinned pool."""
    predicted, measured = pool_prediction(p), facts.get("kv_cache_tokens")
    if isinstance(measured, list):  # one line per KV pool the log printed: the first is the engine's
        measured = measured[0]
    out: dict = {"kv_mem": p.served.kv_mem, "max_model_len": max_len(p), "predicted_tokens": predicted,
                 "card_pool_24gb": card_pool(p.vc), "measured_tokens": measured}
    if measured:
        out["bytes_per_token"] = round(p.served.kv_mem / measured, 1)
        out["passed"] = predicted == int(measured)
    return out


def judge(data: dict, traces: Mapping[str, list[smoke_lib.GreedyTrace]], design, prompts: list[dict]) -> dict:
    """Every check the measurements so far allow."""
    checks: dict = {}
    meas = data["measurements"]
    expected = [sm.expected_chain(design, q["ids"]) for q in prompts] if design is not None else None
    for name, server in data["servers"].items():
        checks[f"{name}: boots"] = {"passed": server["state"] == "up", "state": server["state"]}
        fit = card_fit(server)  # the whole server as a 24 GB card would hold it: weights, pool, graphs, activations
        if fit is not None:
            checks[f"{name}: GPU memory fits a 24 GB card"] = fit
        m = meas.get(name, {})
        pool = m.get("pool") or {}
        if "passed" in pool:
            checks[f"{name}: pool tokens = memory model"] = pool
        if name in traces and expected is not None:
            checks[f"{name}: greedy answers are the designed chain"] = sm.chain_check(traces[name], expected)
        for part in ("api", "quote25k", "max_request", "soak", "labd_soak", "residue", "retrieval", "quality",
                     "real_rep", "prefill_ab"):
            if m.get(part):
                checks[f"{name}: {part}"] = {"passed": m[part]["passed"], **{k: v for k, v in m[part].items()
                                                                            if k != "passed"}}
    for ref, other in IDENTITY:
        if ref in traces and other in traces:
            comparison = smoke_lib.compare_greedy(traces[ref], traces[other])
            checks[f"{other}: greedy token-identical to {ref}"] = {"passed": not comparison.unexplained,
                                                                   **comparison.summary()}
    shape = (data.get("variants") or {}).get("shape") or {}
    if shape.get("shape_gptq_not_lower") is not None:
        checks["#19: GPTQ below round-to-nearest on every matrix (random shape checkpoint, held-out rows)"] = {
            "passed": not shape["shape_gptq_not_lower"], "not_lower": shape["shape_gptq_not_lower"],
            "matrices": len(shape.get("shape_held_out_error") or [])}
    for name, base in VARIANT_BASE.items():
        got, ref = (((meas.get(n, {}).get("greedy") or {}).get("spec") or {}).get("per_position_acceptance")
                    for n in (name, base))
        if got is not None and ref is not None:
            checks[f"{name}: greedy acceptance per position within {ACCEPTANCE_POINTS:.0%} of {base}'s"] = \
                acceptance_within(got, ref, ACCEPTANCE_POINTS)
    pinned = {}
    for name in ("dflash2", "dflash2-lookup0"):  # one cache shape, one pin: the same pool on two boots
        tokens = (meas.get(name, {}).get("pool") or {}).get("measured_tokens")
        if tokens:
            pinned[name] = tokens
    if len(pinned) == 2:
        checks["KV_MEM pinning: the same pool on two boots"] = {"passed": len(set(pinned.values())) == 1, **pinned}
    k15 = ((meas.get("dflash2-k15", {}).get("quote25k") or {}).get("summary") or {})
    if k15.get("tokens_per_step") is not None:
        against = {n: ((meas.get(n, {}).get("quote25k") or {}).get("summary") or {}).get("decode_tok_s")
                   for n in ("dflash2", "dflash2-lookup0")}
        checks["dflash2-k15: >= 13 tokens per step quoting 25k tokens"] = {
            "passed": k15["tokens_per_step"] >= 13, **k15, "decode_tok_s_against": against}
    return checks


def acceptance_within(got: Sequence[float], ref: Sequence[float], points: float) -> dict:
    """Per-position acceptance rates (vLLM's counters) of two servers at one k: each within `points` of the other."""
    diff = [round(a - b, 4) for a, b in zip(got, ref, strict=False)]
    return {"passed": len(got) == len(ref) > 0 and all(abs(d) <= points for d in diff), "per_position": list(got),
            "against": list(ref), "difference": diff}


def baseline_traces(design_dials: Mapping) -> tuple[list[smoke_lib.GreedyTrace] | None, str]:
    """Visit 9's greedy answers without speculation, when its checkpoint had these dials."""
    try:
        earlier = json.loads(BASELINE_REPORT.read_text())
        answers = BASELINE_REPORT.with_suffix("") / f"{BASELINE_SERVER}-greedy.json.gz"
        records = json.loads(gzip.decompress(answers.read_bytes()))
    except (OSError, ValueError) as err:
        return None, f"no baseline: {err}"
    differs = sm.dial_difference(earlier["checkpoint"], design_dials)
    if differs:
        return None, f"no baseline: {BASELINE_REPORT.name}: {differs}"
    return [smoke_lib.GreedyTrace.from_record(r) for r in records], f"{BASELINE_REPORT.name} ({earlier['date']})"


def make_drafter(args: argparse.Namespace, env: Mapping[str, str], out: Path, budget: Budget) -> None:
    if (args.drafter / "config.json").exists():
        return
    with open(out / "drafter.log", "w") as f:
        subprocess.run([args.python, "-m", "qwen_serving.checkpoint.scripted_dflash2", str(args.ckpt), "--out",
                        str(args.drafter), "--agree", str(DRAFTER_AGREE), "--seed", "0"], cwd=REPO, env=dict(env),
                       check=True, timeout=budget.within(LIMITS["drafter"]) or 1, stdout=f, stderr=subprocess.STDOUT)


def wanted_variants(args: argparse.Namespace) -> list[str]:
    return sorted({vc.variant for vc in CONFIGS if vc.variant and (not args.plans or vc.name in args.plans)})


def build_variants(args: argparse.Namespace, env: Mapping[str, str], out: Path, budget: Budget,
                   rec: sm.Record) -> dict[str, str]:
    """The #19 variants the planned configs serve, one after the other (a failed one leaves the other); returns why
    each missing one is missing, for render."""
    wanted = wanted_variants(args)
    why = quant_missing(args.quant_site) if wanted else None
    if why:
        return {v: why for v in wanted}
    missing: dict[str, str] = {}
    for variant in [*wanted, *(["shape"] if "fast" in wanted else [])]:  # the shape table after what is served
        t0 = budget.clock()
        try:
            rec.data.setdefault("variants", {})[variant] = make_variants(args, env, out, budget, [variant])
        except (sm.CheckpointError, OSError, KeyError) as err:
            rec.data["errors"][f"variants: {variant}"] = f"{type(err).__name__}: {err}"
            if variant != "shape":  # the table serves no config
                missing[variant] = f"not built here: {err}"
        rec.phase(f"variants: {variant}", budget.clock() - t0)
    return missing


def run(args: argparse.Namespace) -> int:
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    budget = Budget(args.budget_s)
    bound = run_full.bound_gib()
    env = {**os.environ, **smoke_lib.DEVICE_ENV, "PYTHONPATH": os.pathsep.join([str(args.site), str(REPO)])}
    rec = sm.Record(out / REPORT, {
        "schema": SCHEMA, "date": datetime.now(UTC).isoformat(timespec="seconds"), "gpu": smoke_lib.gpu_description(), "host_cpu": smoke_lib.host_cpu(),
        "gpu_state_at_start": run_full.gpu_state(),
        "versions": {"python": sys.version.split()[0], **smoke_lib.package_versions(smoke_lib.REPORTED_PACKAGES)},
        "patches": sm.patch_state(args.patched_site, args.python, {**env, "PYTHONPATH": os.pathsep.join(
            [str(args.patched_site), env["PYTHONPATH"]])}),
        "checkpoint": {"dir": str(args.ckpt), "prepared_dir": str(args.prepared_ckpt), "drafter": str(args.drafter)},
        "budget_s": args.budget_s, "limits_s": LIMITS, "estimates_s": ESTIMATES, "bound_gib": bound,
        "not_tried": NOT_TRIED, "phases_s": {}, "servers": {}, "measurements": {}, "checks": {}, "skipped": [],
        "errors": {}, "waves": []})
    # 1. the checkpoint, its prepared copy and the drafter (the last two side by side, both on the CPU)
    t0 = budget.clock()
    args.agree, args.coverage = sm.DEFAULT_AGREE, sm.DEFAULT_COVERAGE
    try:
        rec.data["checkpoint"].update(sm.make_checkpoint(args, env, out, budget.within))
        with ThreadPoolExecutor(max_workers=1) as pool:
            drafter = pool.submit(make_drafter, args, env, out, budget)
            rec.data["checkpoint"]["prepared"] = sm.prepare_copy(args, env, out, budget.within)
            drafter.result()
    except (sm.CheckpointError, subprocess.SubprocessError, OSError) as err:
        rec.data["errors"]["checkpoint"] = f"{type(err).__name__}: {err}"
        rec.phase("checkpoint", budget.clock() - t0)
        return 1
    rec.phase("checkpoint, prepared copy, drafter", budget.clock() - t0)
    variants_missing = build_variants(args, env, out, budget, rec)
    from qwen_serving.checkpoint.scripted import Design

    design = Design.read(args.ckpt)
    prompts = sm.prompts_for(design, "greedy", sm.GREEDY_PROMPTS)
    rec.data["checkpoint"].update(mtp_agree=design.mtp_agree)
    traces: dict[str, list[smoke_lib.GreedyTrace]] = {}
    base, source = baseline_traces(rec.data["checkpoint"])
    rec.data["baseline"] = source
    if base is not None:
        traces[BASELINE_SERVER] = base
    ctx = Context(args, out, env, prompts)
    planned = render(args, out, flashinfer_missing(args.python, args.site, args.flashinfer_site), variants_missing)
    rec.data["not_tried"] = not_tried(planned)
    servers: dict[str, run_full.Server] = {}

    def boot(wave: Sequence[Planned], limit: float) -> dict[str, tuple[str, dict]]:
        for p in wave:
            (out / f"traces-{p.vc.name}").mkdir(exist_ok=True)
            s = servers[p.vc.name] = run_full.Server(p.vc.bench_config(), p.cmd, p.port, server_pythonpath(args, p),
                                                     server_log(out, p.vc.name))
            rec.data["servers"][p.vc.name] = {"cmd": f"PYTHONPATH={s.pythonpath} {p.cmd.shell()}", "port": p.port,
                                              "what": p.vc.what, "issues": list(p.vc.issues),
                                              "memory_estimate_gib": memory_gib(p),
                                              "shipped_weights_mib": round(shipped_weights(p.vc) / MiB)}
            log(f"{p.vc.name}: starting on port {p.port}")
            s.start()
        rec.save()
        run_full.wait_until_up([servers[p.vc.name] for p in wave], max(1.0, limit))
        ctx.urls.update({p.vc.name: servers[p.vc.name].url for p in wave if servers[p.vc.name].state == "up"})
        record_gpu_memory([p.vc.name for p in wave], "boot")
        return {p.vc.name: (servers[p.vc.name].state, serving.boot_facts(servers[p.vc.name].log_text())) for p in wave}

    def record_gpu_memory(names: Sequence[str], when: str) -> None:
        held = run_full.gpu_mib_by_pid()
        for name in names:
            s = servers[name]
            tree = soak.process_tree_rss(s.proc.pid) if s.proc is not None and s.state == "up" else None
            if tree:
                mib = run_full.server_gpu_mib(tree["pids"], held)
                rec.data["servers"][name].setdefault("gpu_process_mib", {})[when] = mib

    def measure(p: Planned, part: str, timeout: float) -> dict:
        log(f"{p.vc.name}: {part} (up to {timeout:.0f} s)")
        result = run_part(ctx, p, servers[p.vc.name].url, part, timeout)
        if part == "greedy":
            records = result.pop("traces")
            rec.keep_traces(p.vc.name, records)
            traces[p.vc.name] = rec.traces[p.vc.name]
        return result

    def checks() -> None:
        rec.data["checks"] = judge(rec.data, traces, design, prompts)

    def stop(wave: Sequence[Planned]) -> None:
        names = [p.vc.name for p in wave if p.vc.name in servers]
        for name in names:
            ctx.urls.pop(name, None)
        record_gpu_memory(names, "end")  # after every part it ran
        stopping = [(name, servers[name]) for name in names]
        with ThreadPoolExecutor(max_workers=max(1, len(stopping))) as pool:  # together: each may take its grace
            list(pool.map(lambda item: item[1].stop(), stopping))
        for name, s in stopping:
            rec.data["servers"][name]["log_tail"] = s.log_tail(40)
            smoke_lib.trim_to_tail(s.log_path, 8 << 20)

    visit = Visit(planned, rec, budget, boot, measure, stop, checks, bound)
    try:
        visit.run()
    finally:
        for s in servers.values():
            s.stop()
    rec.data["checks"] = judge(rec.data, traces, design, prompts)
    rec.data["passed"] = bool(rec.data["checks"]) and all(c["passed"] for c in rec.data["checks"].values())
    rec.phase("total", budget.clock() - budget.t0)
    failed = [n for n, c in rec.data["checks"].items() if not c["passed"]]
    log(f"checks: {len(rec.data['checks']) - len(failed)} passed, {len(failed)} failed"
        + "".join(f"\n  FAILED {n}" for n in failed) + "".join(f"\n  skipped {s}" for s in rec.data["skipped"]))
    return 0 if rec.data["passed"] and not rec.data["errors"] else 1


def dry_run(args: argparse.Namespace) -> int:
    """Every wave's server commands (as the static estimate packs them) and the parts plan, with the time each
    part is estimated to take and its limit; the plan's refusals; what is not tried."""
    why = quant_missing(args.quant_site)
    planned = render(args, args.out.resolve(), flashinfer_missing(args.python, args.site, args.flashinfer_site),
                     {v: why for v in wanted_variants(args)} if why else None)
    for p in planned:
        if p.refusal:
            print(f"# {p.vc.name}: the plan refuses it: {p.refusal}")
    total = expensive_total = 0.0
    order: list[str] = []
    for i, wave in enumerate(pack([p for p in planned if p.cmd])):
        by_name = {p.vc.name: p for p in wave}
        for step in expensive_steps(by_name):
            expensive_total += max(estimate_s(by_name[n], part) for n, part in step)
            order.append(" + ".join(f"{n}:{part}" for n, part in step))
        gib = sum(memory_gib(p)["total"] for p in wave)
        need = wave_need_s(wave, first=i == 0)
        total += need
        print(f"## wave {i}: {len(wave)} servers, ~{gib:.1f} of {BOUND_GIB} GiB, boot + cheap parts ~{need:.0f} s")
        for p in wave:
            est = memory_gib(p)
            print(f"# {p.vc.name} (port {p.port}, {', '.join(p.vc.issues)}): {p.vc.what}; ~{est['total']} GiB "
                  f"(weights {est['weights']}, graphs {est['graphs']}, pool {est['pool']}); max_model_len "
                  f"{max_len(p):,}, pool {pool_prediction(p):,} tokens predicted")
            print(f"PYTHONPATH={server_pythonpath(args, p)} {p.cmd.shell()}")
            cheap, expensive = parts_for(p)
            print("  parts: " + ", ".join(["pool", *(f"{x} ~{estimate_s(p, x):.0f}/{limit_s(p, x):.0f} s"
                                                      for x in cheap + expensive)]))
    print(f"## estimate: boots and cheap parts ~{total:.0f} s, expensive parts ~{expensive_total:.0f} s, budget "
          f"{args.budget_s:.0f} s (checkpoint, prepared copy and drafter first, ~170 s)")
    print("## expensive parts, in order (+: side by side): " + ", ".join(order))
    for what, why in not_tried(planned).items():
        print(f"# not tried: {what}: {why}")
    return 0


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path, help=f"where {REPORT} and the logs go")
    p.add_argument("--site", type=Path, default=Path("/tmp/site"), help="the staged stock stack (default %(default)s)")
    p.add_argument("--patched-site", type=Path, default=Path("/tmp/patched"),
                   help="a folder holding the patched vllm package (default %(default)s)")
    p.add_argument("--ckpt", type=Path, default=Path("/tmp/qwen-scripted-full"),
                   help="the scripted full checkpoint, generated here if missing (default %(default)s)")
    p.add_argument("--prepared-ckpt", type=Path, default=Path("/tmp/qwen-scripted-full-prepared"),
                   help="the prepared copy every server serves, made here if missing (default %(default)s)")
    p.add_argument("--flashinfer-site", type=Path, default=Path("/tmp/flashinfer-site"),
                   help="FlashInfer beside the stack (tests/gpu/install-flashinfer.sh; default %(default)s): the "
                        "FlashInfer configs are planned only when it is installed and imports")
    p.add_argument("--quant-site", type=Path, default=Path("/tmp/quant-site"),
                   help="the GPTQ quant site beside the stack (tests/gpu/install-quant.sh; default %(default)s): "
                        "issue #19's configs are planned only where it is installed")
    p.add_argument("--drafter", type=Path, default=Path("/tmp/qwen-scripted-dflash2"),
                   help="the scripted DFlash2 drafter, generated here if missing (default %(default)s)")
    p.add_argument("--base-port", type=int, default=18100, help="config i listens on base + i")
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S, help="the whole run (default %(default)s)")
    p.add_argument("--dry-run", action="store_true", help="print the waves, commands and parts; start nothing")
    p.add_argument("--plans", type=lambda v: [x for x in v.split(",") if x], default=[], metavar="NAME[,NAME]",
                   help=f"only these configs, e.g. a visit's share of them (default all: {', '.join(NAMES)})")
    args = p.parse_args(argv)
    unknown = [name for name in args.plans if name not in NAMES]
    if unknown:
        p.error(f"--plans {','.join(unknown)}: no such config ({', '.join(NAMES)})")
    if not args.dry_run and not (args.patched_site / "vllm" / "__init__.py").is_file():
        p.error(f"--patched-site {args.patched_site}: no vllm package there")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.dry_run:
        return dry_run(args)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a kill still stops the servers
    return run(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
